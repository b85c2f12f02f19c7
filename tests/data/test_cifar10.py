import pickle

import numpy as np
import pytest
import torch

from polytrain.data.base import example_uniform
from polytrain.data.cifar10 import TRAIN_FILES, cifar10, standardize
from polytrain.data.registry import build_data
from polytrain.errors import DataError

PER_FILE = 6


def write_mini_cifar(root, per_file=PER_FILE, seed=0):
    """A CIFAR-10 python-pickle directory in the real format, with ``per_file`` images per batch file."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    images = {}
    for name in (*TRAIN_FILES, "test_batch"):
        data = rng.integers(0, 256, size=(per_file, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, size=per_file).tolist()
        with open(root / name, "wb") as f:
            pickle.dump({b"batch_label": name.encode(), b"labels": labels, b"data": data,
                         b"filenames": [b"x.png"] * per_file}, f)
        images[name] = (data, labels)
    return images


def test_reads_all_batches_in_order(tmp_path):
    written = write_mini_cifar(tmp_path)
    bundle = cifar10(tmp_path, crop=32, distort=False)
    assert len(bundle.train) == 5 * PER_FILE and len(bundle.test) == PER_FILE
    first = written["data_batch_1"][0][0].reshape(3, 32, 32)
    assert torch.equal(bundle.train.inputs[0], torch.from_numpy(first))
    assert bundle.train.targets[PER_FILE:2 * PER_FILE].tolist() == written["data_batch_2"][1]
    assert bundle.test.targets.tolist() == written["test_batch"][1]
    assert bundle.input_shape == (3, 32, 32) and bundle.default_model == "cifar_cnn"


def test_test_split_is_central_crop_standardized(tmp_path):
    written = write_mini_cifar(tmp_path)
    bundle = cifar10(tmp_path)
    x, _ = bundle.test.get_batch(torch.arange(PER_FILE))
    assert x.shape == (PER_FILE, 3, 24, 24)
    raw = torch.from_numpy(written["test_batch"][0][2].reshape(3, 32, 32)).float()[:, 4:28, 4:28]
    assert torch.allclose(x[2], standardize(raw[None])[0], atol=1e-5)
    flat = x.flatten(1)
    assert torch.allclose(flat.mean(1), torch.zeros(PER_FILE), atol=1e-4)
    assert torch.allclose(flat.std(1, unbiased=False), torch.ones(PER_FILE), atol=1e-3)


def test_distortions_are_random_per_example_and_epoch_but_reproducible(tmp_path):
    write_mini_cifar(tmp_path)
    bundle = cifar10(tmp_path, run_seed=3)
    idx = torch.arange(5 * PER_FILE)
    a, _ = bundle.train.get_batch(idx, epoch=0)
    b, _ = bundle.train.get_batch(idx, epoch=0)
    c, _ = bundle.train.get_batch(idx, epoch=1)
    assert a.shape == (5 * PER_FILE, 3, 24, 24)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # one example alone gets exactly what it got inside the batch: sharding cannot change augmentation
    alone, _ = bundle.train.get_batch(idx[7:8], epoch=0)
    assert torch.equal(alone[0], a[7])


def test_distorted_crop_is_a_window_of_the_image(tmp_path):
    """Brightness/contrast are affine per channel and standardisation removes them up to the contrast sign,
    so the distorted image is perfectly correlated with one 24x24 window (possibly mirrored) of the original."""
    write_mini_cifar(tmp_path)
    bundle = cifar10(tmp_path, run_seed=5)
    idx = torch.tensor([4])
    x, _ = bundle.train.get_batch(idx)
    original = bundle.train.inputs[4].float()
    rand = example_uniform(5, 0, idx, stream=11, count=5)[0]
    top, left = int(rand[0] * 9), int(rand[1] * 9)
    window = original[:, top:top + 24, left:left + 24]
    if rand[2] < 0.5:
        window = window.flip(-1)
    for ch in range(3):
        corr = torch.corrcoef(torch.stack([x[0, ch].flatten(), window[ch].flatten()]))[0, 1]
        assert corr > 0.999


def test_spec_with_directory(tmp_path):
    write_mini_cifar(tmp_path / "cifar-10-batches-py")
    bundle = build_data(f"cifar10:{tmp_path / 'cifar-10-batches-py'},crop=28", seed=1)
    assert bundle.input_shape == (3, 28, 28) and bundle.name == "cifar10"


def test_missing_directory_and_files_are_named(tmp_path):
    with pytest.raises(DataError, match="does not exist; download https://www.cs.toronto.edu"):
        cifar10(tmp_path / "nowhere")
    write_mini_cifar(tmp_path)
    (tmp_path / "data_batch_3").unlink()
    with pytest.raises(DataError, match="lacks data_batch_3"):
        cifar10(tmp_path)


def test_a_pickle_with_foreign_objects_is_refused(tmp_path):
    write_mini_cifar(tmp_path)
    with open(tmp_path / "test_batch", "wb") as f:
        pickle.dump({b"data": np.zeros((1, 3072), np.uint8), b"labels": [0], b"evil": pytest.raises}, f)
    with pytest.raises(DataError, match="unexpected object"):
        cifar10(tmp_path)


def test_wrong_shape_is_explained(tmp_path):
    write_mini_cifar(tmp_path)
    with open(tmp_path / "test_batch", "wb") as f:
        pickle.dump({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, f)
    with pytest.raises(DataError, match="expected N x 3072"):
        cifar10(tmp_path)


def test_a_file_that_is_no_batch_or_has_other_labels_is_named(tmp_path):
    write_mini_cifar(tmp_path)
    (tmp_path / "data_batch_2").write_bytes(b"not a pickle")
    with pytest.raises(DataError, match=f"^cifar10: cannot read {tmp_path / 'data_batch_2'}: .*; is it a CIFAR-10 "
                                        "python batch file\\?$"):
        cifar10(tmp_path)
    write_mini_cifar(tmp_path)
    with open(tmp_path / "test_batch", "wb") as f:  # CIFAR-100's fine labels go up to 99
        pickle.dump({b"data": np.zeros((2, 3072), np.uint8), b"labels": [3, 42]}, f)
    with pytest.raises(DataError, match=f"^cifar10: {tmp_path / 'test_batch'} has labels outside 0..9$"):
        cifar10(tmp_path)


@pytest.mark.parametrize("crop", [0, 33])
def test_a_crop_outside_the_image_is_refused(tmp_path, crop):
    write_mini_cifar(tmp_path)
    with pytest.raises(DataError, match=f"^cifar10: crop must be an integer between 1 and 32, got {crop}$"):
        cifar10(tmp_path, crop=crop)
