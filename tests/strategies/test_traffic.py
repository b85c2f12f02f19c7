"""Bytes counted on real gloo workers: sync's gradient buckets through shared memory and through the process
group, DDP's buffer broadcast, and nothing for single."""

import torch
from torch import nn

from polytrain.config import make_config
from polytrain.data.base import DataBundle, TensorData
from polytrain.distributed.topology import Topology
from polytrain.train.trainer import Trainer
from tests.helpers.spawn import spawn

STEPS = 6
COMMON = dict(optimizer="sgd", lr=0.05, batch_size=16, steps=STEPS, seed=1, progress="off", eval_every=0,
              log_every=3)


def _bundle() -> DataBundle:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 12, generator=gen)
    y = (x.sum(1) > 0).long()
    return DataBundle("bytes", TensorData(x[:48], y[:48]), TensorData(x[48:], y[48:]), (12,), 2)


def _with_batchnorm() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


def _runs(ctx, bundle):
    out = {}
    for name, model, comm in (("shm", None, "shm"), ("gloo", None, "backend"), ("bn", _with_batchnorm(), "backend")):
        config = make_config(strategy="sync", comm=comm, model="mlp:hidden=8", **COMMON)
        trainer = Trainer(config, ctx.topology, model=model, data=bundle)
        summary = trainer.fit()
        unwrapped = trainer.strategy.module
        out[name] = (summary, sum(p.numel() * 4 for p in unwrapped.parameters()),
                     sum(b.numel() * b.element_size() for b in unwrapped.buffers()))
    return out


def test_sync_counts_its_buckets_and_buffer_broadcasts():
    result = spawn(_runs, 2, _bundle())[0]
    shm, grads, _ = result["shm"]
    # shared memory: a rank copies its gradients in plus its half of the sum (1.5x), and reads 2x back
    assert shm["rank_bytes_sent"] == [round(1.5 * grads) * STEPS] * 2
    assert shm["rank_bytes_received"] == [2 * grads * STEPS] * 2
    gloo, _, _ = result["gloo"]
    assert gloo["rank_bytes_sent"] == gloo["rank_bytes_received"] == [grads * STEPS] * 2  # ring, N = 2
    assert gloo["bytes_sent_per_example"] == round(2 * grads * STEPS / (STEPS * 16), 2)
    bn, bn_grads, buffers = result["bn"]
    assert buffers > 0
    # DDP broadcasts rank 0's BatchNorm statistics once a step: rank 0 sends them, rank 1 receives them
    assert bn["rank_bytes_sent"] == [(bn_grads + buffers) * STEPS, bn_grads * STEPS]
    assert bn["rank_bytes_received"] == [bn_grads * STEPS, (bn_grads + buffers) * STEPS]


def test_single_reports_no_bytes(tmp_path):
    metrics = tmp_path / "m.jsonl"
    summary = Trainer(make_config(strategy="single", model="mlp:hidden=8", metrics_file=str(metrics), **COMMON),
                      Topology(), data=_bundle()).fit()
    assert summary["bytes_sent"] == summary["bytes_received"] == 0
    assert '"rank_bytes_sent": [0]' in metrics.read_text()
