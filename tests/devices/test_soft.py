"""Soft placement of operators: a kernel missing on a device reruns on the CPU, or fails naming things.

The operators below are registered for this test: a CPU kernel, and on the lazy device (a second device
with real data on a CPU-only machine, see conftest) a kernel that raises NotImplementedError as a
missing kernel does. On meta tensors they have no kernel at all, which is PyTorch's own error.
"""

from __future__ import annotations

import logging

import pytest
import torch

from polytrain.devices.discovery import available_device_names
from polytrain.devices.runtime import DeviceRuntime
from polytrain.devices.soft import (
    SoftPlacementMode,
    _outputs_home,
    _write_back,
    device_error_for,
    operator_errors,
)
from polytrain.errors import DeviceError

_LIB = torch.library.Library("polytrain_test", "DEF")
_LIB.define("double_it(Tensor x) -> Tensor")
_LIB.define("split_sum(Tensor x) -> (Tensor, Tensor)")
_LIB.define("cpu_broken(Tensor x) -> Tensor")
_LIB.define("broken_everywhere(Tensor x) -> Tensor")


def _no_lazy_kernel(*args, **kwargs):
    raise NotImplementedError("no kernel for the lazy device in this test")


def _broken(x):
    raise NotImplementedError("not even on the CPU")


_LIB.impl("double_it", lambda x: x * 2, "CPU")
_LIB.impl("split_sum", lambda x: (x.sum(), x * 0), "CPU")
_LIB.impl("cpu_broken", _broken, "CPU")
_LIB.impl("double_it", _no_lazy_kernel, "Lazy")
_LIB.impl("split_sum", _no_lazy_kernel, "Lazy")
_LIB.impl("broken_everywhere", _broken, "CPU")
_LIB.impl("broken_everywhere", _no_lazy_kernel, "Lazy")

double_it = torch.ops.polytrain_test.double_it
split_sum = torch.ops.polytrain_test.split_sum
cpu_broken = torch.ops.polytrain_test.cpu_broken
broken_everywhere = torch.ops.polytrain_test.broken_everywhere


def test_without_soft_placement_the_op_fails_on_its_device(lazy):
    with pytest.raises(NotImplementedError, match="no kernel for the lazy device"):
        double_it(torch.ones(2, device=lazy))


def test_soft_mode_reruns_on_the_cpu_and_moves_the_output_back(lazy, captured):
    logger, handler = captured
    x = torch.arange(3.0, device=lazy)
    mode = SoftPlacementMode(log=logger)
    with mode:
        y = double_it(x)
        z = double_it(y)
    assert y.device == lazy and z.device == lazy
    assert z.cpu().tolist() == [0.0, 4.0, 8.0]
    warnings = handler.messages(logging.WARNING)
    assert len(warnings) == 1  # logged once per operator
    assert "operator polytrain_test::double_it is not implemented for lazy:0" in warnings[0]
    assert "running it on cpu" in warnings[0]
    assert mode.fallen_back == {"polytrain_test::double_it": 2}
    with mode:  # entered again (e.g. the next step): still logged once
        double_it(x)
    assert len(handler.messages(logging.WARNING)) == 1 and mode.fallen_back["polytrain_test::double_it"] == 3


def test_in_place_and_out_results_are_written_back():
    # the lazy backend functionalizes mutating custom operators before any kernel runs, so the
    # write-back step is checked here on its own, with aten's in-place and out= schemas
    a, b, out = torch.zeros(2), torch.ones(2), torch.zeros(2)
    a_copy, b_copy, out_copy = a.clone(), b.clone(), out.clone()
    torch.ops.aten.add_.Tensor(a_copy, b_copy)
    torch.ops.aten.add.out(a_copy, b_copy, out=out_copy)
    originals = _write_back(torch.ops.aten.add_.Tensor, ((a, b), {}), ((a_copy, b_copy), {}))
    assert a.tolist() == [1.0, 1.0] and b.tolist() == [1.0, 1.0]
    assert _outputs_home(a_copy, originals, torch.device("cpu")) is a  # the output is the original again
    originals = _write_back(torch.ops.aten.add.out, ((a, b), {"out": out}), ((a_copy, b_copy), {"out": out_copy}))
    assert out.tolist() == [2.0, 2.0] and list(originals.values()) == [out]


def test_soft_mode_moves_every_output_back(lazy, captured):
    logger, _ = captured
    with SoftPlacementMode(log=logger):
        total, zeros = split_sum(torch.ones(3, device=lazy))
    assert (total.device, zeros.device) == (lazy, lazy)
    assert total.cpu().item() == 3.0


