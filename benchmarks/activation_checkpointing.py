"""What ``--activation-checkpointing`` saves and costs on an 8-block ``transformer_lm`` over 256 tokens.

    python benchmarks/activation_checkpointing.py --json benchmarks/results/cpu-2core-activation-checkpointing.json

For each width and each setting (off, every:2, full), in a fresh process (one thread) per run:

* **saved bytes**, exact: the distinct storages autograd keeps for backward during one forward of the model
  (``torch.autograd.graph.saved_tensors_hooks``; parameters not counted). With checkpointing a unit keeps
  only its inputs, so this is what the setting changes.
* **peak RSS growth** over the first full forward+backward (after one step on a single sequence, so that
  the kernels' one-time allocations are made): the process's high-water mark (``ru_maxrss``) after the
  step minus before it. It holds the saved activations, the gradients, the loss's tensors and the
  allocator's slack: the number a machine feels.
* **peak tensor memory**, exact: the most bytes of tensors alive at once during one step, parameters and
  gradients included, from the profiler's memory timeline (``profile_memory=True``).
* **step time**: the median of 5 forward+backward+SGD steps after that.

Each run repeats ``--repeats`` times; the table gives the median and the spread.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

SETTINGS = ("off", "every:2", "full")


def one(dim: int, setting: str, batch: int) -> dict:
    import torch
    import torch.nn.functional as F

    import polytrain.components  # noqa: F401
    from polytrain.models.transformer_lm import transformer_lm
    from polytrain.train.unit_options import UnitConfig, apply_unit_options

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = transformer_lm(input_shape=(256,), num_classes=256, layers=8, dim=dim, heads=4)
    apply_unit_options(model, UnitConfig(activation_checkpointing=setting))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    tokens = torch.randint(0, 256, (batch, 256), generator=torch.Generator().manual_seed(1))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def step(batch: torch.Tensor, measure: bool = False) -> None:
        optimizer.zero_grad(set_to_none=True)
        if measure:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                logits = model(batch)
        else:
            logits = model(batch)
        F.cross_entropy(logits.flatten(0, 1), batch.flatten()).backward()
        optimizer.step()

    # the first step: its high-water mark is what this step holds at once (a later step would only reuse it)
    step(torch.zeros(1, 256, dtype=torch.long))  # the kernels' own first-use allocations, on 1/8 of the batch
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step(tokens, measure=True)
    peak_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB on Linux
    times = []
    for _ in range(5):
        start = time.perf_counter()
        step(tokens)
        times.append(time.perf_counter() - start)
    saved = sum(size for ptr, size in storages.items() if ptr not in params)
    return {"saved_mib": saved / 2**20, "peak_tensor_mib": peak_tensors(step, tokens) / 2**20,
            "peak_rss_growth_mib": peak_growth / 1024, "step_s": statistics.median(times)}


def peak_tensors(step, tokens) -> float:
    """The most bytes of tensors alive at once during one step (parameters included), from the profiler's
    memory timeline: exact, whatever malloc keeps."""
    import tempfile
    import warnings

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step(tokens)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the timeline export is deprecated, CUDA's snapshot replaces it
        prof.export_memory_timeline(f"{tmp}/timeline.json", device="cpu")
        with open(f"{tmp}/timeline.json") as fh:
            _, sizes = json.load(fh)
    return max(sum(point) for point in sizes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", default="64,128", help="model widths (default: 64,128)")
    parser.add_argument("--batch", type=int, default=8, help="sequences of 256 tokens per step (default: 8)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--one", nargs=2, metavar=("DIM", "SETTING"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(int(args.one[0]), args.one[1], args.batch)))
        return 0
    dims = [int(d) for d in args.dims.split(",")]
    runs: dict[str, dict[str, list[dict]]] = {str(d): {s: [] for s in SETTINGS} for d in dims}
    for repeat in range(args.repeats):
        for dim in dims:
            for setting in SETTINGS[repeat % 3:] + SETTINGS[:repeat % 3]:  # interleaved
                done = subprocess.run([sys.executable, __file__, "--batch", str(args.batch), "--one", str(dim),
                                       setting], capture_output=True, text=True, timeout=900)
                if done.returncode:
                    raise SystemExit(f"dim {dim} {setting} failed:\n{done.stderr[-3000:]}")
                runs[str(dim)][setting].append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"repeat {repeat + 1} dim {dim} {setting}: {runs[str(dim)][setting][-1]}", flush=True)
    rows = []
    for dim in dims:
        off = runs[str(dim)]["off"]
        for setting in SETTINGS:
            mine = runs[str(dim)][setting]
            row = {"dim": dim, "setting": setting}
            for key in ("saved_mib", "peak_tensor_mib", "peak_rss_growth_mib", "step_s"):
                values = [m[key] for m in mine]
                row[key] = round(statistics.median(values), 4)
                row[f"{key}_runs"] = [round(v, 4) for v in values]
            row["saved_vs_off"] = round(row["saved_mib"] / statistics.median(m["saved_mib"] for m in off), 4)
            row["peak_tensor_vs_off"] = round(
                row["peak_tensor_mib"] / statistics.median(m["peak_tensor_mib"] for m in off), 4)
            row["peak_rss_growth_vs_off"] = round(
                row["peak_rss_growth_mib"] / statistics.median(m["peak_rss_growth_mib"] for m in off), 4)
            row["step_time_vs_off"] = round(statistics.median(
                m["step_s"] / o["step_s"] for m, o in zip(mine, off)), 4)
            rows.append(row)
    print(f"\n8-block transformer_lm, 256 tokens, batch {args.batch}, 1 thread, median of {args.repeats} runs")
    print(f"{'dim':>4} {'setting':>8} {'saved MiB':>10} {'vs off':>7} {'peak tensors MiB':>17} {'vs off':>7} "
          f"{'peak RSS growth MiB':>20} {'vs off':>7} {'step s':>7} {'vs off':>7}")
    for r in rows:
        print(f"{r['dim']:>4} {r['setting']:>8} {r['saved_mib']:>10.2f} {r['saved_vs_off']:>7.3f} "
              f"{r['peak_tensor_mib']:>17.1f} {r['peak_tensor_vs_off']:>7.3f} "
              f"{r['peak_rss_growth_mib']:>20.1f} {r['peak_rss_growth_vs_off']:>7.3f} {r['step_s']:>7.3f} "
              f"{r['step_time_vs_off']:>7.3f}")
    if args.json:
        import torch

        doc = {"command": "python benchmarks/activation_checkpointing.py " + " ".join(sys.argv[1:]),
               "model": "transformer_lm:layers=8,heads=4,seq_len=256", "batch": args.batch, "threads": 1,
               "torch": torch.__version__, "rows": rows}
        with open(args.json, "w") as fh:
            fh.write(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
