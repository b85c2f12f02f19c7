"""``polytrain bench``: throughput of single, sync and plain PyTorch DDP on the same steps, in one run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

DESCRIPTION = """\
Measure examples/sec of the same training steps (model, data, per-worker batch) run seven ways: polytrain
single with 1 thread, polytrain single with all cores, polytrain sync with N workers x 1 thread (as shipped;
with slices balanced by measured speed, --balance auto; and over the process group's all-reduce like the
DDP script, --comm backend), a plain hand-written PyTorch DDP
script with N workers x 1 thread, and that script with no gradient exchange at all (the most any
data-parallel method can reach on this machine). Every case runs with the same --host-memory, the DDP
script included. Each case is timed after a warm-up, all cases
are repeated in interleaved order and the medians are compared: polytrain sync / DDP, and weak-scaling
efficiency = sync N / (N x single 1 thread). Ratios are what to read: absolute numbers drift on a shared
machine, ratios taken in the same run much less. Any model and in-memory dataset can be measured
(--model transformer_lm --data text: a language model, whose rows also give tokens/s)."""

#: smaller defaults for --quick: checks that every case runs, in seconds; its numbers mean little
QUICK = {"data": "synthetic:shape=3x24x24,size=256,test_size=0", "worker_batch_size": 8, "warmup": 1,
         "steps": 2, "repeats": 1}


def add_parser(sub: Any) -> None:
    from polytrain.bench.cases import BenchConfig
    from polytrain.devices.host_memory import HOST_MEMORY_CHOICES

    d = BenchConfig()
    parser = sub.add_parser("bench", help="compare the throughput of single, sync and plain PyTorch DDP",
                            description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help=f"model (default: {d.model}); a language model such as transformer_lm "
                                        "with --data text")
    parser.add_argument("--data", help=f"in-memory dataset (default: {d.data}); for language-model data "
                                       "tokens/s is reported too")
    parser.add_argument("--worker-batch-size", type=int, metavar="N",
                        help=f"examples per worker per step (default: {d.worker_batch_size})")
    parser.add_argument("--workers", type=int, metavar="N", help=f"workers of sync and DDP (default: {d.workers})")
    parser.add_argument("--warmup", type=int, metavar="N", help=f"untimed steps first (default: {d.warmup})")
    parser.add_argument("--steps", type=int, metavar="N", help=f"timed steps per run (default: {d.steps})")
    parser.add_argument("--repeats", type=int, metavar="N",
                        help=f"runs of every case, interleaved; the median counts (default: {d.repeats})")
    parser.add_argument("--lr", type=float, help=f"SGD learning rate (default: {d.lr})")
    parser.add_argument("--seed", type=int, help=f"seed (default: {d.seed})")
    parser.add_argument("--timeout", type=float, metavar="S", help=f"collective timeout (default: {d.timeout:g})")
    parser.add_argument("--host-memory", choices=HOST_MEMORY_CHOICES,
                        help=f"freed tensor memory in every case, the DDP script's too (default: {d.host_memory})")
    parser.add_argument("--quick", action="store_true",
                        help="tiny data and 1 repeat of 2 steps: checks that everything runs (numbers are noise)")
    parser.add_argument("--plan", action="store_true", help="print the cases that would run and exit")
    parser.add_argument("--json", default="polytrain-bench.json", metavar="FILE",
                        help="write config, environment, rows and ratios here (default: polytrain-bench.json)")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table as Markdown")
    parser.set_defaults(handler=run)


def bench_config(args: argparse.Namespace):
    from polytrain.bench.cases import BenchConfig

    values = dict(QUICK) if args.quick else {}
    for field in dataclasses.fields(BenchConfig):
        given = getattr(args, field.name, None)
        if given is not None:
            values[field.name] = given
    return BenchConfig(**values)


def run(args: argparse.Namespace) -> int:
    from polytrain.bench import describe, format_markdown, format_text, plan, run_bench
    from polytrain.distributed.launch import available_cores

    cfg = bench_config(args)
    cfg.check()
    print(describe(cfg, plan(cfg)), flush=True)
    if args.plan:
        return 0
    if cfg.workers > available_cores():
        print(f"polytrain: warning: {cfg.workers} workers on {available_cores()} cores: the workers share cores, "
              "so weak scaling cannot be reached", file=sys.stderr)
    doc = run_bench(cfg, progress=lambda message: print(message, flush=True))
    print("\n" + format_text(doc))
    Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    written = [args.json]
    if args.markdown:
        Path(args.markdown).write_text(format_markdown(doc))
        written.append(args.markdown)
    print(f"\nwritten: {', '.join(written)}")
    return 0
