"""diloco's outer exchange: plain, quantised (``--outer-quantize``) and streaming (``--fragments``, ``--overlap-steps``).

Plain DiLoCo (Douillard et al. 2023) meets every H steps: the workers average their parameters, the anchor (the
parameters of the last meeting) takes ``anchor - average`` as its gradient and the outer optimizer steps it,
and every worker continues from the new anchor. Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo
with overlapping communication") changes three things, each a setting here and each off by default:

* **fragments** (``--fragments F``): the parameters are cut into F contiguous fragments of about equal size
  (whole tensors, in the model's order), and fragment ``p`` meets every H steps at steps ``p * H // F + k H``:
  each meeting moves 1/F of the model, so the peak bytes on the link are F times lower for the same total.
  Floating-point buffers (BatchNorm statistics) are averaged with fragment 0.
* **overlap** (``--overlap-steps T``): a fragment's exchange is started after its meeting step and waited for
  T inner steps later, which run while it is on the wire; then the outer step is taken and the fragment's
  parameters become ``mix * local + (1 - mix) * global`` (``--overlap-mix``, the paper's alpha, 0.5): what the
  worker learnt during the T steps is partly kept. With T = 0 the fragment takes the outer result, as DiLoCo.
* **quantised outer gradients** (``--outer-quantize int8|int4``): each worker sends its own outer gradient
  ``anchor - local`` as 8- or 4-bit integers, one float32 scale per block of 256 values (symmetric, round to
  nearest), by an all-gather; every rank dequantises all of them and averages them in rank order, in float32,
  so every rank gets the same result. ``--outer-error-feedback`` keeps, per worker, what rounding left out and
  adds it to its next outer gradient. An all-gather sends ``(N - 1)`` times the payload per rank where a ring
  all-reduce sends ``2 (N - 1) / N`` times: int8 (about 1/4 of float32) saves bytes up to 7 workers, int4 up to
  15.

With one fragment, no overlap and no quantisation the arithmetic is plain DiLoCo's, operation for operation
(``tests/strategies/test_streaming.py`` checks it bit for bit).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from polytrain.parallel.dtensor import local

BLOCK = 256  # values per quantisation scale


# -- quantisation --------------------------------------------------------------------------------------------

def quantize(values: torch.Tensor, bits: int) -> torch.Tensor:
    """A flat float tensor as bytes: the integers (int8, or two int4 per byte) then one float32 scale per
    ``BLOCK`` values. :func:`dequantize` inverts it to within half a step of each block's scale."""
    flat = values.detach().float().reshape(-1)
    padded = torch.nn.functional.pad(flat, (0, (-flat.numel()) % BLOCK)).view(-1, BLOCK)
    top = 127 if bits == 8 else 7
    scale = padded.abs().amax(dim=1) / top
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(padded / scale[:, None]).clamp_(-top, top).to(torch.int16).view(-1)
    if bits == 8:
        body = q.to(torch.int8).view(torch.uint8)
    else:
        u = (q + 8).to(torch.uint8)  # 1..15
        body = u[0::2] | (u[1::2] << 4)
    return torch.cat([body, scale.view(torch.uint8)])


