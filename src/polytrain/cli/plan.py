"""``polytrain plan``: what a run would be laid out as, printed without starting any process.

The layout of any strategy for the settings given (the same flags and ``--config`` files as ``polytrain
train``): its processes, each rank's role and name, the mesh axes of the trainer ranks and each one's
coordinates, the ranks the job may lose, the slices of a global batch. With a ``tp`` axis, the tensor-parallel
plan (which layers are split colwise or rowwise, how many each entry names). For ``pipeline`` and ``hybrid`` also
the schedule: per rank, the ordered actions of one optimizer step (F forward, B backward, I/W its input and
weight halves in the zero-bubble schedules), laid out in time by a replay with unit costs, and the bubble:
the simulated one and the theoretical (P-1)/(vM+P-1). Then each rank's memory for parameters, gradients,
optimizer state and activations, estimated from the model built on the meta device
(:mod:`polytrain.parallel.memory_plan`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

DESCRIPTION = """\
Print how a run would be laid out -- processes, roles, mesh axes, slices of each global batch -- and, for
pipeline and hybrid, each rank's schedule with its bubble, then each rank's estimated memory, without
starting any process. Takes the same settings as 'polytrain train' (flags or --config FILE.toml)."""

EXAMPLES = """\
examples:
  polytrain plan --strategy async --workers 3 --servers 2
  polytrain plan --strategy hybrid --dp 2 --pp 2
  polytrain plan --strategy tp --workers 4 --tp 2 --model transformer_lm --data text
  polytrain plan --strategy pipeline --stages 4 --microbatches 8 --schedule interleaved-1f1b --json
  polytrain plan --strategy fsdp --workers 4 --model transformer_lm --data text --optimizer adam
  polytrain plan --strategy pipeline --stages 2 --model my_models:gpt2 --data text --split-at transformer.h.2
"""


def add_parser(sub: Any) -> None:
    from polytrain.cli.train import add_settings

    parser = sub.add_parser("plan", help="print a run's layout (and a pipeline's schedule); starts nothing",
                            description=DESCRIPTION, epilog=EXAMPLES,
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            argument_default=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print the layout (and schedule) as JSON")
    add_settings(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from polytrain.cli.train import config_from
    from polytrain.strategies.registry import declared, declared_class
    from polytrain.strategies.settings import check_settings_read
    from polytrain.parallel.memory_plan import estimate_memory
    from polytrain.parallel.degrees import order
    from polytrain.train.run import layout_of, warn_deprecated

    config = config_from(args)
    warn_deprecated(config)
    layout = layout_of(config)  # (the batch and the model are train's to check: this is their layout)
    check_settings_read(config, declared_class(config, layout), declared())
    schedule = _schedule(config, layout)
    traced_split = _traced_split(config, layout)  # a model the tracer cuts: where, and what each stage holds
    tp_plan = _tp_plan(config, layout)
    memory = estimate_memory(config, layout)  # each rank's bytes, from a model that allocates nothing
    steps = order(dict(layout.axes), declared_class(config, layout).traits.meeting, config.units)
    if getattr(args, "json", False):
        print(json.dumps({"layout": layout.as_dict(), "order": [s.strip() for s in steps],
                          **({"pipeline": schedule} if schedule else {}),
                          **({"traced_split": dataclasses.asdict(traced_split)} if traced_split else {}),
                          **({"tp_plan": tp_plan[0].as_dict()} if tp_plan else {}),
                          "memory": memory.as_dict()}, indent=2))
        return 0
    print(layout.describe())
    print("  in order: how each replica is made, then how the replicas meet:")
    print("\n".join(f"  {step}" for step in steps))
    if tp_plan:
        print()
        print(tp_plan[0].describe(layout.axis("tp"), tp_plan[1]))
    if schedule:
        from polytrain.parallel.pp import plan

        print()
        print(plan.chart(schedule["schedule"], schedule["ranks"], schedule["microbatches"]))
    if traced_split:
        from polytrain.parallel.pp import plan

        print()
        print(traced_split.describe([plan.stage_rank(s, layout.axis("pp"), "loop")
                                     for s in range(len(traced_split.stage_names))]))
    print()
    print(memory.describe())
    return 0


def _tp_plan(config: Any, layout: Any) -> tuple[Any, Any] | None:
    """The tensor-parallel plan and the model it splits (on the meta device), where the layout has a ``tp``
    axis; checked as train checks it (one line if it cannot split the model)."""
    if layout.axis("tp") == 1:
        return None
    from polytrain.models.registry import meta_model
    from polytrain.parallel.tp.strategy import check_tp

    model = meta_model(config)
    plan = check_tp(config, model, layout.axis("tp"))
    return (plan, model) if plan is not None else None


def _traced_split(config: Any, layout: Any) -> Any:
    """Where the tracer would cut a model that is not a chain of units, where the layout has a ``pp`` axis."""
    if layout.axis("pp") == 1:
        return None
    from polytrain.parallel.pp.traced_run import plan_split

    return plan_split(config, layout)


def _schedule(config: Any, layout: Any) -> dict[str, Any] | None:
    """Each pipeline's schedule as data, where the layout has a ``pp`` axis."""
    if layout.axis("pp") == 1:
        return None
    from polytrain.parallel.pp import plan

    opts = config.pipeline
    ranks, microbatches = layout.axis("pp"), opts.microbatches
    plan.check_schedule(opts.schedule, ranks, microbatches)
    info = plan.schedule_info(opts.schedule)
    timeline = plan.simulate(opts.schedule, ranks, microbatches)
    return {
        "schedule": opts.schedule, "ranks": ranks, "microbatches": microbatches, "stages_per_rank": info.chunks,
        "actions": [[str(a) for a in rank] for rank in plan.actions(opts.schedule, ranks, microbatches)],
        "bubble_simulated": float(timeline.bubble),
        "bubble_theoretical": float(plan.theoretical_bubble(ranks, microbatches, info.chunks)),
    }
