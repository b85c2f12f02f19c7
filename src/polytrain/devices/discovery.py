"""What devices this process can use: the CPU, the visible CUDA devices and Apple's MPS.

CUDA devices are listed as PyTorch numbers them, which already honours ``CUDA_VISIBLE_DEVICES``: with
``CUDA_VISIBLE_DEVICES=2,3`` the process sees ``cuda:0`` (physical GPU 2) and ``cuda:1`` (GPU 3), and with
``CUDA_VISIBLE_DEVICES=""`` it sees none. ``polytrain devices [--json]`` prints :func:`list_devices`.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


@dataclass
class DeviceInfo:
    """One device this process can use.

    ``name`` is what ``--device`` accepts (``cpu``, ``cuda:0``, ``mps``); ``memory_bytes`` is the device's
    total memory (system RAM for the CPU) and ``cores`` the CPU cores this process may run on.
    """

    name: str
    kind: str
    description: str
    memory_bytes: int | None = None
    cores: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no affinity mask
        return os.cpu_count() or 1


def cuda_device_count() -> int:
    """Visible CUDA devices; 0 where PyTorch has no CUDA or no device is visible."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def list_devices() -> list[DeviceInfo]:
    """The CPU first, then each visible CUDA device in PyTorch's order, then MPS where present."""
    devices = [_cpu_info()]
    devices += [_cuda_info(i) for i in range(cuda_device_count())]
    if mps_available():
        devices.append(_mps_info())
    return devices


def available_device_names() -> list[str]:
    """Names of the usable devices, e.g. ``['cpu', 'cuda:0', 'cuda:1']``; used in error messages."""
    names = ["cpu"] + [f"cuda:{i}" for i in range(cuda_device_count())]
    return names + (["mps"] if mps_available() else [])


def cuda_unavailable_reason() -> str:
    """Why this process has no CUDA device, in words a user can act on."""
    visible = os.environ.get(VISIBLE_ENV)
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"this PyTorch build ({torch.__version__}) has no CUDA support"
    if visible is not None and visible.strip() in ("", "-1"):
        return f"{VISIBLE_ENV}='{visible}' hides every GPU"
    if visible is not None:
        return f"no CUDA device is visible ({VISIBLE_ENV}='{visible}'; is the driver loaded?)"
    return "no CUDA device or driver was found"


def visibility_note() -> str | None:
    """A line explaining the numbering when ``CUDA_VISIBLE_DEVICES`` is set, else None."""
    visible = os.environ.get(VISIBLE_ENV)
    if visible is None:
        return None
    return (f"{VISIBLE_ENV}='{visible}': CUDA indices above are the visible ones, numbered from 0 "
            "as PyTorch numbers them")


def format_devices(devices: Sequence[DeviceInfo], *, notes: bool = True) -> str:
    """An aligned table of ``devices``; with ``notes``, lines on CUDA visibility follow it."""
    header = ("DEVICE", "KIND", "MEMORY", "CORES", "DESCRIPTION")
    rows = [header] + [
        (d.name, d.kind, format_bytes(d.memory_bytes), "-" if d.cores is None else str(d.cores), d.description)
        for d in devices
    ]
    widths = [max(len(row[col]) for row in rows) for col in range(len(header) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in rows]
    if notes:
        if not any(d.kind == "cuda" for d in devices):
            lines.append(f"no CUDA devices: {cuda_unavailable_reason()}")
        note = visibility_note()
        if note:
            lines.append(note)
    return "\n".join(line.rstrip() for line in lines)


def format_bytes(count: int | None) -> str:
    """``1536`` -> ``'1.5 KiB'``; None -> ``'-'``."""
    if count is None:
        return "-"
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _cpu_info() -> DeviceInfo:
    return DeviceInfo("cpu", "cpu", _cpu_model(), _system_memory(), usable_cores())


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({platform.machine()})"
    except OSError:  # not Linux
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _system_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # Windows, or a platform without these names
        return None


def _cuda_info(index: int) -> DeviceInfo:
    name = f"cuda:{index}"
    try:
        props = torch.cuda.get_device_properties(index)
    except RuntimeError as exc:  # a device that is visible but broken should not hide the others
        return DeviceInfo(name, "cuda", f"unusable: {exc}".splitlines()[0])
    description = f"{props.name} (compute {props.major}.{props.minor}, {props.multi_processor_count} SMs)"
    return DeviceInfo(name, "cuda", description, int(props.total_memory))


def _mps_info() -> DeviceInfo:
    memory = None
    try:
        memory = int(torch.mps.recommended_max_memory())
    except (AttributeError, RuntimeError):  # older torch; the figure is only informative
        pass
    return DeviceInfo("mps", "mps", "Apple Metal (MPS), shares system memory", memory)
