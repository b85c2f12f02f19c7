"""Sync BatchNorm on N CPU workers equals one BatchNorm on the whole global batch."""

import pytest
import torch
from torch import nn

from polytrain.config import make_config
from polytrain.data.base import DataBundle, TensorData
from polytrain.distributed.topology import Topology
from polytrain.train.trainer import Trainer
from tests.helpers.spawn import spawn


def _bn_net() -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 6 * 6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def _bundle() -> DataBundle:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 3, 8, 8, generator=gen) * 2 + 0.5  # a non-zero mean exercises the centring
    y = torch.randint(0, 4, (64,), generator=gen)
    return DataBundle("bn", TensorData(x, y), None, (3, 8, 8), 4)


def _config(strategy, sync_batchnorm):
    return make_config(strategy=strategy, sync_batchnorm=sync_batchnorm, batch_size=16, steps=20, lr=0.01,
                       seed=0, progress="off", eval_every=0)


def _state(trainer):
    return {k: v.detach().clone() for k, v in trainer.session.strategy.module.state_dict().items()}


def _train(ctx, sync_batchnorm, bundle):
    trainer = Trainer(_config("sync", sync_batchnorm), ctx.topology, model=_bn_net(), data=bundle)
    trainer.fit()
    return _state(trainer)


def _rel(a, b):
    return max(((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp(min=1e-12)).item()
               for k in b if b[k].is_floating_point())


@pytest.fixture(scope="module")
def single_state():
    trainer = Trainer(_config("single", False), Topology(), model=_bn_net(), data=_bundle())
    trainer.fit()
    return _state(trainer)


def test_sync_batchnorm_matches_single_device_batchnorm(single_state):
    synced = spawn(_train, 2, True, _bundle())
    for state in synced:
        assert _rel(state, single_state) <= 1e-5  # weights and running statistics
    assert set(synced[0]) == set(single_state)  # the saved model keeps plain BatchNorm keys


def test_without_sync_batchnorm_statistics_are_per_worker(single_state):
    local = spawn(_train, 2, False, _bundle())
    assert _rel(local[0], single_state) > 1e-3
