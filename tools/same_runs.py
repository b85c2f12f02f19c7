"""Check that two checkouts of polytrain train bit for bit alike (a refactor must not change numerics).

    git worktree add /tmp/before <commit>
    python tools/same_runs.py /tmp/before/src src

Runs every strategy on digits with each checkout's sources (in fresh processes): single, sync (with
--accumulate 2, and over gloo with Adam), async --staleness 0, local-sgd, diloco, pipeline (1f1b), hybrid 2 x 2
(and with --shard-dp), fsdp, and tp and hybrid with --tp on a small transformer_lm, and compares every logged
loss, every evaluation and the saved models exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import torch

LM = dict(model="transformer_lm:layers=2,dim=32,heads=2", data="text:seq_len=16")
CASES = {
    "single": dict(strategy="single"),
    "sync": dict(strategy="sync", workers=2),
    "sync_accumulate": dict(strategy="sync", workers=2, accumulate=2),
    "sync_gloo_adam": dict(strategy="sync", workers=2, comm="backend", optimizer="adam", lr=0.01),
    "async_staleness0": dict(strategy="async", workers=2, staleness=0),
    "local_sgd": dict(strategy="local-sgd", workers=2, sync_every=4),
    "diloco": dict(strategy="diloco", workers=2, sync_every=4, outer_momentum=0.5),
    "pipeline_1f1b": dict(strategy="pipeline", stages=2, microbatches=4, schedule="1f1b", split_at="classifier"),
    "hybrid_2x2": dict(strategy="hybrid", workers=4, dp=2, pp=2, microbatches=2, split_at="classifier"),
    "fsdp": dict(strategy="fsdp", workers=2),
    "hybrid_shard_dp": dict(strategy="hybrid", workers=4, dp=2, pp=2, shard_dp=True, microbatches=2,
                            split_at="classifier"),
    "tp": dict(strategy="tp", workers=2, tp=2, **LM),
    "hybrid_tp": dict(strategy="hybrid", workers=4, dp=1, pp=2, tp=2, microbatches=2, split_at="blocks.1", **LM),
}
RUN = """
import sys, polytrain
out, cases = sys.argv[1], {cases!r}
for name, extra in cases.items():
    polytrain.fit(**{{**dict(model="digits_cnn", data="digits"), **extra}}, steps=40, batch_size=64, seed=3,
                  progress="off", log_every=1, eval_every=20, metrics_file=f"{{out}}/{{name}}.jsonl",
                  save_model=f"{{out}}/{{name}}.pt")
"""


def _train(src: str, out: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
    subprocess.run([sys.executable, "-c", RUN.format(cases=CASES), out], env=env, check=True, cwd=out)


def _records(path: str) -> list[dict]:
    return [{k: v for k, v in r.items() if k in ("event", "step", "loss", "eval_loss", "eval_accuracy")}
            for r in map(json.loads, open(path)) if r["event"] in ("step", "eval")]


def main(before: str, after: str) -> int:
    dirs = [tempfile.mkdtemp(prefix="same-runs-") for _ in range(2)]
    for src, out in zip((before, after), dirs):
        _train(src, out)
    same = True
    for name in CASES:
        records = [_records(f"{d}/{name}.jsonl") for d in dirs]
        models = [torch.load(f"{d}/{name}.pt", weights_only=True) for d in dirs]
        equal_model = models[0].keys() == models[1].keys() and all(torch.equal(models[0][k], models[1][k])
                                                                     for k in models[0])
        print(f"{name}: {len(records[0])} records identical: {records[0] == records[1]}; "
              f"model bit-identical: {equal_model}")
        same &= records[0] == records[1] and equal_model
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