def test_soft_mode_leaves_failures_on_the_cpu_alone(captured):
    logger, handler = captured
    with pytest.raises(NotImplementedError, match="not even on the CPU"):
        with SoftPlacementMode(log=logger):
            cpu_broken(torch.ones(2))
    assert handler.messages() == []  # nothing softer to fall back to


def test_an_operator_the_fallback_lacks_too_is_one_error_naming_both(lazy, captured):
    logger, _ = captured
    with pytest.raises(DeviceError, match=r"^operator polytrain_test::broken_everywhere is implemented neither for "
                                          r"lazy:0 nor for cpu: not even on the CPU$"):
        with SoftPlacementMode(log=logger):
            broken_everywhere(torch.ones(2, device=lazy))


def test_missing_kernel_error_names_the_operator_device_and_available_devices():
    with pytest.raises(DeviceError) as info:
        with operator_errors():
            double_it(torch.ones(2, device="meta"))
    message = str(info.value)
    assert "operator polytrain_test::double_it is not implemented for device meta" in message
    assert "available devices: " + ", ".join(available_device_names()) in message
    assert "--soft-placement" in message
    assert isinstance(info.value.__cause__, NotImplementedError)


@pytest.mark.parametrize("text,op,device", [
    ("Could not run 'aten::_foo' with arguments from the 'CUDA' backend. This could be because",
     "aten::_foo", "cuda"),
    ("The operator 'aten::_linalg_eigh.eigenvalues' is not currently implemented for the MPS device. If you",
     "aten::_linalg_eigh.eigenvalues", "mps"),
    ("Could not run 'aten::bar' with arguments from the 'SparseCUDA' backend.", "aten::bar", "cuda"),
])
def test_pytorch_missing_kernel_messages_are_recognised(text, op, device):
    error = device_error_for(NotImplementedError(text))
    assert error is not None and f"operator {op} is not implemented for device {device};" in str(error)


def test_a_kernel_missing_on_the_cpu_is_not_sent_to_soft_placement():
    error = device_error_for(NotImplementedError("Could not run 'aten::baz' with arguments from the 'CPU' backend."))
    assert error is not None and "soft placement cannot help" in str(error)


def test_other_not_implemented_errors_pass_through():
    assert device_error_for(NotImplementedError("subclasses must implement forward")) is None
    with pytest.raises(NotImplementedError, match="subclasses must implement"):
        with operator_errors():
            raise NotImplementedError("subclasses must implement forward")


def test_runtime_with_soft_placement_and_the_log(lazy, captured, tmp_path):
    logger, handler = captured
    runtime = DeviceRuntime(soft=True, log_placement=True, log_dir=tmp_path, logger=logger)
    x = torch.ones(2, device=lazy)
    with runtime.step_context(0):
        y = double_it(x)
    assert y.device == lazy and y.cpu().tolist() == [2.0, 2.0]
    # the log sits outside the fallback: it shows the failed call, the copies and the rerun
    records = runtime.placement_logger.last.records
    assert [(r.op.split(".")[1], r.where(), r.note) for r in records] == [
        ("double_it", "lazy:0", "not implemented"), ("to", "lazy:0 -> cpu", ""),
        ("double_it", "cpu", ""), ("to", "cpu -> lazy:0", "")]
    assert "not implemented" in (tmp_path / "placement-ops-rank0-step0.txt").read_text()
    assert len(handler.messages(logging.WARNING)) == 1


def test_runtime_without_soft_placement_names_the_device():
    runtime = DeviceRuntime()
    with pytest.raises(DeviceError, match="operator polytrain_test::double_it is not implemented for device meta"):
        with runtime.step_context(0):
            double_it(torch.ones(2, device="meta"))


def test_runtime_context_for_evaluation(lazy, tmp_path):
    runtime = DeviceRuntime(soft=True, log_placement=True, log_dir=tmp_path)
    with runtime.context():
        assert double_it(torch.ones(2, device=lazy)).cpu().tolist() == [2.0, 2.0]
    assert runtime.soft_mode.fallen_back == {"polytrain_test::double_it": 1}
    assert list(tmp_path.iterdir()) == []  # evaluation is not part of the per-operator log
    with pytest.raises(DeviceError, match="operator polytrain_test::double_it is not implemented for device meta"):
        with DeviceRuntime().context():
            double_it(torch.ones(2, device="meta"))
