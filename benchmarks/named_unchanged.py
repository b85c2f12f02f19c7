"""Each named strategy trains as it did before the degrees of one mesh: the same command, run by this checkout
and by an earlier commit (a git worktree of it, made and removed here), saves the same model bit for bit.

    python benchmarks/named_unchanged.py                      # against the commit before the degrees layout
    python benchmarks/named_unchanged.py --against REF --only sync,fsdp

Every strategy trains ``transformer_lm:layers=2,dim=32,heads=2`` on ``text:seq_len=16`` for 8 steps (SGD with
momentum, the same seed), in the command line that both versions accept; the table gives, per strategy, the
number of tensors and the largest absolute difference between the two saved models (0 is bit for bit). Exit
status 1 when one differs or a run fails. About 20 s a run on 2 cores, two runs a strategy.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BEFORE_DEGREES = "5e12a80^"  # the last commit before --dp-replicate/--dp-shard/--pp/--tp became one layout
COMMON = ["--model", "transformer_lm:layers=2,dim=32,heads=2", "--data", "text:seq_len=16", "--steps", "8",
          "--batch-size", "8", "--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.05", "--seed", "3",
          "--eval-every", "0", "--progress", "off", "--threads-per-worker", "1"]
NAMED = {
    "single": ["--strategy", "single"],
    "sync": ["--strategy", "sync", "--workers", "2"],
    "fsdp": ["--strategy", "fsdp", "--workers", "2"],
    "tp": ["--strategy", "tp", "--workers", "2", "--tp", "2"],
    "pipeline": ["--strategy", "pipeline", "--stages", "2", "--microbatches", "2"],
    "hybrid": ["--strategy", "hybrid", "--dp", "2", "--pp", "2"],
    "async": ["--strategy", "async", "--workers", "2", "--staleness", "0"],
    "local-sgd": ["--strategy", "local-sgd", "--workers", "2", "--sync-every", "4"],
    "diloco": ["--strategy", "diloco", "--workers", "2", "--sync-every", "4"],
}


def train(tree: Path, args: list[str], out: Path) -> str | None:
    """Run ``polytrain train`` from ``tree``'s sources; None, or the last lines of a failure."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    done = subprocess.run([sys.executable, "-m", "polytrain", "train", *COMMON, *args, "--save-model", str(out)],
                          env=env, cwd=out.parent, capture_output=True, text=True, timeout=900)
    return None if done.returncode == 0 else "\n".join(done.stderr.strip().splitlines()[-3:])


def difference(a: Path, b: Path) -> tuple[int, float]:
    """(tensors, largest absolute difference); inf where the two do not hold the same names and shapes."""
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    if x.keys() != y.keys() or any(x[k].shape != y[k].shape for k in x):
        return len(x), float("inf")
    return len(x), max(((x[k].double() - y[k].double()).abs().max().item() for k in x), default=0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default=BEFORE_DEGREES, help="the earlier commit (default: %(default)s)")
    parser.add_argument("--only", default=",".join(NAMED), help="comma-separated strategies (default: all)")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(NAMED))
    if unknown:
        parser.error(f"--only: unknown strategies {unknown}; known: {', '.join(NAMED)}")
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.against], capture_output=True,
                            text=True, check=True).stdout.strip()
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    failed = False
    with tempfile.TemporaryDirectory(prefix="polytrain-named-") as tmp:
        earlier = Path(tmp) / "earlier"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(earlier), commit], check=True)
        try:
            print(f"this checkout ({head}, with its uncommitted changes) against {commit}: 8 steps each, "
                  "largest |difference| of the saved models")
            print(f"{'strategy':<10} {'tensors':>7}  largest difference")
            for name in names:
                runs = {}
                for label, tree in (("now", ROOT), ("earlier", earlier)):
                    out = Path(tmp) / f"{name}-{label}.pt"
                    runs[label] = (out, train(tree, NAMED[name], out))
                errors = [f"{label}: {error}" for label, (_, error) in runs.items() if error]
                if errors:
                    failed = True
                    print(f"{name:<10} {'-':>7}  failed: {' | '.join(errors)}")
                    continue
                count, largest = difference(runs["now"][0], runs["earlier"][0])
                failed |= largest != 0.0
                print(f"{name:<10} {count:>7}  {largest:.3g}{'' if largest == 0.0 else '  (differs)'}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(earlier)], check=False)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
