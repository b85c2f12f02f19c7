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
