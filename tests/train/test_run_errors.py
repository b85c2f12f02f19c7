"""Settings a run refuses as one line: the checks before launch (train/run.py) and the ones the session makes
when it builds the run (train/session.py)."""

import re

import pytest
import torch

import polytrain
from polytrain.config import make_config
from polytrain.data.base import DataBundle, TensorData
from polytrain.errors import ConfigError
from polytrain.train.run import check


@pytest.mark.parametrize("settings", [dict(optimizer="adam", momentum=0.9), dict(optimizer="sgd", momentum=0.0)])
def test_nesterov_needs_sgd_momentum(settings):
    with pytest.raises(ConfigError, match=re.escape("--nesterov needs --optimizer sgd and --momentum > 0")):
        check(make_config(strategy="single", data="digits", nesterov=True, **settings))


def test_a_batch_larger_than_data_given_from_python_is_one_line():
    # data= skips the size check before launch (only the session sees the data): the batch plan refuses it
    tiny = TensorData(torch.randn(4, 3), torch.tensor([0, 1, 0, 1]))
    data = DataBundle(name="tiny", train=tiny, test=None, input_shape=(3,), num_classes=2)
    with pytest.raises(ConfigError, match=r"^--batch-size: the global batch \(8\) is larger than the dataset "
                                          r"\(4 examples\); use a smaller batch or fewer workers$"):
        polytrain.fit(data=data, model="mlp:hidden=4", strategy="single", batch_size=8, steps=1, progress="off",
                      eval_every=0)


@pytest.mark.parametrize("settings, message", [
    (dict(strategy="sync", servers=2),
     "--servers 2 is a setting of --strategy async, which --strategy sync does not read; drop it, or use async"),
    (dict(strategy="diloco", tolerate_worker_loss=True),
     "--tolerate-worker-loss is a setting of --strategy async, which --strategy diloco does not read; drop it, "
     "or use async"),
    (dict(strategy="async", sync_every=4),
     "--sync-every 4 is a setting of --strategy diloco and local-sgd, which --strategy async does not read; "
     "drop it, or use diloco or local-sgd"),
    (dict(strategy="single", comm="backend", staleness=2, microbatches=2),
     "--staleness 2 (async), --microbatches 2 (hybrid, pipeline), --comm backend (sync): settings of other "
     "strategies, which --strategy single does not read; drop them"),
    (dict(strategy="pipeline", dp=2), "--dp 2: hybrid's deprecated name of --dp-replicate, which --strategy "
                                      "pipeline does not read; use --dp-replicate (or --strategy hybrid)"),
])
def test_a_setting_of_another_strategy_is_one_line(settings, message):
    """Left silently unread, --servers or --tolerate-worker-loss would leave the user thinking they act."""
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        check(make_config(data="digits", workers=2, **settings))


@pytest.mark.parametrize("settings", [
    dict(strategy="async", servers=2, staleness=1, tolerate_worker_loss=True),
    dict(strategy="local-sgd", sync_every=4), dict(strategy="diloco", sync_every=4, outer_lr=0.5),
    dict(strategy="hybrid", dp=1, pp=2, model="mlp:hidden=8x8"),
    dict(strategy="sync", comm="backend", tolerate_worker_loss=False, servers=1),  # defaults given: nothing unread
])
def test_a_strategy_accepts_its_own_settings(settings):
    check(make_config(data="digits", workers=2, **settings))
