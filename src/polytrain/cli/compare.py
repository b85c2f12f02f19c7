"""``polytrain compare``: which strategy to pick, measured on your model, data and machine."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

DESCRIPTION = """\
Train one model on one dataset with the same budget under several strategies, one after another, and with
--straggler once more with a worker slowed down; then print a table: examples/sec (and the ratio to sync
under the same stragglers), wall seconds of training until an evaluation first reaches --target-accuracy
(or --target-loss), the final evaluation, bytes sent per training example (and how many times fewer than
sync) and the staleness of applied updates where the strategy reports it. Every case gets the same
examples per worker per step (--worker-batch-size) and the same steps, so every case trains on the same
examples. Writes compare.json, compare.md and compare.png (loss against wall-clock time and against
examples seen; needs matplotlib: pip install polytrain[plot]) to --out, and each case's metrics file under
--out/runs/."""


def add_parser(sub: Any) -> None:
    from polytrain.compare.specs import CompareConfig

    d = CompareConfig()
    parser = sub.add_parser("compare", help="train with several strategies (and stragglers) and compare them",
                            description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", metavar="SPECS",
                        help="comma-separated NAME[:KEY=VALUE...], e.g. sync,async:staleness=2,"
                             f"local-sgd:sync_every=8 (default: {d.strategies}; a default one not available "
                             "in this install is skipped)")
    parser.add_argument("--straggler", action="append", metavar="SPEC", dest="stragglers",
                        help="also run every strategy with this straggler (RANK:FACTOR or random:P:FACTOR; "
                             "repeatable), e.g. 1:2")
    for name, metavar, kind, what in (
        ("workers", "N", int, "worker processes"), ("data", "NAME", str, "dataset"), ("model", "NAME", str, "model"),
        ("optimizer", "NAME", str, "optimizer (the inner one for diloco)"), ("lr", "LR", float, "learning rate"),
        ("momentum", "M", float, "momentum"), ("worker_batch_size", "N", int, "examples per worker per step"),
        ("steps", "N", int, "steps per case"), ("eval_every", "N", int, "evaluate every N steps"),
        ("log_every", "N", int, "log every N steps (divides --eval-every)"), ("seed", "N", int, "seed"),
        ("target_accuracy", "A", float, "eval accuracy whose first reaching is timed"),
        ("target_loss", "L", float, "eval loss whose first reaching is timed (instead of or with accuracy)"),
        ("repeats", "R", int, "rounds of every case, interleaved; the table gives medians, and the spread of "
                              "the speed ratios over the rounds (on a shared machine use 3 or more)"),
    ):
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, metavar=metavar,
                            help=f"{what} (default: {getattr(d, name)})")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any further training setting for every case, by config key (repeatable), "
                             "e.g. --set comm=backend")
    parser.add_argument("--link", action="append", metavar="RATE[,RATE...]", dest="link",
                        help="run every case on an emulated network instead: each process in a network namespace "
                             "of its own, joined to one bridge by a link of RATE each way (tc's words: 100mbit, "
                             "1gbit); several rates run every case at each. Needs Linux and root "
                             "(docs/network-lab.md)")
    parser.add_argument("--out", default="compare-results", metavar="DIR",
                        help="where the table, plot and per-case metrics go (default: compare-results)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    parser.add_argument("--plan", action="store_true", help="print the runs that would be made and exit")
    parser.set_defaults(handler=run)


def compare_config(args: argparse.Namespace):
    from polytrain.compare.specs import CompareConfig
    from polytrain.specs import parse_assignments

    values: dict[str, Any] = {}
    for field in dataclasses.fields(CompareConfig):
        given = getattr(args, field.name, None)
        if given is not None and field.name != "extra":
            values[field.name] = given
    if args.target_loss is not None and args.target_accuracy is None:
        values["target_accuracy"] = None  # a loss target alone replaces the default accuracy target
    if getattr(args, "link", None):
        from polytrain.compare.link import parse_links
        values["links"] = parse_links(args.link)
    try:
        values["extra"] = parse_assignments(args.set) if args.set else {}
    except ValueError as exc:
        from polytrain.errors import ConfigError
        raise ConfigError(f"--set: {exc}") from None
    return CompareConfig(**values)


def run(args: argparse.Namespace) -> int:
    from polytrain import compare

    cfg = compare_config(args)
    cfg.check()
    from polytrain.advise.measure import parse  # a value may hold ':' (sync:compress=powersgd:rank=4)

    specs, notes = compare.available(parse(cfg.strategies), named_by_user=args.strategies is not None)
    cases = compare.plan_cases(cfg, specs)
    compare.check_cases(cfg, cases)
    if cfg.links:
        from polytrain.compare.link import check_link
        check_link(cfg.links)
    if not args.no_plot:
        import importlib.util
        if importlib.util.find_spec("matplotlib") is None:
            from polytrain.errors import ConfigError
            raise ConfigError("the plot needs matplotlib: pip install polytrain[plot], or pass --no-plot")
    for note in notes:
        print(f"note: {note}", flush=True)
    if args.plan:
        print(f"{len(cases) * cfg.repeats} runs of {cfg.steps} steps ({cfg.model} on {cfg.data}, {cfg.workers} "
              f"workers), in this order:\n" + "\n".join(f"  {case.label}" for case in cases), flush=True)
        return 0
    out = Path(args.out)
    outcomes = compare.run_cases(cfg, cases, out / "runs", progress=lambda message: print(message, flush=True))
    doc = compare.document(cfg, compare.rows(cfg, outcomes), outcomes, notes)
    print("\n" + compare.format_text(doc))
    (out / "compare.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "compare.md").write_text(compare.format_markdown(doc))
    written = [out / "compare.json", out / "compare.md"]
    if not args.no_plot:
        compare.plot(outcomes, out / "compare.png", title=f"{cfg.model} on {cfg.data}, {cfg.workers} workers",
                     table=doc["rows"])
        written.append(out / "compare.png")
    print("wrote " + ", ".join(str(p) for p in written))
    return 0
