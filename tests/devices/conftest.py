"""Fixtures of the device tests: a captured logger, a batch, and the lazy device.

The lazy device (PyTorch's TorchScript lazy-tensor backend, built into CPU wheels) is a second device
that holds real data on a machine without a GPU, so cross-device placement and the CPU fallback of soft
placement run for real here. Tests that need it are skipped where it is missing.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.devices.helpers import ListHandler


@pytest.fixture
def captured(request):
    """``(logger, handler)``: a private logger whose records the test can read."""
    logger = logging.getLogger(f"polytrain.test.{request.node.name}")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    handler = ListHandler()
    logger.addHandler(handler)
    yield logger, handler
    logger.removeHandler(handler)


@pytest.fixture
def batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(6, 4, generator=generator), torch.randint(0, 3, (6,), generator=generator)


@pytest.fixture(scope="session")
def lazy() -> torch.device:
    try:
        import torch._lazy.ts_backend

        torch._lazy.ts_backend.init()
        torch.ones(1, device="lazy").cpu()
    except Exception as exc:  # a build without the lazy backend
        pytest.skip(f"PyTorch's lazy device is not available here: {exc}")
    return torch.device("lazy", 0)