def dequantize(data: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    blocks = -(-numel // BLOCK)
    body_bytes = blocks * BLOCK * bits // 8
    body, scale = data[:body_bytes], data[body_bytes:].view(torch.float32)
    if bits == 8:
        q = body.view(torch.int8).float()
    else:
        q = torch.stack([(body & 15), (body >> 4)], dim=1).view(-1).float() - 8
    return (q.view(blocks, BLOCK) * scale[:, None]).view(-1)[:numel]


def quantized_bytes(numel: int, bits: int) -> int:
    blocks = -(-numel // BLOCK)
    return blocks * BLOCK * bits // 8 + 4 * blocks


# -- fragments -----------------------------------------------------------------------------------------------

def split_fragments(sizes: list[int], fragments: int) -> list[list[int]]:
    """Indices of ``sizes`` (tensor sizes, in order) cut into ``fragments`` contiguous, non-empty groups of
    about equal total size."""
    if not 1 <= fragments <= len(sizes):
        raise ValueError(f"cannot cut {len(sizes)} parameter tensor(s) into {fragments} fragment(s)")
    total = sum(sizes)
    groups: list[list[int]] = [[] for _ in range(fragments)]
    done = 0
    for index, size in enumerate(sizes):
        left = len(sizes) - index  # tensors still to place, this one included
        p = min(int(done * fragments / total) if total else 0, fragments - 1)
        p = max(p, fragments - left)  # every later fragment still gets at least one tensor
        while p > 0 and not groups[p - 1]:
            p -= 1  # no fragment stays empty behind this one
        groups[p].append(index)
        done += size
    return groups


def meets(fragment: int, fragments: int, every: int, done: int) -> bool:
    """Whether ``fragment`` meets after global step ``done`` (counted from 1): every ``every`` steps, offset by
    ``fragment * every // fragments``."""
    offset = fragment * every // fragments
    return done >= max(offset, 1) and (done - offset) % every == 0


# -- the exchange --------------------------------------------------------------------------------------------

@dataclass
class _Pending:
    fragment: int
    due: int  # the global step after which it is applied
    work: list[Any]  # the collectives' handles
    flats: list[torch.Tensor]  # what they reduce into (plain) or gather into (quantised)
    started: float = field(default_factory=time.perf_counter)


class OuterExchange:
    """The meetings of one diloco worker: which fragment meets when, the exchange, the outer step."""

    def __init__(self, diloco: Any, fragments: int = 1, overlap: int = 0, mix: float = 0.5,
                 quantize_to: str = "off", error_feedback: bool = False):
        self.diloco = diloco
        self.fragments, self.overlap, self.mix = fragments, overlap, mix
        self.bits = {"off": 0, "int8": 8, "int4": 4}[quantize_to]
        self.error_feedback = error_feedback
        self.groups = split_fragments([p.numel() for p in self.params], fragments)
        self.errors: dict[int, torch.Tensor] = {}  # --outer-error-feedback: what rounding left out, per fragment
        self.pending: list[_Pending] = []

    @property
    def params(self) -> list[torch.Tensor]:
        """This rank's parameters (its shards, where the replica is sharded), in the model's order."""
        return [local(p) for p in self.diloco.module.parameters()]

    def describe(self) -> str:
        parts = []
        if self.fragments > 1:
            parts.append(f"{self.fragments} fragments staggered by {self.diloco.options.sync_every // self.fragments} "
                         "step(s)")
        if self.overlap:
            parts.append(f"each exchange overlapped with {self.overlap} inner step(s) (mix {self.mix:g})")
        if self.bits:
            parts.append(f"outer gradients sent as int{self.bits}" +
                         (" with error feedback" if self.error_feedback else ""))
        return "; ".join(parts)

    def busy_after(self, done: int) -> bool:
        """Whether anything is due or meets after global step ``done``."""
        every = self.diloco.options.sync_every
        return any(p.due <= done for p in self.pending) or \
            any(meets(f, self.fragments, every, done) for f in range(self.fragments))

    def all_met(self, done: int) -> bool:
        """Whether every replica holds the same model after step ``done``: every fragment met, nothing pending."""
        every = self.diloco.options.sync_every
        return not self.pending and all(meets(f, self.fragments, every, done) for f in range(self.fragments))

    def after_step(self, done: int) -> float:
        """Apply what is due after global step ``done`` and start the fragments meeting now; seconds waited."""
        started = time.perf_counter()
        for item in [p for p in self.pending if p.due <= done]:
            self._finish(item)
            self.pending.remove(item)
        every = self.diloco.options.sync_every
        for fragment in range(self.fragments):
            if meets(fragment, self.fragments, every, done):
                item = self._start(fragment, done + self.overlap)
                if self.overlap:
                    self.pending.append(item)
                else:
                    self._finish(item)
        return time.perf_counter() - started

    def settle(self) -> None:
        """Wait for and apply every exchange still on the wire (before the whole model is read)."""
        for item in self.pending:
            self._finish(item)
        self.pending.clear()

    # -- one fragment ------------------------------------------------------------------------------------

    def _tensors(self, fragment: int) -> list[torch.Tensor]:
        every = self.params
        params = [every[i] for i in self.groups[fragment]]
        if fragment == 0:  # the floating-point buffers meet with fragment 0
            params += [local(b) for b in self.diloco.module.buffers() if b.is_floating_point()]
        return params

    def _start(self, fragment: int, due: int) -> _Pending:
        topo, traffic = self.diloco.topology, self.diloco.traffic
        replicas, n = self.diloco._replicas()  # this rank's shards meet those of the same coordinate
        tensors = self._tensors(fragment)
        if not topo.distributed or n < 2:
            return _Pending(fragment, due, [], [])
        work, flats = [], []
        if not self.bits:  # the parameters themselves, summed (plain DiLoCo's exchange)
            for group in _by_dtype(tensors).values():
                flat = _flatten_dense_tensors([t.detach() for t in group])
                work.append(dist.all_reduce(flat, group=replicas, async_op=True))
                traffic.all_reduce(flat.numel() * flat.element_size(), n)
                flats.append(flat)
            return _Pending(fragment, due, work, flats)
        every = self.params
        params = [every[i] for i in self.groups[fragment]]
        anchors = [self.diloco._anchor[i] for i in self.groups[fragment]]
        delta = _flatten_dense_tensors([(a - p.detach()).float() for a, p in zip(anchors, params)])
        if self.error_feedback:
            delta += self.errors.get(fragment, torch.zeros_like(delta))
        payload = quantize(delta, self.bits)
        if self.error_feedback:
            self.errors[fragment] = delta - dequantize(payload, delta.numel(), self.bits)
        gathered = [torch.empty_like(payload) for _ in range(n)]
        work.append(dist.all_gather(gathered, payload, group=replicas, async_op=True))
        traffic.add((n - 1) * payload.numel(), (n - 1) * payload.numel())  # ring all-gather
        buffers = tensors[len(params):]
        for group in _by_dtype(buffers).values():  # BatchNorm statistics: averaged whole, as plain DiLoCo
            flat = _flatten_dense_tensors([t.detach() for t in group])
            work.append(dist.all_reduce(flat, group=replicas, async_op=True))
            traffic.all_reduce(flat.numel() * flat.element_size(), n)
            flats.append(flat)
        return _Pending(fragment, due, work, [delta, *gathered, *flats])

    def _finish(self, item: _Pending) -> None:
        diloco, topo = self.diloco, self.diloco.topology
        for handle in item.work:
            handle.wait()
        index = self.groups[item.fragment]
        every = self.params
        params = [every[i] for i in index]
        anchors = [diloco._anchor[i] for i in index]
        tensors = self._tensors(item.fragment)
        n = diloco._replicas()[1]
        met = topo.distributed and n > 1
        with torch.no_grad():
            mine = [p.detach().clone() for p in params] if self.overlap else None
            if not self.bits:
                if met:  # the average into the parameters and buffers, as plain DiLoCo
                    for group, flat in zip(_by_dtype(tensors).values(), item.flats):
                        flat.div_(n)
                        for t, value in zip(group, _unflatten_dense_tensors(flat, group)):
                            t.data.copy_(value)
                for anchor, averaged in zip(anchors, params):
                    anchor.grad = anchor - averaged
            else:
                delta, gathered, flats = item.flats[0], item.flats[1:1 + n], item.flats[1 + n:]
                total = torch.zeros_like(delta)
                for data in (gathered if met else []):
                    total += dequantize(data, delta.numel(), self.bits)
                mean = total / n if met else dequantize(quantize(delta, self.bits), delta.numel(),
                                                                     self.bits)
                for anchor, grad in zip(anchors, _unflatten_dense_tensors(mean, anchors)):
                    anchor.grad = grad.to(anchor.dtype)
                buffers = tensors[len(params):]
                for group, flat in zip(_by_dtype(buffers).values(), flats):
                    flat.div_(n)
                    for t, value in zip(group, _unflatten_dense_tensors(flat, group)):
                        t.data.copy_(value)
            assert diloco.outer is not None
            diloco.outer.step()  # only the anchors with a gradient move (SGD skips the others)
            for k, (anchor, param) in enumerate(zip(anchors, params)):
                if mine is None:
                    param.data.copy_(anchor)
                else:
                    param.data.copy_(self.mix * mine[k] + (1 - self.mix) * anchor)
                anchor.grad = None

    # -- checkpoints -------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {"errors": {k: v.clone() for k, v in self.errors.items()}}

    def load(self, state: dict[str, Any] | None) -> None:
        if state:
            self.errors = {int(k): v.clone() for k, v in state.get("errors", {}).items()}


def _by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups
