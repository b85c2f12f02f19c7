"""A rank's pipeline stages at run time: torch's ``PipelineStage`` with its compute timed, and the plain
forward chain that evaluation uses.

Busy time is the time a stage spends inside its own forward and backward (``forward_one_chunk``,
``backward_one_chunk``, ``backward_weight_one_chunk``); the rest of a schedule's step is waiting for
neighbours (and sending): the measured bubble.

Under ``--precision bf16-mixed`` each stage's forward runs under the strategy's autocast (``autocast``), and so
does the first step's inference of the activations' shapes and dtypes, so the buffers torch allocates to
receive them have the dtype the stages send (bfloat16 after a matrix product, float32 after a residual
addition of a float32 input); backward runs outside it.

Bytes are counted where torch builds the point-to-point operations a schedule runs (``get_fwd_send_ops``
and the three others): activations sent forward and their gradients sent back, each tensor's bytes once.
Neighbouring stages on the same rank (``zbv``'s fold) hand tensors over locally and build none, so they
count nothing; neither do the one-time shape exchange of the first step and evaluation's forward chain.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from polytrain.phases import phase

#: what an activation's header can say its dtype is (evaluation sends a header before each tensor)
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.int32)
_HEADER = 8  # ndim, up to 6 sizes, dtype code


class StageTiming:
    """Mixin for a torch pipeline stage (``PipelineStage``, or the tracer's ``_PipelineStage``): adds the
    seconds spent computing to :attr:`busy` and the bytes of the activations and gradients it exchanges with
    other ranks to :attr:`sent` and :attr:`received`."""

    busy: float = 0.0
    sent: int = 0
    received: int = 0
    #: around each forward (and the first step's shape inference): the strategy's autocast, or nothing
    autocast: Callable[[], ContextManager[Any]] = contextlib.nullcontext

    def _timed(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            self.busy += time.perf_counter() - start

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self.autocast(), phase("forward"):
            return self._timed(super().forward_one_chunk, *args, **kwargs)

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        with self.autocast():  # the shapes and dtypes inferred as the forward will produce them
            return super()._prepare_forward_infra(*args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with phase("backward"):
            return self._timed(super().backward_one_chunk, *args, **kwargs)

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with phase("backward"):
            return self._timed(super().backward_weight_one_chunk, *args, **kwargs)

    def _counted(self, ops: list[dist.P2POp], outgoing: bool) -> list[dist.P2POp]:
        moved = sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
        if outgoing:
            self.sent += moved
        else:
            self.received += moved
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._counted(super().get_fwd_send_ops(fwd_chunk_id), outgoing=True)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._counted(super().get_bwd_send_ops(bwd_chunk_id), outgoing=True)

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._counted(super().get_fwd_recv_ops(fwd_chunk_id), outgoing=False)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._counted(super().get_bwd_recv_ops(bwd_chunk_id), outgoing=False)


class TimedStage(StageTiming, PipelineStage):
    """``PipelineStage`` (a stage of a chain of units) with its compute timed and its bytes counted."""


def send_activation(tensor: torch.Tensor, peer: int, group: Any) -> None:
    """Send ``tensor`` to ``peer`` (a rank in ``group``), header first, so the receiver needs no shape."""
    if tensor.dim() > _HEADER - 2 or tensor.dtype not in _DTYPES:
        raise ValueError(f"cannot send an activation of shape {tuple(tensor.shape)} and dtype {tensor.dtype}")
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0] = tensor.dim()
    header[1:1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    header[-1] = _DTYPES.index(tensor.dtype)
    dst = dist.get_global_rank(group, peer)
    dist.send(header.to(tensor.device), dst, group=group)
    dist.send(tensor.contiguous(), dst, group=group)


def recv_activation(peer: int, group: Any, device: torch.device) -> torch.Tensor:
    src = dist.get_global_rank(group, peer)
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    ndim = int(header[0])
    tensor = torch.empty([int(v) for v in header[1:1 + ndim]], dtype=_DTYPES[int(header[-1])], device=device)
    dist.recv(tensor, src, group=group)
    return tensor


def chain_forward(modules: dict[int, nn.Module], stages: int, owner: Any, me: int, inputs: torch.Tensor,
                  group: Any) -> torch.Tensor | None:
    """The whole batch through every stage in order, each on its rank (no micro-batches, no schedule: what
    evaluation needs). Returns the last stage's output on its rank, None elsewhere. ``owner(s)`` is the
    rank of stage ``s``; each rank walks the stages in order, so sends and receives pair up."""
    x: torch.Tensor | None = inputs
    for stage in range(stages):
        if owner(stage) != me:
            continue
        if stage > 0 and owner(stage - 1) != me:
            x = recv_activation(owner(stage - 1), group, inputs.device)
        x = modules[stage](x)
        if stage < stages - 1 and owner(stage + 1) != me:
            send_activation(x, owner(stage + 1), group)
    return x if owner(stages - 1) == me else None
