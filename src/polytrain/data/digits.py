"""``digits``: the UCI optical handwritten digits, shipped inside the package (no download at run time).

1,797 grey 8x8 images with values 0..16 and labels 0..9, as distributed with scikit-learn
(``tools/export_digits.py`` wrote ``digits.npz`` once). The split into 1,437 training and 360 test
examples is fixed (it does not change with ``--seed``) so accuracies are comparable across runs.

Data: E. Alpaydin and C. Kaynak, "Optical Recognition of Handwritten Digits", UCI Machine Learning
Repository, 1998, https://doi.org/10.24432/C50P49, licensed CC BY 4.0.
"""

from __future__ import annotations

from importlib import resources

import numpy as np
import torch

from polytrain.data.base import DataBundle, TensorData
from polytrain.errors import DataError

TEST_SIZE = 360
_SPLIT_SEED = 20_240_101  # fixed: the split belongs to the dataset, not to the run
_MAX_PIXEL = 16.0
DIGITS_SIZE = 1797


def _to_unit_range(inputs: torch.Tensor, indices: torch.Tensor, epoch: int) -> torch.Tensor:
    return inputs.to(torch.float32) / _MAX_PIXEL


def load_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The stored ``images`` (uint8, 1797x8x8) and ``labels`` (uint8)."""
    try:
        with resources.files("polytrain.data").joinpath("digits.npz").open("rb") as f, np.load(f) as npz:
            return npz["images"], npz["labels"]
    except (FileNotFoundError, KeyError, ValueError) as exc:
        raise DataError(f"digits: the packaged file digits.npz is missing or damaged ({exc}); "
                        "reinstall polytrain") from None


def digits(test_size: int = TEST_SIZE) -> DataBundle:
    """Train/test split of the digits; inputs are 1x8x8 floats in [0, 1]."""
    images, labels = load_arrays()
    if not 0 < test_size < len(labels):
        raise DataError(f"digits: test_size must be between 1 and {len(labels) - 1}, got {test_size}")
    inputs = torch.from_numpy(images).unsqueeze(1)  # N x 1 x 8 x 8, uint8
    targets = torch.from_numpy(labels.astype(np.int64))
    order = torch.randperm(len(targets), generator=torch.Generator().manual_seed(_SPLIT_SEED))
    everything = TensorData(inputs, targets, _to_unit_range)
    return DataBundle(
        name="digits",
        train=everything.subset(order[test_size:]),
        test=everything.subset(order[:test_size]),
        input_shape=(1, 8, 8),
        num_classes=10,
        default_model="digits_cnn",
    )
