"""``polytrain advise``: which strategy to pick for a cluster this machine is not, predicted from short runs here."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

DESCRIPTION = """\
Measure, on this machine, each strategy's step time and the bytes each exchange sends, with your model, data
and batch (one short run per strategy on loopback, through 'polytrain compare'), then predict for the cluster
you describe (--workers, --link, --latency, --straggler, --servers) each strategy's examples/sec and time to
the target, and print them ranked, with the reasons in one paragraph. The cost model is in docs/choosing.md.
Writes advise.json (the measured profiles and the predictions), advise.md and advise.png (predicted
examples/sec against link rate per strategy; needs matplotlib: pip install polytrain[plot]) to --out.
--profiles FILE predicts again from an earlier advise.json without measuring."""

EXAMPLES = """\
examples:
  polytrain advise --workers 64 --link 10gbit
  polytrain advise --workers 8 --link 100mbit --link 1gbit --straggler random:0.05:3
  polytrain advise --model cifar_cnn --data cifar10:~/data/cifar-10-batches-py --workers 16 --link 25gbit
  polytrain advise --profiles advise-results/advise.json --workers 256 --link 400gbit --latency 5e-6
"""


def add_parser(sub: Any) -> None:
    from polytrain.advise.measure import DEFAULT_STRATEGIES
    from polytrain.compare.specs import CompareConfig

    d = CompareConfig()
    parser = sub.add_parser("advise", help="predict which strategy is fastest for a cluster, from short runs here",
                            description=DESCRIPTION, epilog=EXAMPLES,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=8, metavar="N",
                        help="workers of the cluster to predict for (default: 8)")
    parser.add_argument("--link", action="append", metavar="RATE",
                        help="each worker's link rate, e.g. 10gbit, 100mbit (repeatable; default: 10gbit)")
    parser.add_argument("--latency", type=float, default=0.0, metavar="S",
                        help="seconds per message on the links (default: 0)")
    parser.add_argument("--straggler", action="append", default=[], metavar="SPEC",
                        help="RANK:FACTOR or random:P:FACTOR, as in polytrain train (repeatable)")
    parser.add_argument("--servers", type=int, default=1, metavar="S",
                        help="parameter servers for async (default: 1)")
    parser.add_argument("--strategies", default=DEFAULT_STRATEGIES, metavar="SPECS",
                        help=f"strategies to measure, as in polytrain compare (default: {DEFAULT_STRATEGIES})")
    parser.add_argument("--measure-workers", type=int, default=2, metavar="N",
                        help="workers of each measuring run on this machine (default: 2)")
    for name, metavar, kind, what in (
        ("data", "NAME", str, "dataset"), ("model", "NAME", str, "model"), ("optimizer", "NAME", str, "optimizer"),
        ("lr", "LR", float, "learning rate"), ("momentum", "M", float, "momentum"),
        ("worker_batch_size", "N", int, "examples per worker per step"), ("steps", "N", int, "steps per run"),
        ("eval_every", "N", int, "evaluate every N steps"), ("log_every", "N", int, "log every N steps"),
        ("seed", "N", int, "seed"), ("target_accuracy", "A", float, "the target: eval accuracy"),
        ("target_loss", "L", float, "the target: eval loss (instead of accuracy)"),
    ):
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, metavar=metavar,
                            help=f"{what} (default: {getattr(d, name)})")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any further training setting for every run, by config key (repeatable)")
    parser.add_argument("--profiles", metavar="FILE", help="predict from an earlier advise.json; measure nothing")
    parser.add_argument("--out", default="advise-results", metavar="DIR",
                        help="where the table, plot and runs go (default: advise-results)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    parser.add_argument("--plan", action="store_true",
                        help="print the runs that would measure and the clusters predicted for, and exit")
    parser.set_defaults(handler=run)


def scenarios(args: argparse.Namespace) -> list[Any]:
    from polytrain.advise.model import Scenario
    from polytrain.errors import ConfigError
    from polytrain.netlab.lab import parse_rate
    from polytrain.train.straggler import parse_straggler

    if args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    if args.servers < 1:
        raise ConfigError(f"--servers must be >= 1, got {args.servers}")
    if not args.latency >= 0:
        raise ConfigError(f"--latency must be >= 0 seconds, got {args.latency:g}")
    slow: dict[int, float] = {}
    random = None
    for spec in args.straggler:
        try:
            found = parse_straggler(spec)
        except ValueError as exc:
            raise ConfigError(f"--straggler: {exc}") from None
        if found.rank is None:
            random = (found.probability, found.factor)
        elif found.rank >= args.workers:
            raise ConfigError(f"--straggler {spec}: rank {found.rank} is not among --workers {args.workers}")
        else:
            slow[found.rank] = found.factor
    return [Scenario(args.workers, parse_rate(rate), args.latency, slow, random, args.servers)
            for rate in (args.link or ["10gbit"])]


def run(args: argparse.Namespace) -> int:
    from polytrain.advise import measure, report
    from polytrain.cli.compare import compare_config
    from polytrain.errors import ConfigError

    cases = scenarios(args)
    if not args.no_plot:
        import importlib.util
        if importlib.util.find_spec("matplotlib") is None:
            raise ConfigError("the plot needs matplotlib: pip install polytrain[plot], or pass --no-plot")
    out = Path(args.out)
    if args.profiles:
        path = Path(args.profiles)
        if not path.is_file():
            raise ConfigError(f"--profiles: '{path}' is not a file; give an advise.json an earlier run wrote")
        profiles, meta = measure.load(path)
    else:
        args.stragglers, args.repeats = None, None  # measured without stragglers, once
        args.workers, wanted = args.measure_workers, args.workers
        cfg = compare_config(args)
        args.workers = wanted
        cfg.check()
        specs = measure.parse(args.strategies)
        from polytrain.compare.runner import Case, check_cases

        check_cases(cfg, [Case(measure.for_measuring(s), []) for s in specs])
        if args.plan:
            return _print_plan(cfg, specs, cases)
        profiles = measure.measure(cfg, specs, out / "runs", progress=lambda m: print(m, flush=True))
        meta = {"model": cfg.model, "data": cfg.data, "worker_batch_size": cfg.worker_batch_size,
                "measure_workers": cfg.workers, "steps": cfg.steps,
                "target": _target(cfg.target_accuracy, cfg.target_loss)}
    target = meta.get("target", "the target")
    doc = report.document(profiles, cases, target, meta)
    out.mkdir(parents=True, exist_ok=True)
    markdown = []
    for scenario, result in zip(cases, doc["scenarios"]):
        heading = f"{scenario.workers} workers, {report.format_rate(scenario.link_bps)} links"
        print(f"\n{heading} (measured: {meta.get('model')} on {meta.get('data')}, "
              f"{meta.get('worker_batch_size')} examples per worker per step)")
        print(report.text_table(result["header"], result["rows"]))
        print("\n" + result["reasons"])
        markdown += [f"## {heading}", "", report.markdown(result["header"], result["rows"]), "", result["reasons"], ""]
    (out / "advise.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "advise.md").write_text("\n".join(markdown))
    written = [out / "advise.json", out / "advise.md"]
    if not args.no_plot:
        report.plot(profiles, cases[0], out / "advise.png",
                    title=f"{meta.get('model')}: predicted for {cases[0].workers} workers")
        written.append(out / "advise.png")
    print("\nwrote " + ", ".join(str(p) for p in written))
    return 0


def _print_plan(cfg: Any, specs: list[Any], cases: list[Any]) -> int:
    from polytrain.advise import report

    print(f"measuring {len(specs)} runs of {cfg.steps} steps here ({cfg.model} on {cfg.data}, {cfg.workers} workers): "
          f"{', '.join(s.text for s in specs)}; then predicting for "
          + "; ".join(f"{c.workers} workers on {report.format_rate(c.link_bps)} links" for c in cases), flush=True)
    return 0


def _target(accuracy: float | None, loss: float | None) -> str:
    if accuracy is not None:
        return f"accuracy {accuracy:g}"
    return f"loss {loss:g}" if loss is not None else "the target"
