"""``polytrain plan``: a pipeline schedule as data, printed without starting any process.

Per rank, the ordered actions of one optimizer step (F forward, B backward, I/W its input and weight
halves in the zero-bubble schedules), laid out in time by a replay with unit costs, and the bubble: the
simulated one and the theoretical (P-1)/(vM+P-1).
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(sub: Any) -> None:
    from polytrain.strategies.pipeline.plan import SCHEDULES

    parser = sub.add_parser("plan", help="print a pipeline schedule as a time x stage chart (starts nothing)",
                            description="Print the per-rank actions of a pipeline schedule as a time x rank "
                                        "chart with its bubble fraction, without starting any process.")
    parser.add_argument("--strategy", default="pipeline", choices=("pipeline", "hybrid"),
                        help="the strategy whose schedule to print (hybrid: each replica's pipeline)")
    parser.add_argument("--stages", "--pp", dest="stages", type=int, default=2, metavar="P",
                        help="pipeline stages (processes per pipeline)")
    parser.add_argument("--microbatches", type=int, default=4, metavar="M", help="micro-batches per step")
    parser.add_argument("--schedule", default="1f1b", choices=tuple(SCHEDULES), help="the schedule")
    parser.add_argument("--json", action="store_true", help="print the action lists and bubbles as JSON")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from polytrain.errors import ConfigError
    from polytrain.strategies.pipeline import plan

    if args.microbatches < 1:
        raise ConfigError(f"--microbatches must be >= 1, got {args.microbatches}")
    if not args.json:
        print(plan.chart(args.schedule, args.stages, args.microbatches))
        return 0
    info = plan.schedule_info(args.schedule)
    timeline = plan.simulate(args.schedule, args.stages, args.microbatches)
    print(json.dumps({
        "schedule": args.schedule, "ranks": args.stages, "microbatches": args.microbatches,
        "stages_per_rank": info.chunks,
        "actions": [[str(a) for a in rank] for rank in plan.actions(args.schedule, args.stages, args.microbatches)],
        "bubble_simulated": float(timeline.bubble),
        "bubble_theoretical": float(plan.theoretical_bubble(args.stages, args.microbatches, info.chunks)),
    }, indent=2))
    return 0
