"""The device settings of a run (the ``devices and placement`` flags), and their checks before launch.

Each value is checked on its own when the config is resolved (a bad ``--device`` or ``--place`` is one
error line naming the flag). :func:`check_device_config` then checks what needs several settings at once
and the machine: without ``--soft-placement``, every device named by ``--device``, ``--place`` and
``--placement`` must be available, so the error comes before any worker starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from polytrain.devices.memory_limit import check_memory_limit
from polytrain.devices.plan import PlacementPlan
from polytrain.devices.spec import QUIET, parse_device, resolve_device
from polytrain.errors import DeviceError
from polytrain.options import option, register_section


def _check_device(text: str) -> None:
    try:
        parse_device(text)
    except DeviceError as exc:  # the option layer reports ValueError as "--device: <message>"
        raise ValueError(str(exc)) from None


def _check_place(text: str) -> None:
    try:
        PlacementPlan.from_flag(text, source="plan")
    except DeviceError as exc:
        raise ValueError(str(exc).removeprefix("plan: ")) from None


def _check_fraction(value: float) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"must be in (0, 1], got {value}")


@register_section("device", "devices and placement", order=50)
@dataclass
class DeviceConfig:
    device: str = option("cpu", "device per worker: cpu | cpu:N (N CPU workers) | cuda | cuda:N | cuda:0,1 | mps | "
                         "auto (TensorFlow forms like /gpu:1 work too)", metavar="SPEC", check=_check_device)
    soft_placement: bool = option(False, "fall back (logged) to the CPU or another GPU when a device is not "
                                  "available, and run operators a device lacks on the CPU")
    place: str | None = option(None, "put sub-modules on devices: features=cuda:0,classifier=cuda:1 "
                               "(later entries win; globs allowed)", metavar="MODULE=DEV,...", check=_check_place)
    placement: str | None = option(None, "placement plan file (TOML: module = \"device\")", metavar="FILE.toml")
    log_placement: bool = option(False, "print and save (in --log-dir) the module → device table and the "
                                 "per-operator device log of the first step(s)")
    log_placement_steps: int = option(1, "--log-placement: how many steps, from the first, get a per-operator "
                                      "log", minimum=1, metavar="N")
    gpu_memory_fraction: float | None = option(None, "cap this process's share of each GPU's memory (0..1]",
                                               metavar="F", check=_check_fraction)
    memory_limit: str | None = option(None, "the most memory each worker may allocate for training, above what "
                                      "it holds at start (CPU: its private memory, Linux; GPU: the same cap as "
                                      "--gpu-memory-fraction); past it a worker fails with one line: 600MiB, 2GB, "
                                      "...", metavar="SIZE", check=check_memory_limit)

    def plan(self) -> PlacementPlan | None:
        """The placement plan of ``--placement`` then ``--place`` (flag entries win); None if neither."""
        return PlacementPlan.from_options(self.place, self.placement)


def check_device_config(config: DeviceConfig, workers: int = 1) -> PlacementPlan | None:
    """Check ``config`` on this machine before launching ``workers`` local workers; return the plan.

    Reads the placement file, and without soft placement resolves ``--device`` for each local worker and
    every device of the plan, so an unavailable one is a DeviceError naming it and the available devices.
    With soft placement nothing is resolved here: each worker makes (and logs) its own fallback decisions.
    """
    plan = config.plan()
    if config.memory_limit is not None and config.gpu_memory_fraction is not None:
        raise DeviceError("--memory-limit and --gpu-memory-fraction both cap a GPU's memory; give one of them")
    if config.soft_placement:
        return plan
    for local_rank in range(max(1, workers)):  # 'cuda' means each worker's own GPU: check every one
        try:
            resolve_device(config.device, local_rank=local_rank, log=QUIET)
        except DeviceError as exc:
            raise DeviceError(f"--device: {exc}") from None
        for pattern, value in plan.entries if plan else ():
            try:
                resolve_device(str(value), local_rank=local_rank, log=QUIET)
            except DeviceError as exc:
                raise DeviceError(f"{plan.source} ({pattern}={value}): {exc}") from None
    return plan
