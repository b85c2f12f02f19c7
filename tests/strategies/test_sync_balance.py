"""--balance in real gloo workers: a slow rank gets fewer examples, and the run still equals single."""

import json
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from polytrain.config import make_config
from polytrain.distributed.topology import Topology
from polytrain.errors import ConfigError
from polytrain.models import mlp
from polytrain.train.trainer import Trainer
from tests.helpers.spawn import spawn
from tests.strategies.test_sync import _bundle, _final_params, _relative_error

STEPS, GLOBAL_BATCH = 20, 16


class SlowOnRankOne(nn.Module):
    """An MLP whose forward takes 10 ms more per example on rank 1, like a worker on a busier core.

    10 ms, not 1-2: the split follows measured times, so rank 0 must stay clearly the faster one even when
    a loaded machine stalls it (it would need to lose ~8 ms per example, step after step, to look as slow)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.net = mlp((3, 24, 24), 10, hidden=(32,))

    def forward(self, x):
        if dist.is_initialized() and dist.get_rank() == 1:
            time.sleep(0.01 * len(x))
        return self.net(x)


def _config(strategy, comm, optimizer, accumulate, metrics=None, **extra):
    return make_config(strategy=strategy, optimizer=optimizer, lr=0.002 if optimizer == "sgd" else 1e-4,
                       momentum=0.9, accumulate=accumulate, batch_size=GLOBAL_BATCH, steps=STEPS, seed=7,
                       progress="off", eval_every=0, log_every=5, comm=comm, metrics_file=metrics, **extra)


def _train(ctx, bundle, comm, optimizer, accumulate, metrics):
    trainer = Trainer(_config("sync", comm, optimizer, accumulate, metrics, balance="on"), ctx.topology,
                      model=SlowOnRankOne(), data=bundle)
    trainer.fit()
    return _final_params(trainer), trainer.session.strategy.describe()


@pytest.mark.parametrize("comm, optimizer, accumulate", [("shm", "sgd", 1), ("backend", "adam", 2)])
def test_a_slow_rank_gets_fewer_examples_and_the_result_equals_single(tmp_path, comm, optimizer, accumulate):
    bundle = _bundle()
    reference = Trainer(_config("single", comm, optimizer, accumulate), Topology(), model=SlowOnRankOne(),
                        data=bundle)
    reference.fit()
    metrics = tmp_path / "m.jsonl"
    results = spawn(_train, 2, bundle, comm, optimizer, accumulate, str(metrics))

    steps = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["event"] == "step"]
    fast, slow = steps[-1]["rank_batch"]
    assert fast + slow == GLOBAL_BATCH and fast >= 11 and slow <= 5  # from 8 / 8 towards the 12 / 4 bound
    assert all(n % accumulate == 0 for n in (fast, slow))
    for params, described in results:
        assert "slices balanced by measured speed" in described
        err = _relative_error(params, _final_params(reference))
        assert err <= 1e-5, f"relative error {err:.2e}"


def _describe(ctx, bundle, settings):
    return Trainer(_config("sync", "auto", "sgd", 1, **settings), ctx.topology, data=bundle).session.strategy.describe()


def test_when_balancing_is_off_and_why():
    bundle = _bundle()
    auto, default, deterministic = (spawn(_describe, 2, bundle, kw)[0] for kw in (
        {"balance": "auto"}, {}, {"balance": "auto", "deterministic": True}))
    assert "slices balanced by measured speed (--balance)" in auto
    assert "balanced" not in default and "equal slices" not in default  # off unless asked for
    assert "equal slices (--deterministic; --balance on to balance)" in deterministic
    with pytest.raises(ConfigError, match="--balance on needs batches drawn in the workers themselves"):
        spawn(_describe, 2, bundle, {"balance": "on", "data_workers": 1})
