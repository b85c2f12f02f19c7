import sys
import types

import pytest
import torch
from torch.utils.data import TensorDataset

from polytrain.data.base import DataBundle
from polytrain.data.registry import available_datasets, build_data, check_data, register_dataset
from polytrain.errors import ConfigError, DataError


@pytest.fixture
def user_module(monkeypatch):
    """A real importable module holding user dataset factories, as `--data mydata:factory` would name."""
    module = types.ModuleType("user_datasets")

    def pairs(size: int = 40, run_seed: int = 0):
        g = torch.Generator().manual_seed(run_seed)
        x = torch.randn(size, 6, generator=g)
        y = torch.randint(0, 3, (size,), generator=g)
        return TensorDataset(x[:30], y[:30]), TensorDataset(x[30:], y[30:])

    def binary():
        x = torch.randn(20, 4)
        return TensorDataset(x, (x[:, 0] > 0).float()), None

    def wrong():
        return [1, 2, 3]

    module.pairs, module.binary, module.wrong = pairs, binary, wrong
    monkeypatch.setitem(sys.modules, "user_datasets", module)
    return module


def test_builtin_names():
    assert {"digits", "synthetic", "cifar10"} <= set(available_datasets())
    assert build_data("digits").name == "digits"
    assert build_data("synthetic:shape=4,size=10,test_size=0").input_shape == (4,)


def test_user_factory_pairs_are_described(user_module):
    bundle = build_data("user_datasets:pairs", {"size": 50}, seed=2)
    assert isinstance(bundle, DataBundle)
    assert bundle.input_shape == (6,) and bundle.task == "classification" and bundle.default_model == "mlp"
    assert bundle.num_classes == int(torch.cat([bundle.train.tensors[1]]).max()) + 1
    assert len(bundle.train) == 30 and len(bundle.test) == 20
    # the run's seed reaches a factory that asks for it
    assert not torch.equal(bundle.train.tensors[0], build_data("user_datasets:pairs", seed=3).train.tensors[0])


def test_user_factory_float_targets_make_a_binary_task(user_module):
    bundle = build_data("user_datasets:binary")
    assert bundle.task == "binary" and bundle.num_outputs == 1 and bundle.test is None


def test_num_classes_hint_is_taken_by_polytrain_not_the_factory(user_module):
    assert build_data("user_datasets:pairs", {"num_classes": 7}).num_classes == 7


def test_factory_returning_something_else_is_explained(user_module):
    with pytest.raises(DataError, match="returned list; return a DataBundle or a .train, test. pair"):
        build_data("user_datasets:wrong")


def test_registered_dataset_with_size_check():
    @register_dataset("tiny_test_set", check=lambda n=8: n)
    def tiny(n: int = 8):
        return TensorDataset(torch.randn(n, 2), torch.arange(n) % 2), None

    assert check_data("tiny_test_set:n=5") == 5
    assert len(build_data("tiny_test_set", {"n": 5}).train) == 5


@pytest.mark.parametrize("spec, args, words", [
    ("imagenet", None, "unknown dataset 'imagenet'; choose one of .*cifar10, digits, hf, sentences, synthetic, text, .*tokens"),
    ("digit", None, "did you mean 'digits'"),
    ("synthetic:3x32x32", None, "positional values; use key=value"),
    ("synthetic:size=10", {"size": 20}, "size given both"),
    ("digits:colour=red", None, "unknown argument.*colour.*accepted: test_size"),
    ("no_such_module_xyz:factory", None, "cannot import module 'no_such_module_xyz'"),
])
def test_bad_specs_are_config_errors(spec, args, words):
    with pytest.raises(ConfigError, match=words):
        check_data(spec, args)


def test_check_knows_sizes_without_loading(tmp_path):
    assert check_data("digits") == 1437
    assert check_data("synthetic:size=77") == 77
    with pytest.raises(DataError, match="does not exist"):
        check_data(f"cifar10:{tmp_path / 'missing'}")
    with pytest.raises(DataError, match="give the data folder as --data cifar10:DIR"):
        check_data("cifar10")


def test_numeric_folder_names_stay_paths(tmp_path, monkeypatch):
    from tests.data.test_cifar10 import write_mini_cifar
    write_mini_cifar(tmp_path / "2024")
    monkeypatch.chdir(tmp_path)
    assert len(build_data("cifar10:2024").train) == 30


class _Singles(torch.utils.data.Dataset):
    """Items that are bare inputs, not (input, target) pairs."""

    def __len__(self):
        return 3

    def __getitem__(self, index):
        return torch.zeros(2)


@pytest.mark.parametrize("train, message", [
    (TensorDataset(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long)),
     "--data mine: the train set is empty; give it examples"),
    (_Singles(), "--data mine: train example 0 is a Tensor, not an (input, target) pair; make the dataset's "
                 "__getitem__ return (input, target)"),
    (TensorDataset(torch.zeros(3, 2), torch.tensor([0, -1, 2])),
     "--data mine: train example 1 has target -1; class targets must be integers >= 0; for a binary task return "
     "float 0./1. targets, or pass --data-arg num_classes=N"),
])
def test_datasets_a_factory_returns_are_checked(user_module, train, message):
    user_module.bad = lambda: (train, None)
    with pytest.raises(DataError) as caught:
        build_data("user_datasets:bad")
    assert str(caught.value) == message.replace("mine", "user_datasets:bad")
