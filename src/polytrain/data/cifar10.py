"""``cifar10:DIR``: the CIFAR-10 python-pickle batches, with the classic TensorFlow tutorial's distortions.

DIR is the extracted ``cifar-10-batches-py`` folder (``data_batch_1`` .. ``data_batch_5``, ``test_batch``)
from https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz. Images stay uint8 in memory (150 MB for
the whole set); each batch is turned into floats when it is drawn.

Training images get, as in TensorFlow's ``cifar10_input.distorted_inputs``: a random ``crop`` x ``crop``
window, a random horizontal flip, brightness +-63 (of 255), contrast x[0.2, 1.8], then per-image
standardisation. Test images get the central crop and standardisation. The random choices depend only on
``(seed, epoch, example)``, so sharded training sees exactly the images single-device training sees.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch

from polytrain.data.base import DataBundle, TensorData, example_uniform
from polytrain.errors import DataError

TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
IMAGE_SHAPE = (3, 32, 32)
DOWNLOAD = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
MAX_BRIGHTNESS = 63.0
CONTRAST_RANGE = (0.2, 1.8)


class _ArrayUnpickler(pickle.Unpickler):
    """Loads only what CIFAR batches hold (dicts, lists, bytes, numpy arrays), never arbitrary objects."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"), ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"unexpected object {module}.{name} in a CIFAR-10 batch file")


def _read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with path.open("rb") as f:
            batch = _ArrayUnpickler(f, encoding="bytes").load()
        data = np.asarray(batch[b"data"], dtype=np.uint8)
        labels = np.asarray(batch[b"labels"], dtype=np.int64)
    except (OSError, EOFError, pickle.UnpicklingError, KeyError, TypeError, ValueError) as exc:
        raise DataError(f"cifar10: cannot read {path}: {exc}; is it a CIFAR-10 python batch file?") from None
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(data) != len(labels):
        raise DataError(f"cifar10: {path} holds data of shape {data.shape} and {len(labels)} labels; "
                        "expected N x 3072 pixels and N labels")
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        raise DataError(f"cifar10: {path} has labels outside 0..9")
    return data.reshape(-1, *IMAGE_SHAPE), labels


def check_cifar10(directory: str | Path | None = None, **_: object) -> None:
    """Raise a DataError naming what is missing unless ``directory`` holds the CIFAR-10 batches."""
    if directory is None or str(directory) == "":
        raise DataError("cifar10: give the data folder as --data cifar10:DIR (the extracted cifar-10-batches-py "
                        f"from {DOWNLOAD})")
    root = Path(str(directory)).expanduser()
    if not root.is_dir():
        raise DataError(f"cifar10: directory '{root}' does not exist; download {DOWNLOAD}, extract it and "
                        "pass the cifar-10-batches-py folder")
    missing = [name for name in (*TRAIN_FILES, TEST_FILE) if not (root / name).is_file()]
    if missing:
        raise DataError(f"cifar10: '{root}' lacks {', '.join(missing)}; expected data_batch_1..5 and test_batch "
                        f"(the extracted cifar-10-batches-py from {DOWNLOAD})")


def _crop_offsets(n: int, rand: torch.Tensor, crop: int) -> tuple[torch.Tensor, torch.Tensor]:
    room = IMAGE_SHAPE[1] - crop + 1
    return (rand[:, 0] * room).long(), (rand[:, 1] * room).long()


def _crop(images: torch.Tensor, top: torch.Tensor, left: torch.Tensor, crop: int) -> torch.Tensor:
    rows = (top[:, None] + torch.arange(crop))[:, None, :, None]  # N,1,crop,1
    cols = (left[:, None] + torch.arange(crop))[:, None, None, :]  # N,1,1,crop
    batch = torch.arange(len(images))[:, None, None, None]
    chans = torch.arange(images.shape[1])[None, :, None, None]
    return images[batch, chans, rows, cols]


def standardize(images: torch.Tensor) -> torch.Tensor:
    """TensorFlow's per_image_standardization: zero mean, unit variance, std floored at 1/sqrt(pixels)."""
    flat = images.flatten(1)
    mean = flat.mean(dim=1, keepdim=True)
    floor = 1.0 / flat.shape[1] ** 0.5
    std = flat.std(dim=1, unbiased=False, keepdim=True).clamp_min(floor)
    return ((flat - mean) / std).view_as(images)


class TrainTransform:
    """Random crop, flip, brightness and contrast per example, then standardisation."""

    def __init__(self, seed: int, crop: int, distort: bool):
        self.seed, self.crop, self.distort = seed, crop, distort

    def __call__(self, inputs: torch.Tensor, indices: torch.Tensor, epoch: int) -> torch.Tensor:
        if not self.distort:
            return standardize(center_crop(inputs, self.crop).to(torch.float32))
        rand = example_uniform(self.seed, epoch, indices, stream=11, count=5)
        top, left = _crop_offsets(len(inputs), rand[:, 0:2], self.crop)
        x = _crop(inputs, top, left, self.crop).to(torch.float32)
        flip = rand[:, 2] < 0.5
        x = torch.where(flip[:, None, None, None], x.flip(-1), x)
        x = x + ((rand[:, 3] * 2 - 1) * MAX_BRIGHTNESS)[:, None, None, None]
        low, high = CONTRAST_RANGE
        factor = (low + rand[:, 4] * (high - low))[:, None, None, None]
        channel_mean = x.mean(dim=(2, 3), keepdim=True)
        x = (x - channel_mean) * factor + channel_mean
        return standardize(x)


def center_crop(images: torch.Tensor, crop: int) -> torch.Tensor:
    start = (IMAGE_SHAPE[1] - crop) // 2
    return images[..., start:start + crop, start:start + crop]


class TestTransform:
    def __init__(self, crop: int):
        self.crop = crop

    def __call__(self, inputs: torch.Tensor, indices: torch.Tensor, epoch: int) -> torch.Tensor:
        return standardize(center_crop(inputs, self.crop).to(torch.float32))


def cifar10(directory: str | Path | None = None, crop: int = 24, distort: bool = True, run_seed: int = 0) -> DataBundle:
    """CIFAR-10 from ``directory``; ``crop`` 24 (the tutorial's) up to 32 (no crop); ``distort`` the train split.

    ``run_seed`` (the run's ``--seed``) fixes the random distortions."""
    check_cifar10(directory)
    if not isinstance(crop, int) or not 1 <= crop <= 32:
        raise DataError(f"cifar10: crop must be an integer between 1 and 32, got {crop}")
    root = Path(str(directory)).expanduser()
    parts = [_read_batch(root / name) for name in TRAIN_FILES]
    train_x = torch.from_numpy(np.concatenate([p[0] for p in parts]))
    train_y = torch.from_numpy(np.concatenate([p[1] for p in parts]))
    test_x, test_y = (torch.from_numpy(a) for a in _read_batch(root / TEST_FILE))
    return DataBundle(
        name="cifar10",
        train=TensorData(train_x, train_y, TrainTransform(run_seed, crop, bool(distort))),
        test=TensorData(test_x, test_y, TestTransform(crop)),
        input_shape=(3, crop, crop),
        num_classes=10,
        default_model="cifar_cnn",
    )
