"""sync against sync --compress powersgd:rank=R on the emulated network: 2 workers, each on its own link.

Both run the same steps on the same examples (compare's budget: digits_cnn, 32 examples per worker per step,
SGD lr 0.05 momentum 0.9), in interleaved rounds (A, B, A, B, ...), each in a fresh lab. Per round: examples/s
(compare's end-to-end number), the bytes counted by the strategy and those the links' counters saw, the final
accuracy; then the medians and min-max of the ratios. Needs root.

    python benchmarks/compress_link.py --rate 100mbit --repeats 3 --json benchmarks/results/link-100mbit-compress.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netlab_runs import run_on_link  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--model", default="digits_cnn")
    parser.add_argument("--data", default="digits")
    parser.add_argument("--compress", default="powersgd:rank=4")
    parser.add_argument("--workdir", default="/tmp/compress-link")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    base = dict(strategy="sync", comm="backend", workers=2, model=args.model, data=args.data, optimizer="sgd",
                lr=0.05, momentum=0.9, worker_batch_size=32, steps=args.steps, eval_every=40, log_every=10, seed=0)
    cases = {"sync": base, f"sync --compress {args.compress}": {**base, "compress": args.compress}}
    rounds = []
    for r in range(args.repeats):
        row = {}
        for label, settings in cases.items():
            run = run_on_link(f"{label}-round{r + 1}", settings, args.rate, Path(args.workdir))
            row[label] = {"examples_per_s": round(run.examples_per_s, 1), "counted_bytes": run.counted_bytes,
                          "link_tx_bytes": sum(run.tx_bytes), "accuracy": run.accuracy,
                          "loop_s": [x for x in run.records if x["event"] == "step"][-1]["time_s"]}
            print(f"round {r + 1} {label}: {row[label]}", flush=True)
        rounds.append(row)
    plain, packed = list(cases)
    ratio = lambda key, a, b: [x[a][key] / x[b][key] for x in rounds]  # noqa: E731
    summary = {
        "speed (compressed / sync)": ratio("examples_per_s", packed, plain),
        "counted bytes (sync / compressed)": ratio("counted_bytes", plain, packed),
        "link bytes (sync / compressed)": ratio("link_tx_bytes", plain, packed),
        "accuracy points (compressed - sync)": [100 * (x[packed]["accuracy"] - x[plain]["accuracy"]) for x in rounds],
    }
    print(f"\n{args.model}, 2 workers, {args.rate} links, {args.steps} steps, {args.repeats} rounds:")
    for name, values in summary.items():
        print(f"  {name}: median {statistics.median(values):.2f} (min {min(values):.2f}, max {max(values):.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "rate": args.rate, "rounds": rounds,
                                               "summary": summary}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
