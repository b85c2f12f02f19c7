"""place() and device(): sub-modules on chosen devices, activations moved, training unchanged.

Cross-device runs use PyTorch's lazy device (see conftest) as the second device where no GPU exists;
the multigpu test does the real split on two GPUs.
"""

from __future__ import annotations

import copy
import logging
from collections import namedtuple

import numpy as np
import pytest
import torch
from torch import nn

from polytrain.devices.discovery import available_device_names
from polytrain.devices.placement import (
    device,
    install_input_hooks,
    model_devices,
    model_input_device,
    model_output_device,
    place,
    to_device,
)
from polytrain.errors import DeviceError
from tests.devices.helpers import Net, loss_and_grads, make_net

META = torch.device("meta")
NO_TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="cuda:0 and cuda:1 exist here")


def _assert_same_training(reference: nn.Module, placed: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """Same loss and gradients, then one SGD step built after placement gives the same parameters."""
    ref_loss, ref_grads = loss_and_grads(reference, x, y)
    loss, grads = loss_and_grads(placed, x, y)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6)
    for model in (reference, placed):
        torch.optim.SGD(model.parameters(), lr=0.5).step()
    for (name, p), q in zip(placed.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_split_on_cpu_matches_the_unsplit_model(batch):
    reference = make_net()
    placed = place(copy.deepcopy(reference), {"features": "cpu", "classifier": "cpu:0"})
    _assert_same_training(reference, placed, *batch)


def test_split_across_two_devices_matches_the_unsplit_model(batch, lazy):
    reference = make_net()
    placed = place(copy.deepcopy(reference), {"classifier": lazy})
    assert [p.device for p in placed.features.parameters()] == [torch.device("cpu")] * 2
    assert {p.device for p in placed.classifier.parameters()} == {lazy}
    assert placed(batch[0]).device == lazy  # the activation crossed to the classifier's device
    _assert_same_training(reference, placed, *batch)


@pytest.mark.multigpu
def test_split_across_two_gpus_matches_the_unsplit_model(batch):
    reference = make_net().cuda(0)
    placed = place(copy.deepcopy(reference), {"features": "cuda:0", "classifier": "cuda:1"})
    assert placed(batch[0].cuda(0)).device == torch.device("cuda", 1)
    x, y = batch[0].cuda(0), batch[1].cuda(0)
    ref_loss, ref_grads = loss_and_grads(reference, x, y)
    loss, grads = loss_and_grads(placed, x, y)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-5)


def test_deeper_entries_override_and_the_rest_stays():
    model = place(make_net(), {"*": META, "classifier": "cpu"})
    assert {p.device for p in model.features.parameters()} == {META}
    assert {p.device for p in model.classifier.parameters()} == {torch.device("cpu")}
    model = place(make_net(), {"features.0": META})
    assert model.features[0].weight.device == META and model.classifier[0].weight.device.type == "cpu"


def test_placed_model_helpers():
    model = place(make_net(), {"classifier": META})
    assert model_devices(model) == [torch.device("cpu"), META]
    assert model_input_device(model) == torch.device("cpu")
    assert model_output_device(model) == META
    assert model_output_device(nn.ReLU()) == torch.device("cpu")


