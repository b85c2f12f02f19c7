"""The built-in models: shapes, sizes and the part names that placement uses."""

import pytest
import torch

from polytrain.errors import ConfigError
from polytrain.models.registry import build_model


@pytest.mark.parametrize("name, shape", [("cifar_cnn", (3, 24, 24)), ("cifar_cnn", (3, 32, 32)),
                                         ("digits_cnn", (1, 8, 8))])
def test_cnns_have_named_features_and_classifier_parts(name, shape):
    model = build_model(name, input_shape=shape, num_classes=10)
    assert [n for n, _ in model.named_children()] == ["features", "classifier"]
    assert model(torch.zeros(2, *shape)).shape == (2, 10)
    assert next(iter(model.state_dict())) == "features.0.weight"


def test_cifar_cnn_has_the_tutorial_size_on_24x24_crops():
    model = build_model("cifar_cnn", input_shape=(3, 24, 24), num_classes=10)
    # conv 5x5x3x64 + conv 5x5x64x64 + fc 2304x384 + fc 384x192 + fc 192x10, with biases
    expected = (75 * 64 + 64) + (1600 * 64 + 64) + (2304 * 384 + 384) + (384 * 192 + 192) + (192 * 10 + 10)
    assert sum(p.numel() for p in model.parameters()) == expected


def _not_a_module(input_shape, num_classes):
    return [input_shape, num_classes]


@pytest.mark.parametrize("spec, args, message", [
    ("mlp:64x32", None, "--model: 'mlp:64x32' has positional values; use key=value (e.g. mlp:hidden=64x32)"),
    ("mlp:hidden=8", {"hidden": (4,)}, "--model: hidden given both in 'mlp:hidden=8' and as --model-arg"),
    ("mlp:hidden=0", None, "--model mlp:hidden=0: hidden widths must be >= 1, got [0]"),  # the factory's ValueError
    ("tests.models.test_builtin:_not_a_module", None,
     "--model tests.models.test_builtin:_not_a_module: the factory returned list, not a torch.nn.Module"),
])
def test_bad_model_specs_are_one_line(spec, args, message):
    with pytest.raises(ConfigError) as caught:
        build_model(spec, args, input_shape=(4,), num_classes=2)
    assert str(caught.value) == message
