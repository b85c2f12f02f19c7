"""What ``polytrain bench`` measures, as plain data: the settings and the list of cases.

Every case trains the same model on the same data with the same per-worker batch; they differ in how the
work is spread. The plan can be printed (``polytrain bench --plan``) and tested without running anything.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from polytrain.data.registry import build_data, check_data
from polytrain.devices.host_memory import HOST_MEMORY_CHOICES
from polytrain.distributed.launch import available_cores
from polytrain.errors import ConfigError
from polytrain.models.registry import resolve_model_factory


@dataclass(frozen=True)
class BenchConfig:
    model: str = "cifar_cnn"
    data: str = "synthetic:shape=3x24x24,size=4096,test_size=0"
    worker_batch_size: int = 64
    workers: int = 2
    warmup: int = 10
    steps: int = 30
    repeats: int = 3
    lr: float = 0.01
    momentum: float = 0.9
    seed: int = 0
    timeout: float = 300.0
    host_memory: str = "cache"  # in every case, the DDP script's included: like for like

    def check(self) -> None:
        """Raise ConfigError naming the bad setting before anything starts."""
        if self.host_memory not in HOST_MEMORY_CHOICES:
            raise ConfigError(f"--host-memory must be one of {', '.join(HOST_MEMORY_CHOICES)}, "
                              f"got '{self.host_memory}'")
        for name in ("worker_batch_size", "workers", "warmup", "steps", "repeats"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        resolve_model_factory(self.model)
        size = check_data(self.data)
        global_batch = self.worker_batch_size * self.workers
        if size is not None and size < global_batch:
            raise ConfigError(f"--data {self.data}: {size} training examples, fewer than one global batch "
                              f"({self.workers} x {self.worker_batch_size}); use more data or a smaller batch")

    def to_dict(self) -> dict:
        return asdict(self)


def tokens_per_example(data: str, seed: int = 0) -> float | None:
    """Real target tokens per training example of language-model data (None for other tasks): exact for
    fixed-length windows (``text``), the training set's mean for sentences of different lengths."""
    bundle = build_data(data, seed=seed)
    count = getattr(bundle.train, "count_units", None)
    if bundle.task != "lm" or count is None:
        return None
    return count(torch.arange(len(bundle.train))) / len(bundle.train)


@dataclass(frozen=True)
class Case:
    """One way to run the training steps. ``runner`` is ``polytrain`` or ``ddp`` (the plain script);
    ``exchange=False`` runs the script without any gradient exchange (the machine's ceiling); ``comm`` and
    ``balance`` are polytrain's ``--comm`` (shared memory or the process group's all-reduce) and
    ``--balance`` (equal slices like the DDP script's, or slices by measured speed)."""

    key: str
    label: str
    runner: str
    strategy: str
    workers: int
    threads: int
    global_batch: int
    exchange: bool = True
    comm: str = "auto"
    balance: str = "off"

    @property
    def layout(self) -> str:
        return f"{self.workers}x{self.threads}"


def plan(cfg: BenchConfig, cores: int | None = None) -> list[Case]:
    """The cases, in the order of the first repeat."""
    cores = cores or available_cores()
    n, b = cfg.workers, cfg.worker_batch_size
    return [
        Case("single_1t", "polytrain single, 1 thread", "polytrain", "single", 1, 1, b),
        Case("single_all", f"polytrain single, all {cores} cores", "polytrain", "single", 1, cores, n * b),
        Case("sync", f"polytrain sync, {n} workers x 1 thread", "polytrain", "sync", n, 1, n * b),
        Case("sync_balanced", f"polytrain sync --balance auto, {n} x 1", "polytrain", "sync", n, 1, n * b,
             balance="auto"),
        Case("sync_gloo", f"polytrain sync --comm backend (gloo), {n} x 1", "polytrain", "sync", n, 1, n * b,
             comm="backend"),
        Case("ddp", f"plain PyTorch DDP, {n} workers x 1 thread", "ddp", "sync", n, 1, n * b),
        Case("no_exchange", f"{n} workers x 1 thread, no exchange (ceiling)", "ddp", "sync", n, 1, n * b,
             exchange=False),
    ]


def interleaved(cases: list[Case], repeats: int) -> list[tuple[int, Case]]:
    """(repeat, case) in running order: every repeat runs all cases, each repeat starting one case later,
    so that slow phases of a shared machine do not fall on the same case every time."""
    order = []
    for r in range(repeats):
        shift = r % len(cases)
        order += [(r, c) for c in cases[shift:] + cases[:shift]]
    return order


def describe(cfg: BenchConfig, cases: list[Case]) -> str:
    lines = [f"model {cfg.model}, data {cfg.data}, {cfg.worker_batch_size} examples per worker per step, "
             f"{cfg.warmup} warm-up + {cfg.steps} timed steps, {cfg.repeats} interleaved repeat(s), "
             f"--host-memory {cfg.host_memory}"]
    key_width = max(len(case.key) for case in cases)
    for case in cases:
        lines.append(f"  {case.key:<{key_width}} {case.label:<48} workers x threads {case.layout:<5} "
                     f"global batch {case.global_batch}")
    return "\n".join(lines)
