"""What carries a pipeline's activations between stages: point-to-point sends of the process group's backend.

gloo sends only CPU tensors: with stages on a GPU it fails inside the schedule (``gloo::IoException ...
writev ... Bad address`` and a SIGABRT, seen on an H100), so that pairing is refused before launch.
"""

from __future__ import annotations

from typing import Any

import torch

from polytrain.devices.spec import parse_device
from polytrain.errors import ConfigError


def _on_gpu(device: str) -> bool:
    kind = parse_device(device).type
    return kind == "cuda" or (kind == "auto" and torch.cuda.is_available())


def check_transport(config: Any, strategy: str) -> None:
    """Refuse ``--backend gloo`` when the stages would be on a GPU (one line, with the fix)."""
    if config.launch.backend == "gloo" and _on_gpu(config.device.device):
        raise ConfigError(f"--strategy {strategy} with --backend gloo on a GPU: gloo cannot send CUDA tensors "
                          f"between stages; use --backend nccl (auto) with one GPU per stage, or --device cpu")
