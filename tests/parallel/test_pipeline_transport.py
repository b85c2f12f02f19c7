"""Stages on a GPU need a backend that sends CUDA tensors between them: gloo does not (it aborts the worker
inside the schedule), so that pairing is one line before launch."""

import pytest

import polytrain
from polytrain.errors import ConfigError
from polytrain.parallel.pp.transport import check_transport


@pytest.mark.parametrize("strategy", ["pipeline", "hybrid"])
@pytest.mark.parametrize("device", ["cuda:0", "cuda", "gpu:0"])
def test_stages_on_a_gpu_over_gloo_are_refused_with_the_fix(strategy, device):
    config = polytrain.make_config(strategy=strategy, device=device, backend="gloo")
    with pytest.raises(ConfigError, match=f"--strategy {strategy} with --backend gloo on a GPU: gloo cannot send "
                                          "CUDA tensors between stages; use --backend nccl"):
        check_transport(config, strategy)


@pytest.mark.parametrize("device, backend", [("cpu", "gloo"), ("cpu", "auto"), ("cuda:0", "nccl"),
                                             ("cuda:0", "auto")])
def test_stages_on_the_cpu_or_over_nccl_pass(device, backend):
    check_transport(polytrain.make_config(strategy="pipeline", device=device, backend=backend), "pipeline")


def test_the_pipeline_check_refuses_it_before_launch():
    config = polytrain.make_config(strategy="pipeline", device="cuda:0", backend="gloo", model="mlp:hidden=8x8",
                                   data="digits")
    strategy = polytrain.get_strategy("pipeline")
    with pytest.raises(ConfigError, match="gloo cannot send CUDA tensors"):
        strategy.check(strategy.layout(2, config.pipeline), config, None)
