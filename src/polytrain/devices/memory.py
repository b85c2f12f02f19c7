"""GPU memory options: ``--gpu-memory-fraction``, TensorFlow's ``per_process_gpu_memory_fraction``.

TensorFlow grabs nearly all GPU memory up front unless ``allow_growth`` is set. PyTorch never does: its
caching allocator asks CUDA for memory as tensors need it (TensorFlow's ``allow_growth`` is PyTorch's
default) and keeps freed blocks cached for reuse. So the one knob worth a flag is a *cap*:
:func:`set_gpu_memory_fraction` limits how much of a GPU this process's allocator may hold; beyond it,
allocations raise ``torch.OutOfMemoryError`` instead of squeezing other processes on the same GPU.
Fragmentation is tuned with ``PYTORCH_ALLOC_CONF=expandable_segments:True`` (``PYTORCH_CUDA_ALLOC_CONF``
before torch 2.9); docs/devices.md explains both.
"""

from __future__ import annotations

import logging
import math
from typing import Iterable

import torch

from polytrain.devices.discovery import available_device_names, cuda_device_count, format_bytes
from polytrain.devices.spec import LOGGER_NAME
from polytrain.errors import DeviceError


def check_memory_fraction(fraction: object) -> float:
    """``fraction`` as a float in (0, 1]; DeviceError saying what was wrong otherwise."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or math.isnan(fraction):
        raise DeviceError(f"--gpu-memory-fraction must be a number in (0, 1], e.g. 0.5; got {fraction!r}")
    if not 0 < fraction <= 1:
        raise DeviceError(f"--gpu-memory-fraction must be in (0, 1] (a share of each GPU's memory, e.g. 0.5); "
                          f"got {fraction}")
    return float(fraction)


def set_gpu_memory_fraction(fraction: float, device: torch.device | str | Iterable[torch.device | str], *,
                            log: logging.Logger | None = None) -> list[torch.device]:
    """Cap this process's allocator at ``fraction`` of each CUDA device in ``device``; return those devices.

    ``device`` is one device or several (e.g. every device of a placed model). Non-CUDA devices are
    skipped with a logged note, since the CPU and MPS have no such cap; a CUDA device this process cannot
    see is a DeviceError. Call it in each worker before the first allocation on the device.
    """
    log = log or logging.getLogger(LOGGER_NAME)
    fraction = check_memory_fraction(fraction)
    devices = [device] if isinstance(device, (str, torch.device)) else list(device)
    applied: list[torch.device] = []
    for target in dict.fromkeys(torch.device(d) for d in devices):
        if target.type != "cuda":
            log.info("--gpu-memory-fraction has no effect on %s: only CUDA devices have a per-process cap", target)
            continue
        index = target.index if target.index is not None else torch.cuda.current_device()
        if index >= cuda_device_count():
            raise DeviceError(f"--gpu-memory-fraction: device cuda:{index} is not available; available devices: "
                              f"{', '.join(available_device_names())}")
        torch.cuda.set_per_process_memory_fraction(fraction, index)
        total = torch.cuda.get_device_properties(index).total_memory
        log.info("GPU memory cap: %.0f%% of cuda:%d (%s of %s)", fraction * 100, index,
                 format_bytes(int(total * fraction)), format_bytes(total))
        applied.append(torch.device("cuda", index))
    return applied
