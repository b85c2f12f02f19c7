"""Which parameter server holds which parameters: a plan that is plain data.

The model's parameters, in their ``named_parameters()`` order, are laid end to end and cut into S
contiguous runs of nearly equal size, one per server. A tensor with at least ``min_split`` elements may be
cut between two (or more) servers; a smaller one goes whole to the server where it starts. So every server
but the last holds between ``capacity = ceil(total / S)`` and ``capacity + u - 1`` elements, where ``u`` is the
largest tensor that may not be split, and the last holds at most ``capacity``; with every tensor
splittable (``min_split=1``) no server holds more than ``capacity``.

Each server keeps its part as one flat buffer: :meth:`PartitionPlan.flatten` and
:meth:`PartitionPlan.unflatten` convert between a server's buffer and the model's tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch

from polytrain.errors import ConfigError

DEFAULT_MIN_SPLIT = 1024  # tensors smaller than this (biases, norms) are never cut


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of tensor ``name`` (flattened) live on ``server`` at ``offset`` of its buffer."""

    name: str
    server: int
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class PartitionPlan:
    tensors: tuple[TensorSpec, ...]
    servers: int
    pieces: tuple[Piece, ...]  # in model order; a server's pieces are contiguous in its buffer

    @classmethod
    def build(cls, specs: Iterable[tuple[str, Sequence[int]]], servers: int,
              min_split: int = DEFAULT_MIN_SPLIT) -> "PartitionPlan":
        tensors = tuple(TensorSpec(name, tuple(int(d) for d in shape)) for name, shape in specs)
        if servers < 1:
            raise ConfigError(f"--servers must be >= 1, got {servers}")
        if len({t.name for t in tensors}) != len(tensors):
            raise ConfigError("parameter names must be unique to partition them across servers")
        return cls(tensors, servers, tuple(_cut(tensors, servers, max(1, min_split))))

    @classmethod
    def for_model(cls, named: Iterable[tuple[str, torch.Tensor]], servers: int,
                  min_split: int = DEFAULT_MIN_SPLIT) -> "PartitionPlan":
        return cls.build(((name, tuple(p.shape)) for name, p in named), servers, min_split)

    # -- reading the plan --------------------------------------------------------------------------------

    @property
    def total(self) -> int:
        return sum(t.numel for t in self.tensors)

    def pieces_of(self, server: int) -> tuple[Piece, ...]:
        return tuple(p for p in self.pieces if p.server == server)

    def numel(self, server: int) -> int:
        return sum(p.numel for p in self.pieces_of(server))

    def loads(self) -> list[int]:
        return [self.numel(s) for s in range(self.servers)]

    def split_tensors(self) -> list[str]:
        seen: dict[str, int] = {}
        for p in self.pieces:
            seen[p.name] = seen.get(p.name, 0) + 1
        return [name for name, count in seen.items() if count > 1]

    def describe(self) -> str:
        capacity = math.ceil(self.total / self.servers)
        lines = [f"{self.total} parameters over {self.servers} server(s), ideal {capacity} each"]
        for s in range(self.servers):
            parts = ", ".join(_piece_text(p, self._spec(p.name)) for p in self.pieces_of(s)) or "nothing"
            lines.append(f"  server {s}: {self.numel(s)} ({parts})")
        return "\n".join(lines)

    # -- moving values --------------------------------------------------------------------------------

    def flatten(self, tensors: Mapping[str, torch.Tensor], server: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Server ``server``'s buffer filled from ``tensors`` (name -> tensor of the model's shape)."""
        pieces = self.pieces_of(server)
        if out is None:
            first = tensors[self.tensors[0].name]
            out = torch.empty(self.numel(server), dtype=first.dtype, device=first.device)
        for p in pieces:
            out[p.offset:p.offset + p.numel].copy_(tensors[p.name].detach().reshape(-1)[p.start:p.stop])
        return out

    def unflatten(self, flat: torch.Tensor, server: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy server ``server``'s buffer into its places in ``tensors`` (in place)."""
        with torch.no_grad():
            for p in self.pieces_of(server):
                target = tensors[p.name]
                target.view(-1)[p.start:p.stop].copy_(flat[p.offset:p.offset + p.numel])

    def check(self) -> None:
        """Every element of every tensor on exactly one server; buffers without gaps. Raises AssertionError."""
        for spec in self.tensors:
            ranges = sorted((p.start, p.stop) for p in self.pieces if p.name == spec.name)
            covered = 0
            for start, stop in ranges:
                assert start == covered and stop > start, f"{spec.name}: gap or overlap at {start}"
                covered = stop
            assert covered == spec.numel, f"{spec.name}: {covered} of {spec.numel} elements assigned"
        for s in range(self.servers):
            offset = 0
            for p in self.pieces_of(s):
                assert p.offset == offset, f"server {s}: buffer gap at {offset}"
                offset += p.numel

    def _spec(self, name: str) -> TensorSpec:
        return next(t for t in self.tensors if t.name == name)


def _cut(tensors: Sequence[TensorSpec], servers: int, min_split: int) -> list[Piece]:
    """Fill server 0 up to capacity, then server 1, ...; cut a splittable tensor at the boundary."""
    capacity = max(1, math.ceil(sum(t.numel for t in tensors) / servers))
    pieces: list[Piece] = []
    server, load = 0, 0
    for spec in tensors:
        start = 0
        while start < spec.numel or (spec.numel == 0 and start == 0):
            if load >= capacity and server < servers - 1:
                server, load = server + 1, 0
            room = capacity - load if server < servers - 1 else spec.numel - start
            take = spec.numel - start
            if spec.numel >= min_split and take > room > 0:
                take = room
            pieces.append(Piece(spec.name, server, start, start + take, load))
            start, load = start + take, load + take
            if spec.numel == 0:
                break
    return pieces


def _piece_text(piece: Piece, spec: TensorSpec) -> str:
    shape = "x".join(map(str, spec.shape)) or "scalar"
    if piece.numel == spec.numel:
        return f"{piece.name} [{shape}]"
    return f"{piece.name} [{shape}] elements {piece.start}:{piece.stop}"
