"""The built-in models: shapes, sizes and the part names that placement uses."""

import pytest
import torch

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
