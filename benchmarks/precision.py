"""Training throughput of each --precision against 32-true, measured inside one run, on a transformer_lm.

One process holds one replica per precision, each prepared by polytrain's ``single`` strategy as a run would
prepare it (bf16-true: the model cast to bfloat16 before ``prepare``; the mixed modes: autocast around forward
and loss, 16-mixed's loss scaler), all from the same initial weights, and trains them on the same batches of
the shipped text. The replicas take turns in blocks of ``--block`` steps, in an order rotated every round (so
no precision always follows another), the first step of each block left out as the switch's transition; each
round gives one ratio per precision: 32-true's mean step time over its own (above 1: faster). The report gives
every ratio's median, min and max over the rounds, so a machine shared with other work shows as spread.

    python benchmarks/precision.py --rounds 12 --block 6 --json benchmarks/results/cpu-2core-precision.json \\
        --markdown benchmarks/results/cpu-2core-precision.md
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time

import torch

from polytrain.data.batches import Batch
from polytrain.data.registry import build_data
from polytrain.distributed.topology import Topology
from polytrain.models.registry import build_model
from polytrain.precision import PRECISIONS, Precision, cast_model
from polytrain.strategies.single import SingleDevice
from polytrain.strategies.step import StepRecipe
from polytrain.tasks import get_task


def replicas(model_spec: str, data, lr: float) -> dict[str, SingleDevice]:
    """One ``single`` strategy per precision, each over its own copy of the same initial model."""
    torch.manual_seed(0)
    model = build_model(model_spec, input_shape=data.input_shape, num_classes=data.num_outputs)
    built = {}
    for name in PRECISIONS:
        precision = Precision(name)
        strategy = SingleDevice(Topology())
        recipe = StepRecipe(get_task(data.task), precision=precision)
        strategy.prepare(cast_model(copy.deepcopy(model), precision),
                         lambda params: torch.optim.Adam(params, lr=lr), recipe)
        built[name] = strategy
    return built


def batches(data, batch_size: int, count: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for step in range(count):
        indices = torch.randint(len(data.train), (batch_size,), generator=generator)
        inputs, targets = data.train.get_batch(indices)
        out.append(Batch(step, inputs, targets, global_units=data.train.count_units(indices)))
    return out


def block_time(strategy: SingleDevice, block: list[Batch], lr: float) -> float:
    """Mean seconds per step over the block, its first step left out; the loss read once, at the end."""
    strategy.train_step(block[0], lr)
    started = time.perf_counter()
    for batch in block[1:]:
        loss = strategy.train_step(batch, lr).loss
    float(loss)  # the device's work done (a no-op wait on the CPU)
    return (time.perf_counter() - started) / (len(block) - 1)


def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    data = build_data(args.data)
    built = replicas(args.model, data, args.lr)
    pool = batches(data, args.batch_size, args.block)
    names = list(built)
    rounds = []
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        seconds = {name: block_time(built[name], pool, args.lr) for name in order}
        rounds.append({name: seconds["32-true"] / seconds[name] for name in names if name != "32-true"}
                      | {"32-true_ms_per_step": 1000 * seconds["32-true"]})
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in rounds[-1].items()), flush=True)
    summary = {}
    for key in rounds[0]:
        values = [row[key] for row in rounds]
        summary[key] = {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
                        "max": round(max(values), 3)}
    skipped = built["16-mixed"].amp.skipped_total
    return {"command": "python benchmarks/precision.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("json", "markdown")),
            "settings": vars(args), "machine": _machine(), "torch": torch.__version__,
            "tokens_per_step": args.batch_size * data.input_shape[0],
            "parameters": sum(p.numel() for p in built["32-true"].module.parameters()),
            "speedup_over_32_true": summary, "rounds": rounds, "16_mixed_skipped_steps": skipped}


def _machine() -> dict:
    flags = ""
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next((line for line in fh if line.startswith("flags")), "")
    except OSError:
        pass
    return {"cpu": platform.processor() or platform.machine(), "cores": torch.get_num_threads(),
            "avx512_bf16": "avx512_bf16" in flags.split(), "amx_bf16": "amx_bf16" in flags.split(),
            "avx512_fp16": "avx512_fp16" in flags.split()}


def markdown(result: dict) -> str:
    s, m = result["settings"], result["machine"]
    lines = [f"# --precision throughput against 32-true: {s['model']}, {result['parameters']:,} parameters",
             "",
             f"`{result['command']}`",
             "",
             f"{s['threads']} thread(s); CPU flags: avx512_bf16 {m['avx512_bf16']}, amx_bf16 {m['amx_bf16']}, "
             f"avx512_fp16 {m['avx512_fp16']}; torch {result['torch']}; {result['tokens_per_step']} tokens a step; "
             f"{s['rounds']} rounds of {s['block']}-step blocks (first step of each block left out).",
             "",
             "| precision | speed-up over 32-true (median) | min | max |",
             "|---|---|---|---|"]
    for name, row in result["speedup_over_32_true"].items():
        if name.endswith("_ms_per_step"):
            continue
        lines.append(f"| {name} | {row['median']:.2f} | {row['min']:.2f} | {row['max']:.2f} |")
    ms = result["speedup_over_32_true"]["32-true_ms_per_step"]
    lines += ["", f"32-true: {ms['median']:.1f} ms a step (median; {ms['min']:.1f}-{ms['max']:.1f}). "
              f"16-mixed skipped {result['16_mixed_skipped_steps']} step(s)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="transformer_lm", help="model spec (default: 4 layers, width 128)")
    parser.add_argument("--data", default="text:seq_len=128")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--block", type=int, default=6)
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    result = measure(args)
    text = markdown(result)
    print(text)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
