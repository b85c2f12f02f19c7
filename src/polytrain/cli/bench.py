"""``polytrain bench``: throughput of single, sync and plain PyTorch DDP on the same steps, in one run
(``--suite throughput``, the default); a pipeline's speed-up against its theoretical one
(``--suite pipeline``); every pipeline configuration run 200 steps under a time limit (``--suite
pipeline-soak``); --compile and --activation-checkpointing against eager (``--suite compile``); fsdp against a
plain fully_shard loop, with each rank's memory (``--suite fsdp``); tp against a plain parallelize_module loop
(``--suite tp``); useful steps per second of a job that loses a
worker every minute, against the same job undisturbed (``--suite goodput``); each strategy's step against the plain
PyTorch loop of the same thing, with a profile of polytrain's own part (``--suite overhead``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

from polytrain.errors import ConfigError

DESCRIPTION = """\
--suite throughput (default): measure examples/sec of the same training steps (model, data, per-worker
batch) run seven ways: polytrain single with 1 thread, polytrain single with all cores, polytrain sync with
N workers x 1 thread (as shipped; with slices balanced by measured speed, --balance auto; and over the
process group's all-reduce like the DDP script, --comm backend), a plain hand-written PyTorch DDP
script with N workers x 1 thread, and that script with no gradient exchange at all (the most any
data-parallel method can reach on this machine). Every case runs with the same --host-memory, the DDP
script included. Each case is timed after a warm-up, all cases
are repeated in interleaved order and the medians are compared: polytrain sync / DDP, and weak-scaling
efficiency = sync N / (N x single 1 thread). Ratios are what to read: absolute numbers drift on a shared
machine, ratios taken in the same run much less. Any model and in-memory dataset can be measured
(--model transformer_lm --data text: a language model, whose rows also give tokens/s).

--suite pipeline: single with 1 thread against pipeline with --stages P processes x 1 thread, same global
--batch-size, for each of --microbatches and each schedule the installed torch provides (and, as the
machine's ceiling, P processes training independently at once): measured speed-up,
theoretical speed-up P*vM/(vM+P-1), efficiency (their ratio), the bubble (theoretical, simulated, measured
per stage) and each stage's busy/idle seconds per step; then the balance of --split-at auto for 2 and 4
stages. --plot FILE draws it (matplotlib).

--suite pipeline-soak: every pipeline configuration of the parity tests (P=2 and 4, M in {P, 2P}, each
schedule; hybrid 2 x 2) trains --steps (200) steps on a tiny model, each under a --timeout wall-clock limit:
a table of steps, seconds and ok / failed / hung.

--suite compile: single with 1 thread, the same batches four ways: eager, --compile, --activation-checkpointing
full, and both; examples/s after the warm-up steps, the first step's seconds (compilation), peak memory and
final loss of each, and the speed ratios compiled / eager and checkpointed / eager.

--suite fsdp: polytrain --strategy fsdp with --workers N x 1 thread against a plain FSDP2 loop (fully_shard on
each unit and the root, Adam or SGD, cross-entropy) on the same model, initial values and batches, and
polytrain sync for reference; examples/s after the warm-up (and by the median step), the speed ratio fsdp /
plain (median of the per-repeat ratios, with min-max) and each rank's peak memory and parameter, gradient
and optimizer bytes.

--suite tp: polytrain --strategy tp --tp N (N workers x 1 thread, every rank the whole global --batch-size)
against a plain tensor-parallel loop (parallelize_module with the same plan written out by hand, Adam or SGD,
cross-entropy) on the same transformer_lm, initial values and batches; examples/s after the warm-up (and by the
median step) and the speed ratio tp / plain (median of the per-repeat ratios, with min-max). With --dp-shard S:
fsdp x tp (polytrain --strategy fsdp --workers S*N --tp N) against the plain loop with fully_shard over the
dp_shard axis of the same dp_shard x tp mesh after parallelize_module over tp (target >= 0.98).

--suite overhead: what polytrain's own step machinery costs. Each row trains the same model, initial values and
batches twice, polytrain and the plain PyTorch loop of the same thing, back to back (swapped every repeat):
single on a tiny mlp (steps of about 2 ms) and on the default model against a plain loop in the same process;
sync, fsdp, tp and pipeline on tiny models (2 workers x 1 thread) against the plain DDP, fully_shard,
parallelize_module and pipelining loops. Per row: each side's ms per step, the speed ratio polytrain / plain
(median of the per-repeat ratios, with min-max; target >= 0.97 for single on the tiny mlp), polytrain's extra ms
per step and the machine's load (1-minute average) while it ran; then a profile (cProfile over the steady steps)
of polytrain's own time in a single step, by part (loss reduction, NaN guard, metrics, stop check, log points,
memory meter, phases, ...) and by function. --cases picks rows.

--suite goodput: polytrain train (sync, --workers 4) run for --duration seconds of wall time (600) three ways:
undisturbed; with a random worker SIGKILLed every --failure-every seconds (60) and --max-restarts, a checkpoint
every --checkpoint-every-seconds (30) and, with --snapshot-every K, a snapshot in memory every K steps; and the same
failures with --on-failure continue. Useful steps (the
step reached when the time is up) per second, and goodput = useful steps / the undisturbed job's. Three jobs:
about 3 x --duration in all."""

SUITES = ("throughput", "pipeline", "pipeline-soak", "compile", "fsdp", "tp", "goodput", "overhead")

#: smaller settings for --quick: checks that every case runs, in seconds; its numbers mean little
QUICK = {
    "throughput": {"data": "synthetic:shape=3x24x24,size=256,test_size=0", "worker_batch_size": 8, "warmup": 1,
                   "steps": 2, "repeats": 1},
    "pipeline": {"model": "transformer_lm:layers=4,dim=32,heads=2", "data": "text:seq_len=16", "batch_size": 8,
                 "microbatches": (2,), "warmup": 1, "steps": 2, "repeats": 1},
    "pipeline-soak": {"steps": 4, "timeout": 120.0},
    "compile": {"model": "transformer_lm:layers=1,dim=16,heads=2", "data": "text:seq_len=16", "batch_size": 8,
                "warmup": 1, "steps": 2, "repeats": 1},
    "fsdp": {"model": "transformer_lm:layers=1,dim=16,heads=2", "data": "text:seq_len=16", "worker_batch_size": 4,
             "warmup": 1, "steps": 2, "repeats": 1},
    "tp": {"model": "transformer_lm:layers=1,dim=16,heads=2", "data": "text:seq_len=16", "batch_size": 4,
           "warmup": 10, "steps": 20, "repeats": 1},  # (a step of tens of ms; the warm-up: a log interval)
    "overhead": {"warmup": 2, "steps": 4, "repeats": 1},
    "goodput": {"duration": 20.0, "failure_every": 8.0, "checkpoint_every_seconds": 4.0, "workers": 2},
}


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _seconds(text: str) -> float:
    from polytrain.bench.goodput import parse_seconds

    try:
        return parse_seconds(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(sub: Any) -> None:
    from polytrain.devices.host_memory import HOST_MEMORY_CHOICES

    parser = sub.add_parser("bench", help="throughput of single, sync and DDP; pipeline speed-up and soak suites",
                            description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=SUITES, default="throughput", help="what to measure (default: throughput)")
    parser.add_argument("--model", help="model (default: the suite's); a language model such as transformer_lm "
                                        "with --data text")
    parser.add_argument("--data", help="in-memory dataset (default: the suite's); for language-model data "
                                       "tokens/s is reported too")
    parser.add_argument("--worker-batch-size", type=int, metavar="N",
                        help="throughput and fsdp: examples per worker per step")
    parser.add_argument("--workers", type=int, metavar="N",
                        help="throughput, fsdp and tp: workers of sync, DDP, fsdp and tp (default: 2)")
    parser.add_argument("--batch-size", type=int, metavar="N",
                        help="pipeline, compile and tp suites: the global batch per step")
    parser.add_argument("--dp-shard", type=int, metavar="S",
                        help="tp: also shard each tp group over S ranks (fsdp x tp, S x --workers processes) against "
                             "a plain parallelize_module + fully_shard loop (default: 1)")
    parser.add_argument("--stages", type=int, metavar="P", help="pipeline: stage processes (default: 2)")
    parser.add_argument("--microbatches", type=_ints, metavar="M,M,..",
                        help="pipeline: micro-batch counts (default: 1,2,4,8)")
    parser.add_argument("--schedules", type=_names, metavar="S,S,..",
                        help="pipeline suites: schedules (default: every one the installed torch provides)")
    parser.add_argument("--warmup", type=int, metavar="N", help="untimed steps first")
    parser.add_argument("--steps", type=int, metavar="N", help="timed steps per run (pipeline-soak: steps per "
                                                               "configuration, default 200)")
    parser.add_argument("--repeats", type=int, metavar="N",
                        help="runs of every case, interleaved; the median counts (default: 3)")
    parser.add_argument("--lr", type=float, help="learning rate")
    parser.add_argument("--optimizer", choices=("adam", "sgd"),
                        help="fsdp and tp: the optimizer of every case (default: adam)")
    parser.add_argument("--seed", type=int, help="seed (default: 0)")
    parser.add_argument("--timeout", type=float, metavar="S", help="collective timeout (pipeline-soak: wall-clock "
                                                                   "seconds per configuration, default 300)")
    parser.add_argument("--host-memory", choices=HOST_MEMORY_CHOICES,
                        help="throughput, fsdp and tp: freed tensor memory in every case, the plain scripts' too "
                             "(default: cache)")
    parser.add_argument("--duration", type=_seconds, metavar="S",
                        help="goodput: wall time of each job, e.g. 600 or 10m (default: 600)")
    parser.add_argument("--failure-every", type=_seconds, metavar="S",
                        help="goodput: seconds between killed workers, e.g. 60s (default: 60)")
    parser.add_argument("--checkpoint-every-seconds", type=float, metavar="S",
                        help="goodput: the --max-restarts job's checkpoint interval (default: 30)")
    parser.add_argument("--snapshot-every", type=int, metavar="K",
                        help="goodput: the --max-restarts job's snapshots in memory, every K steps (default: 0, "
                             "none)")
    parser.add_argument("--jobs", type=_names, dest="sides", metavar="J,J,..",
                        help="goodput: which jobs (default: undisturbed,max-restarts,continue)")
    parser.add_argument("--cases", type=_names, metavar="ROW,ROW,..",
                        help="overhead: which rows (default: all of single-mlp,single-default,sync,fsdp,tp,pipeline)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny settings and 1 repeat of 2 steps: checks that everything runs (numbers are noise)")
    parser.add_argument("--plan", action="store_true", help="print the cases that would run and exit")
    parser.add_argument("--json", metavar="FILE",
                        help="write config, environment, rows and ratios here (default: polytrain-bench.json, "
                             "polytrain-bench-pipeline.json, polytrain-bench-pipeline-soak.json)")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table as Markdown")
    parser.add_argument("--plot", metavar="FILE.png", help="pipeline: also draw speed-up and bubble against M")
    parser.set_defaults(handler=run)


def _config_class(suite: str) -> type:
    if suite == "pipeline":
        from polytrain.bench.pipeline import PipelineBenchConfig
        return PipelineBenchConfig
    if suite == "pipeline-soak":
        from polytrain.bench.pipeline_soak import SoakConfig
        return SoakConfig
    if suite == "compile":
        from polytrain.bench.compile import CompileBenchConfig
        return CompileBenchConfig
    if suite == "fsdp":
        from polytrain.bench.fsdp import FsdpBenchConfig
        return FsdpBenchConfig
    if suite == "tp":
        from polytrain.bench.tp import TpBenchConfig
        return TpBenchConfig
    if suite == "goodput":
        from polytrain.bench.goodput import GoodputBenchConfig
        return GoodputBenchConfig
    if suite == "overhead":
        from polytrain.bench.overhead import OverheadBenchConfig
        return OverheadBenchConfig
    from polytrain.bench.cases import BenchConfig
    return BenchConfig


#: flags that are not fields of any suite's config
_NOT_SETTINGS = {"suite", "quick", "plan", "json", "markdown", "plot", "handler", "command"}


def bench_config(args: argparse.Namespace):
    """The suite's config from the flags given; a flag the suite does not read is one ConfigError line."""
    suite = getattr(args, "suite", "throughput")
    cls = _config_class(suite)
    names = {f.name for f in dataclasses.fields(cls)}
    for key, value in vars(args).items():
        if value is not None and key not in _NOT_SETTINGS and key not in names:
            raise ConfigError(f"--{key.replace('_', '-')} is not read by --suite {suite}; drop it "
                              f"(see polytrain bench --help)")
    if args.plot and suite != "pipeline":
        raise ConfigError("--plot draws the pipeline suite only; drop it or pass --suite pipeline")
    values = dict(QUICK[suite]) if args.quick else {}
    values.update({k: v for k, v in vars(args).items() if k in names and v is not None})
    return cls(**values)


def run(args: argparse.Namespace) -> int:
    from polytrain.errors import RunStopped

    cfg = bench_config(args)
    cfg.check()
    _progress.restart()  # (the clock from this command's start)
    try:
        doc = _SUITES.get(args.suite, _run_throughput)(cfg, args)
    except (RunStopped, KeyboardInterrupt) as exc:  # a signal stopped a run, or came between two: the whole bench
        name, signum = (exc.signal_name, exc.signum) if isinstance(exc, RunStopped) else ("SIGINT", signal.SIGINT)
        done = f" after {_progress.done} of {_progress.total} runs" if _progress.total else ""
        raise RunStopped(f"bench stopped by {name or 'a signal'}{done}; no results written (a stopped bench keeps "
                         "no measurement: run it again)", signal_name=name, signum=int(signum),
                         resumable=False) from None
    if doc is None:
        return 0
    path = args.json or {"throughput": "polytrain-bench.json"}.get(args.suite, f"polytrain-bench-{args.suite}.json")
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")
    written = [path]
    if args.markdown:
        written.append(args.markdown)
    if args.plot:
        written.append(args.plot)
    print(f"\nwritten: {', '.join(written)}")
    return 0 if doc.get("all_ok", True) else 1


_RUN = re.compile(r"^\[(\d+)/(\d+)\]")


class _Progress:
    """A suite's progress lines; after each ``[i/N]`` run, the time left at the pace so far."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self.started, self.done, self.total = time.monotonic(), 0, 0

    def __call__(self, message: str) -> None:
        run = _RUN.match(message)
        if run:
            self.done, self.total = int(run.group(1)), int(run.group(2))
            left = (time.monotonic() - self.started) / self.done * (self.total - self.done)
            message += f"; about {_duration(left)} left" if self.done < self.total else ""
        print(message, flush=True)


_progress = _Progress()


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def _run_throughput(cfg, args: argparse.Namespace) -> dict | None:
    from polytrain.bench import describe, format_markdown, format_text, plan, run_bench
    from polytrain.bench.cases import BenchConfig
    from polytrain.distributed.launch import available_cores

    print(describe(cfg, plan(cfg)), flush=True)
    runs = len(plan(cfg)) * cfg.repeats
    usual = " (the default settings: about 7 min on 2 CPU cores)" if cfg == BenchConfig() else ""
    print(f"{runs} runs{usual}; the time left follows each", flush=True)
    if args.plan:
        return None
    if cfg.workers > available_cores():
        print(f"polytrain: warning: {cfg.workers} workers on {available_cores()} cores: the workers share cores, "
              "so weak scaling cannot be reached", file=sys.stderr)
    return _report(run_bench(cfg, progress=_progress), args, format_text, format_markdown)


def _run_pipeline(cfg, args: argparse.Namespace) -> dict | None:
    from polytrain.bench.pipeline import cases
    from polytrain.bench.pipeline_report import PlotUnavailable, format_markdown, format_text, plot, run_suite

    chosen, skipped = cases(cfg)
    print(f"{cfg.model} on {cfg.data}, global batch {cfg.batch_size}, {cfg.warmup} warm-up + {cfg.steps} timed "
          f"steps, {cfg.repeats} interleaved repeat(s):", flush=True)
    print("\n".join(f"  {c.label}" for c in chosen) + "".join(f"\n  not run: {s}" for s in skipped), flush=True)
    if args.plan:
        return None
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (before minutes of measuring, not after)
        except ImportError:
            print("polytrain: warning: --plot needs matplotlib (pip install 'polytrain[plot]'); "
                  "no plot will be drawn", file=sys.stderr)
            args.plot = None
    doc = _report(run_suite(cfg, progress=_progress), args, format_text, format_markdown)
    if args.plot:
        try:
            plot(doc, args.plot)
        except PlotUnavailable as exc:
            print(f"polytrain: warning: {exc}", file=sys.stderr)
            args.plot = None
    return doc


def _report(doc: dict, args: argparse.Namespace, format_text: Callable[[dict], str],
            format_markdown: Callable[[dict], str]) -> dict:
    """A suite's results printed, and written as Markdown with --markdown."""
    print("\n" + format_text(doc))
    if args.markdown:
        Path(args.markdown).write_text(format_markdown(doc))
    return doc


def _run_soak(cfg, args: argparse.Namespace) -> dict | None:
    from polytrain.bench.pipeline_soak import format_markdown, format_text, run_soak, soak_cases

    chosen, skipped = soak_cases(cfg)
    print(f"{len(chosen)} configurations, {cfg.steps} steps each, at most {cfg.timeout:g} s each:", flush=True)
    print("\n".join(f"  {c.label}" for c in chosen) + "".join(f"\n  not run: {s}" for s in skipped), flush=True)
    return None if args.plan else _report(run_soak(cfg, progress=_progress), args, format_text, format_markdown)


def _run_compile(cfg, args: argparse.Namespace) -> dict | None:
    from polytrain.bench.compile import CASES, format_markdown, format_text, run_suite

    print(f"{cfg.model} on {cfg.data}, batch {cfg.batch_size}, single with 1 thread, {cfg.warmup} warm-up + "
          f"{cfg.steps} timed steps, {cfg.repeats} interleaved repeat(s):", flush=True)
    print("\n".join(f"  {case.label}" for case in CASES), flush=True)
    return None if args.plan else _report(run_suite(cfg, progress=_progress), args, format_text, format_markdown)


def _run_fsdp(cfg, args: argparse.Namespace) -> dict | None:
    from polytrain.bench.fsdp import describe, format_markdown, format_text, run_suite

    print(describe(cfg), flush=True)
    return None if args.plan else _report(run_suite(cfg, progress=_progress), args, format_text, format_markdown)


def _run_tp(cfg, args: argparse.Namespace) -> dict | None:
    from polytrain.bench.tp import describe, format_markdown, format_text, run_suite

    print(describe(cfg), flush=True)
    return None if args.plan else _report(run_suite(cfg, progress=_progress), args, format_text, format_markdown)


def _run_goodput(cfg, args: argparse.Namespace) -> dict | None:
    from polytrain.bench.goodput import describe, format_markdown, format_text, run_suite

    print(describe(cfg), flush=True)
    return None if args.plan else _report(run_suite(cfg, progress=_progress), args, format_text, format_markdown)


def _run_overhead(cfg, args: argparse.Namespace) -> dict | None:
    from polytrain.bench.overhead import describe, format_markdown, format_text, run_suite

    print(describe(cfg), flush=True)
    return None if args.plan else _report(run_suite(cfg, progress=_progress), args, format_text, format_markdown)


_SUITES = {"overhead": _run_overhead, "pipeline": _run_pipeline, "pipeline-soak": _run_soak, "compile": _run_compile, "fsdp": _run_fsdp,
           "tp": _run_tp, "goodput": _run_goodput, "throughput": _run_throughput}
