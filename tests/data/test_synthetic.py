import pytest
import torch

from polytrain.data import synthetic as synthetic_module
from polytrain.data.synthetic import SyntheticData, synthetic
from polytrain.errors import DataError


def test_cifar_shaped_by_default():
    bundle = synthetic(size=256, test_size=64)
    assert bundle.input_shape == (3, 32, 32) and bundle.default_model == "cifar_cnn"
    x, y = bundle.train.get_batch(torch.arange(256))
    assert abs(x.mean().item()) < 0.02 and abs(x.std().item() - 1) < 0.02
    assert len(set(y.tolist())) == 10 and len(bundle.test) == 64


def test_labels_are_learnable():
    """A linear probe fitted on the training split predicts the held-out split far above chance (0.1)."""
    bundle = synthetic(shape=(3, 4, 4), size=2000, test_size=500)
    x, y = bundle.train.get_batch(torch.arange(2000))
    xt, yt = bundle.test.get_batch(torch.arange(500))
    w = torch.linalg.lstsq(x.flatten(1), torch.nn.functional.one_hot(y, 10).float()).solution
    assert ((xt.flatten(1) @ w).argmax(1) == yt).float().mean() > 0.6


def test_same_seed_same_data_other_seed_other_data():
    a, b, c = synthetic(shape=(20,), size=50), synthetic(shape=(20,), size=50), synthetic(shape=(20,), size=50, seed=1)
    assert torch.equal(a.train.inputs, b.train.inputs) and torch.equal(a.train.targets, b.train.targets)
    assert not torch.equal(a.train.inputs, c.train.inputs)


def test_large_sets_stream_the_same_values(monkeypatch):
    small = synthetic(shape=(3, 8, 8), size=100, test_size=10)
    monkeypatch.setattr(synthetic_module, "MATERIALIZE_LIMIT", 10)
    streamed = synthetic(shape=(3, 8, 8), size=100, test_size=10)
    assert isinstance(streamed.train, SyntheticData)
    idx = torch.tensor([3, 99, 0])
    for a, b in zip(small.train.get_batch(idx), streamed.train.get_batch(idx)):
        assert torch.equal(a, b)
    assert torch.equal(small.test.get_batch(torch.arange(10))[1], streamed.test.get_batch(torch.arange(10))[1])


def test_binary_task_is_the_tower_example():
    bundle = synthetic(shape=5, task="binary", size=200)
    assert bundle.task == "binary" and bundle.num_outputs == 1 and bundle.default_model == "mlp"
    y = bundle.train.targets
    assert y.dtype == torch.float32 and set(y.tolist()) == {0.0, 1.0}


@pytest.mark.parametrize("kwargs, words", [
    (dict(shape="big"), "shape"), (dict(classes=1), "classes"), (dict(size=0), "size"),
    (dict(task="regression"), "task must be one of classification, binary"),
])
def test_bad_arguments_are_named(kwargs, words):
    with pytest.raises(DataError, match=words):
        synthetic(**kwargs)
