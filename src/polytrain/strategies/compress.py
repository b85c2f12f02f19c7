"""``sync --compress``: gradients compressed before DDP all-reduces them (DDP communication hooks).

* ``fp16`` / ``bf16``: each bucket cast to half precision, all-reduced, divided by the world size and cast
  back (``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook``): half the bytes, the same update to
  within half precision's rounding.
* ``powersgd:rank=R`` (Vogels et al. 2019, ``powerSGD_hook``): each gradient matrix ``M`` (a tensor viewed as
  ``shape[0] x rest``) is replaced by a rank-R product ``P Q^T`` found by one power iteration, and only ``P``
  and ``Q`` are all-reduced; the part of ``M`` the approximation left out is kept by each worker (*error
  feedback*) and added to its next gradient, so nothing is lost, only delayed. Vectors (biases) and matrices
  too small to gain ``min_rate`` (2) are all-reduced whole. The first ``start`` steps (default 2, the least
  DDP allows with error feedback) all-reduce every gradient whole.

Bytes are counted as ``sync`` counts them (:mod:`polytrain.strategies.traffic`: the ring model, per
all-reduce): the half-precision buckets, or PowerSGD's three all-reduces per bucket (the uncompressed
tensors, all P, all Q), computed from the bucket's tensors as the hook itself splits them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

CHOICES = "off, fp16, bf16, powersgd:rank=R[:start=S]"


@dataclass(frozen=True)
class Compression:
    kind: str = "off"  # off | fp16 | bf16 | powersgd
    rank: int = 0
    start: int = 2
    min_rate: float = 2.0

    def describe(self) -> str:
        if self.kind == "powersgd":
            return (f"gradients compressed by PowerSGD (rank {self.rank}, error feedback, from step "
                    f"{self.start})")
        return f"gradients all-reduced in {self.kind}"


def parse_compress(text: str) -> Compression:
    """``off``, ``fp16``, ``bf16`` or ``powersgd:rank=R[:start=S]``; ValueError naming what is accepted."""
    text = text.strip()
    if text in ("off", "fp16", "bf16"):
        return Compression(text)
    name, *pieces = text.split(":")
    if name != "powersgd":
        raise ValueError(f"unknown value '{text}'; accepted: {CHOICES}")
    values: dict[str, int] = {}
    for piece in pieces:
        key, _, value = piece.partition("=")
        if key not in ("rank", "start") or key in values:
            raise ValueError(f"'{text}': expected powersgd:rank=R[:start=S], got '{piece}'")
        try:
            values[key] = int(value)
        except ValueError:
            raise ValueError(f"'{text}': {key} must be a whole number, got '{value}'") from None
    if "rank" not in values or values["rank"] < 1:
        raise ValueError(f"'{text}': powersgd needs rank=R with R >= 1 (e.g. powersgd:rank=4)")
    if values.get("start", 2) < 2:
        raise ValueError(f"'{text}': start must be >= 2 (DDP's first step builds its buckets; PowerSGD's error "
                         "feedback starts after it)")
    return Compression("powersgd", values["rank"], values.get("start", 2))


def check_compress(text: str) -> None:
    parse_compress(text)


def make_hook(compression: Compression, strategy: Any) -> tuple[Any, Any]:
    """(state, hook) for ``DistributedDataParallel.register_comm_hook``; ``strategy`` has ``traffic``,
    ``topology`` and ``_last_bucket_ready`` (sync's timing of its exchange)."""
    if compression.kind in ("fp16", "bf16"):
        return _HalfState(strategy, compression.kind), _half_hook
    group = strategy.topology.group
    state = powerSGD_hook.PowerSGDState(group, matrix_approximation_rank=compression.rank,
                                        start_powerSGD_iter=compression.start,
                                        min_compression_rate=compression.min_rate, use_error_feedback=True,
                                        warm_start=True, random_seed=0)
    return _PowerState(strategy, state), _power_hook


class _HalfState:
    def __init__(self, strategy: Any, kind: str):
        self.strategy = strategy
        self.hook = default_hooks.fp16_compress_hook if kind == "fp16" else default_hooks.bf16_compress_hook
        self.dtype = torch.float16 if kind == "fp16" else torch.bfloat16


class _PowerState:
    def __init__(self, strategy: Any, power: Any):
        self.strategy = strategy
        self.power = power


def _half_hook(state, bucket):  # unannotated: DDP rejects annotations other than its own types
    sync = state.strategy
    sync._last_bucket_ready = time.perf_counter()
    itemsize = torch.empty((), dtype=state.dtype).element_size()
    sync.traffic.all_reduce(bucket.buffer().numel() * itemsize, sync.topology.world_size)
    return state.hook(sync.topology.group, bucket)


def _power_hook(state, bucket):  # unannotated, as above
    sync = state.strategy
    sync._last_bucket_ready = time.perf_counter()
    for payload in powersgd_payloads(state.power, bucket.buffer(), bucket.gradients()):
        sync.traffic.all_reduce(payload, sync.topology.world_size)
    return powerSGD_hook.powerSGD_hook(state.power, bucket)


def powersgd_payloads(power: Any, buffer: torch.Tensor, gradients: list[torch.Tensor]) -> list[int]:
    """The bytes of each all-reduce ``powerSGD_hook`` is about to make for this bucket (call it before the
    hook: the hook counts the step): the whole buffer before ``start_powerSGD_iter``, else the uncompressed
    tensors, all P and all Q (the hook's own split, ``_should_compress``)."""
    itemsize = buffer.element_size()
    if power.iter < power.start_powerSGD_iter:
        return [buffer.numel() * itemsize]
    whole = ps = qs = 0
    for grad in gradients:
        rows = grad.shape[0] if grad.dim() else 1
        cols = grad.numel() // max(rows, 1)
        rank = min(rows, cols, power.matrix_approximation_rank)
        if (rows + cols) * rank * power.min_compression_rate < rows * cols:
            ps += rows * rank
            qs += cols * rank
        else:
            whole += grad.numel()
    return [whole * itemsize, ps * itemsize, qs * itemsize]


def steady_ratio(shapes: list[tuple[int, ...]], rank: int, min_rate: float = 2.0) -> float:
    """Uncompressed elements over PowerSGD's all-reduced elements for tensors of these shapes (no warm-up)."""
    whole = sent = 0
    for shape in shapes:
        numel = int(torch.Size(shape).numel())
        rows = shape[0] if shape else 1
        cols = numel // max(rows, 1)
        r = min(rows, cols, rank)
        whole += numel
        sent += (rows + cols) * r if (rows + cols) * r * min_rate < rows * cols else numel
    return whole / sent if sent else 1.0
