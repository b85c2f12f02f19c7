"""One parser for every device name polytrain accepts, and the rule that turns it into a ``torch.device``.

Accepted forms (case-insensitive, surrounding spaces ignored):

* PyTorch: ``cpu``, ``cpu:0``, ``cuda``, ``cuda:1``, ``mps``, ``mps:0``, ``auto``;
* ``gpu`` is a synonym of ``cuda``: ``gpu``, ``gpu:1``;
* TensorFlow: ``/cpu:0``, ``/gpu:1``, ``/device:GPU:1``, ``/physical_device:GPU:1`` and the full
  ``/job:localhost/replica:0/task:0/device:GPU:1`` (only the local job: polytrain chooses workers with
  ``--workers``, not with device names);
* lists, one device per worker: ``cuda:0,1``, ``cuda:0,cuda:1``, ``/gpu:0,/gpu:1``;
* CPU worker counts: ``cpu:N``.

**cpu:0 versus cpu:4.** The CPU is one device, so an index after ``cpu`` can only mean one thing:
``cpu:0`` is the CPU device (PyTorch's own spelling) and ``cpu:N`` with N >= 1 asks for N CPU workers
(``count == N``). TensorFlow forms always name a device, so ``/cpu:0`` is the CPU and ``/cpu:1`` is an
error.

CUDA indices are *visible* indices, numbered as PyTorch numbers them: with ``CUDA_VISIBLE_DEVICES=2,3``,
``cuda:0`` is physical GPU 2.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch

from polytrain.devices.discovery import (
    available_device_names,
    cuda_device_count,
    cuda_unavailable_reason,
    mps_available,
)
from polytrain.errors import DeviceError
from polytrain.log import EVERY_RANK

LOGGER_NAME = "polytrain.devices"
ACCEPTED_FORMS = ("cpu, cpu:0, cpu:N (N CPU workers), cuda, cuda:1, gpu:1, /gpu:1, /device:GPU:1, "
                  "/job:localhost/replica:0/task:0/device:GPU:1, mps, auto, lists such as cuda:0,1")
_TYPES = {"cpu": "cpu", "cuda": "cuda", "gpu": "cuda", "mps": "mps", "auto": "auto"}
_NUMBER = re.compile(r"[0-9]+", re.ASCII)
_TF_PREFIXES = ("device:", "physical_device:")


def _quiet_logger() -> logging.Logger:
    logger = logging.getLogger(f"{LOGGER_NAME}.quiet")
    logger.addHandler(logging.NullHandler())  # no handler at all would print through logging.lastResort
    logger.propagate = False
    return logger


#: for resolving a device only to check it or to pick a backend: the worker that uses it logs the decision
QUIET = _quiet_logger()


@dataclass(frozen=True)
class DeviceSpec:
    """A parsed device name.

    ``type`` is ``'cpu'``, ``'cuda'``, ``'mps'`` or ``'auto'``; ``indices`` the device indices given
    (empty: unspecified; two or more: one device per worker, in local-rank order); ``count`` the number
    of CPU workers of a ``cpu:N`` spec (N >= 1), else None; ``text`` the original text, kept for
    messages. Equality ignores ``text``; ``str()`` gives the canonical form.
    """

    type: str
    indices: tuple[int, ...] = ()
    count: int | None = None
    text: str = field(default="", compare=False)

    def __str__(self) -> str:
        if self.count is not None:
            return f"cpu:{self.count}"
        if self.indices:
            return f"{self.type}:{','.join(str(i) for i in self.indices)}"
        return self.type

    @property
    def is_list(self) -> bool:
        """Two or more devices: one per worker."""
        return len(self.indices) > 1

    @property
    def workers(self) -> int | None:
        """Workers this spec asks for by itself (``cpu:4`` -> 4, ``cuda:0,1`` -> 2), else None."""
        if self.count is not None:
            return self.count
        return len(self.indices) if self.is_list else None

    @property
    def is_single_device(self) -> bool:
        """Names exactly one device (or ``auto``): what a placement entry needs."""
        return self.count is None and not self.is_list


def parse_device(text: str | DeviceSpec) -> DeviceSpec:
    """Parse any accepted device form (see the module docstring); DeviceError listing the forms if bad."""
    if isinstance(text, DeviceSpec):
        return text
    if isinstance(text, torch.device):
        text = str(text)
    if not isinstance(text, str):
        raise DeviceError(f"device must be text such as 'cuda:1', got {type(text).__name__} {text!r}")
    items = [item.strip() for item in text.strip().split(",")]
    if not items[0]:
        raise _bad(text, "it is empty" if len(items) == 1 else "it starts with a comma")
    first = _parse_one(items[0], text)
    if len(items) == 1:
        return _finish(first, text)
    return _parse_list(first, items[1:], text)


def _parse_one(item: str, text: str) -> DeviceSpec:
    """One device: a PyTorch form (``cuda:1``) or a TensorFlow form (``/device:GPU:1``)."""
    low = item.lower()
    if low.startswith("/") or low.startswith(_TF_PREFIXES):
        return _parse_tensorflow(low, text)
    name, colon, rest = low.partition(":")
    kind = _kind(name, text)
    if not colon:
        return DeviceSpec(kind, text=text)
    if not _NUMBER.fullmatch(rest):
        raise _bad(text, f"'{rest}' after '{name}:' is not a device index (a whole number >= 0)")
    return _indexed(kind, int(rest), text, tensorflow=False)


def _parse_tensorflow(low: str, text: str) -> DeviceSpec:
    """``/job:localhost/replica:0/task:0/device:GPU:1`` and its shorter forms."""
    parts = [p for p in low.split("/") if p]
    if not parts:
        raise _bad(text, "'/' names no device")
    *scope, last = parts
    for part in scope:
        _check_tf_scope(part, text)
    for prefix in _TF_PREFIXES:
        if last.startswith(prefix):
            last = last[len(prefix):]
            break
    name, colon, rest = last.partition(":")
    kind = _kind(name, text)
    if not colon or rest == "*":  # TensorFlow's '/device:GPU:*' means any GPU, as does a bare '/gpu'
        return DeviceSpec(kind, text=text)
    if not _NUMBER.fullmatch(rest):
        raise _bad(text, f"'{rest}' after '{name}:' is not a device index (a whole number >= 0)")
    return _indexed(kind, int(rest), text, tensorflow=True)


def _check_tf_scope(part: str, text: str) -> None:
    key, _, value = part.partition(":")
    if key == "job":
        if value != "localhost":
            raise DeviceError(
                f"device '{text}' names TensorFlow job '{value}'; polytrain places devices inside each worker "
                "process, so give the device part only (e.g. /device:GPU:1) and choose workers with --workers")
    elif key in ("replica", "task"):
        if value != "0":
            raise DeviceError(f"device '{text}': {key}:{value} is another process; only the local "
                              f"{key}:0 can be named (choose workers with --workers)")
    else:
        raise _bad(text, f"'/{part}' is not /job:, /replica:, /task: or /device:")


def _kind(name: str, text: str) -> str:
    kind = _TYPES.get(name)
    if kind is None:
        raise _bad(text, f"'{name}' is not a device type (cpu, cuda, gpu, mps, auto)")
    return kind


def _indexed(kind: str, index: int, text: str, *, tensorflow: bool) -> DeviceSpec:
    if kind == "auto":
        raise _bad(text, "'auto' takes no index")
    if kind == "cpu":
        if index == 0:
            return DeviceSpec("cpu", (0,), text=text)
        if tensorflow:
            raise _bad(text, "the CPU is one device, /cpu:0; for N CPU workers write cpu:N")
        return DeviceSpec("cpu", count=index, text=text)
    if kind == "mps" and index != 0:
        raise _bad(text, "there is one MPS device, mps:0")
    return DeviceSpec(kind, (index,), text=text)


def _parse_list(first: DeviceSpec, rest: list[str], text: str) -> DeviceSpec:
    """``cuda:0,1`` / ``cuda:0,cuda:1``: later items are bare indices or devices of the same type."""
    if first.type == "cuda" and not first.indices:
        raise _bad(text, "a list gives each device's index, e.g. cuda:0,1")
    if first.type != "cuda":
        raise _bad(text, "only CUDA devices can be listed (e.g. cuda:0,1); the CPU and MPS are one device each")
    indices = list(first.indices)
    for item in rest:
        if not item:
            raise _bad(text, "it has an empty item (two commas in a row?)")
        if _NUMBER.fullmatch(item):
            indices.append(int(item))
            continue
        spec = _parse_one(item, text)
        if spec.type != "cuda" or len(spec.indices) != 1:
            raise _bad(text, f"'{item}' is not a CUDA device index; a list names CUDA devices only")
        indices.append(spec.indices[0])
    duplicates = sorted({i for i in indices if indices.count(i) > 1})
    if duplicates:
        raise _bad(text, f"cuda:{duplicates[0]} is listed twice; list each device once")
    return DeviceSpec("cuda", tuple(indices), text=text)


def _finish(spec: DeviceSpec, text: str) -> DeviceSpec:
    return spec if spec.text == text else DeviceSpec(spec.type, spec.indices, spec.count, text)


def _bad(text: str, reason: str) -> DeviceError:
    return DeviceError(f"bad device '{text}': {reason}; accepted forms: {ACCEPTED_FORMS}")


def resolve_device(spec: str | DeviceSpec | torch.device, *, local_rank: int = 0, soft: bool = False,
                   log: logging.Logger | None = None) -> torch.device:
    """The concrete device that the worker with ``local_rank`` uses.

    ``cpu``/``cpu:N`` -> cpu; ``auto`` -> ``cuda:<local_rank>`` when CUDA is available, else mps, else cpu;
    ``cuda`` -> ``cuda:<local_rank>``; ``cuda:i`` -> ``cuda:i`` for every worker; a list -> its
    ``local_rank``-th entry. A device that does not exist or is not available raises DeviceError naming
    it and the available devices, unless ``soft``: then a missing CUDA index falls back to another
    visible GPU (index modulo the count) and an unavailable device type to the CPU, with one warning.
    """
    log = log or logging.getLogger(LOGGER_NAME)
    parsed = parse_device(spec)
    if local_rank < 0:
        raise ValueError(f"local_rank must be >= 0, got {local_rank}")
    if parsed.type == "cpu":
        return torch.device("cpu")
    if parsed.type == "auto":
        return _resolve_auto(local_rank, log)
    index = _index_for(parsed, local_rank)
    problem, fallback = _availability(parsed.type, index)
    if problem is None:
        return torch.device(parsed.type, index)
    requested = "mps" if parsed.type == "mps" else f"{parsed.type}:{index}"
    origin = "" if (parsed.text or str(parsed)) == requested else f" (from '{parsed.text or parsed}')"
    if not soft:
        raise DeviceError(
            f"device '{requested}'{origin} is not available: {problem}; available devices: "
            f"{', '.join(available_device_names())}; choose one of them, or allow a fallback to {fallback} "
            f"with --soft-placement (soft=True)")
    log.warning("soft placement: device '%s' is not available (%s); using %s instead", requested, problem, fallback,
                extra=EVERY_RANK)
    return fallback


def _index_for(spec: DeviceSpec, local_rank: int) -> int:
    if spec.is_list:
        if local_rank >= len(spec.indices):
            raise DeviceError(f"device list '{spec}' has {len(spec.indices)} devices but this is local worker "
                              f"{local_rank}; list one device per worker or use fewer --workers")
        return spec.indices[local_rank]
    if spec.indices:
        return spec.indices[0]
    return local_rank if spec.type == "cuda" else 0


def _availability(kind: str, index: int) -> tuple[str | None, torch.device]:
    """``(None, _)`` if ``kind:index`` is usable, else ``(why not, the soft-placement fallback)``."""
    cpu = torch.device("cpu")
    if kind == "mps":
        return (None, cpu) if mps_available() else ("MPS is not available in this process", cpu)
    count = cuda_device_count()
    if count == 0:
        return cuda_unavailable_reason(), cpu
    if index >= count:
        return (f"only {count} CUDA device(s) are visible, cuda:0 to cuda:{count - 1}",
                torch.device("cuda", index % count))
    return None, cpu


def _resolve_auto(local_rank: int, log: logging.Logger) -> torch.device:
    count = cuda_device_count()
    if count:
        if local_rank >= count:
            # more workers than GPUs: sharing works with gloo; launch refuses it for nccl
            log.warning("device auto: local worker %d but only %d GPU(s) visible; sharing cuda:%d",
                        local_rank, count, local_rank % count, extra=EVERY_RANK)
        return torch.device("cuda", local_rank % count)
    return torch.device("mps") if mps_available() else torch.device("cpu")


def default_backend(device: torch.device | str) -> str:
    """The collective backend for workers on ``device``: ``nccl`` for CUDA, ``gloo`` otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"
