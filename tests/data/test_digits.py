import pytest
import torch

from polytrain.data.digits import DIGITS_SIZE, TEST_SIZE, digits, load_arrays
from polytrain.errors import DataError


def test_packaged_digits_are_the_uci_set():
    images, labels = load_arrays()
    assert images.shape == (DIGITS_SIZE, 8, 8) and images.dtype.name == "uint8"
    assert images.max() == 16 and images.min() == 0
    assert sorted(set(labels.tolist())) == list(range(10))
    # every class has roughly a tenth of the 1,797 images (174..183 in the UCI set)
    assert min(torch.bincount(torch.from_numpy(labels.astype("int64"))).tolist()) >= 170


def test_split_is_fixed_disjoint_and_complete():
    a, b = digits(), digits()
    assert len(a.train) == DIGITS_SIZE - TEST_SIZE and len(a.test) == TEST_SIZE
    assert torch.equal(a.train.inputs, b.train.inputs) and torch.equal(a.test.targets, b.test.targets)
    train = {bytes(x.numpy()) + bytes([y]) for x, y in zip(a.train.inputs, a.train.targets.tolist())}
    test = {bytes(x.numpy()) + bytes([y]) for x, y in zip(a.test.inputs, a.test.targets.tolist())}
    # the UCI set holds a few duplicate images; the split must still not leak more than those
    assert len(train & test) <= 5


def test_batches_are_unit_range_images():
    bundle = digits()
    x, y = bundle.train.get_batch(torch.arange(32))
    assert x.shape == (32, 1, 8, 8) and x.dtype == torch.float32
    assert 0.0 <= x.min() and x.max() <= 1.0
    assert y.dtype == torch.int64
    assert bundle.default_model == "digits_cnn" and bundle.input_shape == (1, 8, 8)


@pytest.mark.parametrize("test_size", [0, DIGITS_SIZE])
def test_a_split_without_training_or_test_data_is_refused(test_size):
    message = rf"^digits: test_size must be between 1 and {DIGITS_SIZE - 1}, got {test_size}$"
    with pytest.raises(DataError, match=message):
        digits(test_size=test_size)