@NO_TWO_GPUS
def test_soft_placement_trains_on_the_fallback_with_the_decisions_logged(batch, captured):
    logger, handler = captured
    model = place(make_net(), {"features": "cuda:0", "classifier": "cuda:1"}, soft=True, log=logger)
    warnings = handler.messages(logging.WARNING)
    missing = [d for d in ("cuda:0", "cuda:1") if d not in available_device_names()]
    assert len(warnings) == len(missing)  # one warning per decision
    for name, warning in zip(missing, warnings):
        assert f"soft placement: device '{name}' is not available" in warning
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = batch
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        out = model(x.to(model_input_device(model)))
        loss = nn.functional.cross_entropy(out, y.to(out.device))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    if not torch.cuda.is_available():
        assert model_devices(model) == [torch.device("cpu")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_two_spellings_of_one_device_are_one_decision(captured):
    logger, handler = captured
    place(make_net(), {"features": "/gpu:1", "classifier": "cuda:1"}, soft=True, log=logger)
    assert len(handler.messages(logging.WARNING)) == 1


@NO_TWO_GPUS
def test_without_soft_placement_the_error_lists_the_available_devices():
    model = make_net()
    with pytest.raises(DeviceError) as info:
        place(model, {"features": "cuda:0", "classifier": "cuda:1"})
    message = str(info.value)
    assert "is not available" in message
    assert "available devices: " + ", ".join(available_device_names()) in message
    assert {p.device.type for p in model.parameters()} == {"cpu"}  # nothing moved before the error


def test_an_unknown_module_name_is_an_error():
    with pytest.raises(DeviceError, match="'head' matches no module of the model; module names: features"):
        place(make_net(), {"head": "cpu"})


def test_tied_parameters_on_two_devices_are_refused():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model[1].weight = model[0].weight
    with pytest.raises(DeviceError, match="'0.weight' and '1.weight' are the same Parameter .* place both on one"):
        place(model, {"0": "cpu", "1": META})
    place(model, {"0": META, "1": META})  # together is fine
    assert model[1].weight is model[0].weight and model[0].weight.device == META


def test_a_shared_module_on_two_devices_is_refused():
    shared = nn.Linear(2, 2)
    model = nn.ModuleDict({"a": nn.Sequential(shared), "b": nn.Sequential(shared)})
    with pytest.raises(DeviceError, match="'a.0' and 'b.0' are the same Linear"):
        place(model, {"a": "cpu", "b": META})


def test_hooks_are_installed_once():
    model = make_net()
    place(model, {"classifier": "cpu"})
    place(model, {"classifier": "cpu"})
    assert install_input_hooks(model) == 0
    assert len(model.classifier[0]._forward_pre_hooks) == 1
    assert len(model.features[1]._forward_pre_hooks) == 0  # ReLU owns no tensors: nothing to follow


def test_hooks_follow_a_later_move(batch, lazy):
    model = place(make_net(), {"classifier": lazy})
    model.to("cpu")
    assert model(batch[0]).device == torch.device("cpu")


def test_inputs_move_through_kwargs_and_containers(lazy):
    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(2.0))

        def forward(self, pair: dict, *, offset: torch.Tensor) -> torch.Tensor:
            return (pair["a"] + pair["b"][0]) * self.scale + offset

    module = place(TwoInputs(), {"*": lazy})
    out = module({"a": torch.ones(2), "b": [torch.ones(2)]}, offset=torch.ones(2))
    assert out.device == lazy and out.cpu().tolist() == [5.0, 5.0]


def test_to_device_keeps_container_types():
    Pair = namedtuple("Pair", "x y")
    moved = to_device({"p": Pair(torch.ones(1), 3), "l": [torch.zeros(1)]}, META)
    assert isinstance(moved["p"], Pair) and moved["p"].x.device == META and moved["p"].y == 3
    assert moved["l"][0].device == META


def test_packed_sequences_keep_their_batch_sizes_on_the_cpu():
    packed = nn.utils.rnn.pack_padded_sequence(torch.ones(2, 3, 1), [3, 2], batch_first=True)
    moved = to_device((packed,), META)[0]
    assert moved.data.device == META and moved.batch_sizes.device.type == "cpu"


def test_device_scope_builds_modules_on_the_device():
    class FromNumpy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.from_numpy(np.ones((2, 2), dtype=np.float32)))
            self.register_buffer("counts", torch.from_numpy(np.zeros(2, dtype=np.float32)))

    with device(META) as target:
        inside = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), FromNumpy())
    outside = nn.Linear(2, 2)
    assert target == META
    assert {t.device for t in [*inside.parameters(), *inside.buffers()]} == {META}
    assert outside.weight.device == torch.device("cpu")  # the scope ended


def test_device_scopes_nest():
    with device("cpu"):
        with device(META):
            inner = nn.Linear(1, 1)
        after = nn.Linear(1, 1)
    assert inner.weight.device == META and after.weight.device.type == "cpu"


def test_modules_from_two_scopes_chain_in_one_model(batch, lazy):
    reference = make_net()
    with device("cpu"):
        features = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    with device(lazy):
        classifier = nn.Sequential(nn.Linear(8, 3))
    model = Net()
    model.features, model.classifier = features, classifier
    model.load_state_dict(reference.state_dict())
    assert model.classifier[0].weight.device == lazy
    _assert_same_training(reference, model, *batch)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_device_scope_soft_and_strict(captured):
    logger, handler = captured
    with device("/gpu:1", soft=True, log=logger) as target:
        layer = nn.Linear(2, 2)
    assert target == torch.device("cpu") and layer.weight.device == target
    assert len(handler.messages(logging.WARNING)) == 1
    with pytest.raises(DeviceError, match="available devices: cpu"):
        with device("/gpu:1"):
            pass


@pytest.mark.gpu
def test_device_scope_on_a_gpu(batch):
    with device("cuda:0"):
        layer = nn.Linear(4, 3)
    assert layer.weight.device == torch.device("cuda", 0)
    assert layer(batch[0]).device == torch.device("cuda", 0)  # a CPU input was moved by the hook
