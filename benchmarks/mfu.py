"""Model FLOPs utilisation of ``polytrain train`` on one GPU, against a plain PyTorch loop of the same model.

Both sides train the same ``transformer_lm`` (the same initial values: ``build_model(..., seed=S)``) on the same
``text`` windows, with bf16 autocast (``--precision bf16-mixed``), ``torch.compile`` (``--compile``) and Adam,
in one call, in the order plain, polytrain, plain (the plain figure is the mean of its two runs, so a clock
that drifts during the call weighs on both sides alike).

- FLOPs of one training step are counted, not estimated: ``torch.utils.flop_counter.FlopCounterMode`` over one
  forward and backward of the uncompiled model on one batch (matrix products and attention; elementwise work
  is not counted, as in every MFU figure).
- Steps per second are the steady rate: polytrain's summary ``examples_per_sec`` (its warm-up steps apart),
  and for the plain loop the steps after its warm-up, timed between two ``torch.cuda.synchronize()``.
- MFU = FLOPs per step x steps per second / the card's peak dense bf16 FLOP/s. The peak comes from the card's
  name (the table below, from NVIDIA's data sheets) or ``--peak-tflops``.

Run on a GPU machine, from a checkout::

    PYTHONPATH=src python3 benchmarks/mfu.py --out gpu-check/mfu.json

``tools/gpu_check.sh`` runs it and keeps its report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

#: peak dense bf16 tensor-core TFLOP/s (no sparsity), by a part of the name torch reports; first match wins
PEAK_BF16_TFLOPS = {
    "H200": 989.4,
    "H100 PCIe": 756.5,
    "H100 NVL": 835.0,
    "H100": 989.4,  # SXM (HBM3)
    "A100": 312.0,
    "L40S": 362.1,
    "A10G": 70.0,
    "L4": 121.0,
}


def peak_tflops(name: str, given: float | None) -> float | None:
    if given:
        return given
    return next((value for part, value in PEAK_BF16_TFLOPS.items() if part in name), None)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/mfu.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="transformer_lm:layers=8,dim=1024,heads=16")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=60, help="steps of each run (warm-up included)")
    p.add_argument("--warmup", type=int, default=10, help="the plain loop's untimed first steps")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--no-compile", action="store_true", help="both sides eager")
    p.add_argument("--plain-compile", choices=("model", "unit"), default="model",
                   help="the plain loop compiles the whole model (torch.compile(model), what a user writes) or "
                        "each unit as --compile does")
    p.add_argument("--peak-tflops", type=float, help="the card's peak dense bf16 TFLOP/s (else from its name)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the figures here as JSON")
    return p.parse_args(argv)


def batches(data, batch_size: int, seed: int, device: torch.device):
    """The training windows in a seeded order, batch by batch, forever."""
    gen = torch.Generator().manual_seed(seed)
    n = len(data.train)
    while True:
        order = torch.randperm(n, generator=gen)
        for start in range(0, n - batch_size + 1, batch_size):
            xs, ys = zip(*(data.train[int(i)] for i in order[start:start + batch_size]))
            yield (torch.stack([torch.as_tensor(x) for x in xs]).to(device, non_blocking=True),
                   torch.stack([torch.as_tensor(y) for y in ys]).to(device, non_blocking=True))


def build(args: argparse.Namespace, data) -> torch.nn.Module:
    from polytrain.models.registry import build_model

    return build_model(args.model, input_shape=data.input_shape, num_classes=data.num_outputs, seed=args.seed)


def step_flops(args: argparse.Namespace, data, device: torch.device) -> int:
    """FLOPs of one forward and backward on one batch (FlopCounterMode, eager, under bf16 autocast)."""
    from torch.utils.flop_counter import FlopCounterMode

    from polytrain.bench.ddp_reference import cross_entropy

    model = build(args, data).to(device)
    x, y = next(batches(data, args.batch_size, args.seed, device))
    counter = FlopCounterMode(display=False)
    with counter:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = cross_entropy(model(x), y)
        loss.backward()
    del model
    torch.cuda.empty_cache()
    return counter.get_total_flops()


def plain(args: argparse.Namespace, data, device: torch.device) -> float:
    """Steps per second of the plain loop after its warm-up."""
    from polytrain.bench.ddp_reference import cross_entropy

    model = build(args, data).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    if args.no_compile:
        run = model
    elif args.plain_compile == "unit":
        from polytrain.train.unit_options import UnitConfig, apply_unit_options

        run = apply_unit_options(model, UnitConfig(compile=True))
    else:
        run = torch.compile(model)
    feed = batches(data, args.batch_size, args.seed, device)
    start = time.perf_counter()
    for step in range(args.steps):
        if step == args.warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        x, y = next(feed)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = cross_entropy(run(x), y)
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    rate = (args.steps - args.warmup) / (time.perf_counter() - start)
    del model, opt, run
    torch.cuda.empty_cache()
    return rate


def polytrain_run(args: argparse.Namespace, data_spec: str) -> dict:
    import polytrain

    return polytrain.fit(strategy="single", device="cuda", model=args.model, data=data_spec,
                         batch_size=args.batch_size, steps=args.steps, optimizer="adam", lr=args.lr,
                         precision="bf16-mixed", compile=not args.no_compile, eval_every=0, progress="off",
                         seed=args.seed, log_every=10)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/mfu.py: needs a CUDA device", file=sys.stderr)
        return 2
    from polytrain.data.registry import build_data

    device = torch.device("cuda", 0)
    name = torch.cuda.get_device_name(device)
    data_spec = f"text:seq_len={args.seq_len}"
    data = build_data(data_spec)
    flops = step_flops(args, data, device)
    plain_rates = [plain(args, data, device)]
    summary = polytrain_run(args, data_spec)
    plain_rates.append(plain(args, data, device))
    plain_rate = sum(plain_rates) / len(plain_rates)
    ours_rate = summary["examples_per_sec"] / args.batch_size
    peak = peak_tflops(name, args.peak_tflops)
    result = {
        "card": name, "torch": torch.__version__, "model": args.model, "seq_len": args.seq_len,
        "batch_size": args.batch_size, "compile": not args.no_compile, "plain_compile": args.plain_compile, "precision": "bf16-mixed",
        "parameters": sum(p.numel() for p in build(args, data).parameters()),
        "flops_per_step": flops, "peak_tflops": peak,
        "plain_steps_per_s": [round(r, 3) for r in plain_rates],
        "polytrain_steps_per_s": round(ours_rate, 3),
        "polytrain_warmup_s": summary.get("warmup_s"),
        "polytrain_peak_memory_mb": summary.get("peak_memory_mb"),
        "ratio": round(ours_rate / plain_rate, 4),
    }
    for side, rate in (("plain", plain_rate), ("polytrain", ours_rate)):
        result[f"{side}_tflops"] = round(flops * rate / 1e12, 1)
        result[f"{side}_mfu"] = round(flops * rate / (peak * 1e12), 4) if peak else None
    print(f"{name}: {args.model}, {args.batch_size} x {args.seq_len} tokens, bf16-mixed"
          f"{'' if args.no_compile else ', compiled'}: {flops / 1e12:.2f} TFLOP a step "
          f"({result['parameters'] / 1e6:.0f} M parameters)")
    for side in ("plain", "polytrain"):
        mfu = result[f"{side}_mfu"]
        print(f"  {side:9s} {result[f'{side}_tflops']:7.1f} TFLOP/s"
              + (f"  MFU {mfu:.1%} of {peak} TFLOP/s" if mfu is not None else "  (peak unknown: --peak-tflops)"))
    print(f"  polytrain / plain: {result['ratio']:.3f} (plain runs: {result['plain_steps_per_s']} steps/s, "
          f"polytrain {result['polytrain_steps_per_s']})")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
