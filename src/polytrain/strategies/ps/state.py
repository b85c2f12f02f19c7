"""Optimizer state between the servers' pieces and ``single``'s ``torch.optim`` state_dict.

A server's optimizer sees one 1-D parameter per piece of its partition (see :mod:`.server`), so its state
is per piece. A checkpoint holds the state as ``single`` saves it: ``{"state": {i: {key: tensor}},
"param_groups": [...]}`` with ``i`` the model parameter's index. :class:`StateFormat` says which keys the
optimizer keeps: *tensor* keys hold one value per element (SGD's ``momentum_buffer``, Adam's ``exp_avg``
and ``exp_avg_sq``), *scalar* keys one value per parameter (Adam's ``step``). It is found by stepping the
same optimizer once on a throwaway parameter, on both sides, so the wire carries no key names: a server
sends, per tensor key, one flat buffer laid out like its values, and per scalar key one float64 value per
piece. Pieces of one parameter on several servers hold equal scalars (every server steps every piece on
every push), so the first piece's value stands for the parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from polytrain.errors import ConfigError
from polytrain.strategies.ps.partition import PartitionPlan

MakeOptimizer = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class StateFormat:
    tensors: tuple[str, ...]  # keys holding a tensor shaped like the parameter
    scalars: tuple[tuple[str, torch.dtype], ...]  # keys holding a 0-d tensor, with its dtype

    @classmethod
    def probe(cls, make_optimizer: MakeOptimizer, dtype: torch.dtype = torch.float32) -> "StateFormat":
        """The keys ``make_optimizer``'s optimizer keeps, from one step on a throwaway parameter."""
        param = nn.Parameter(torch.zeros(3, dtype=dtype))
        param.grad = torch.zeros_like(param)
        optimizer = make_optimizer([param])
        optimizer.step()
        tensors, scalars = [], []
        for key, value in sorted(optimizer.state[param].items()):
            if isinstance(value, torch.Tensor) and value.shape == param.shape:
                tensors.append(key)
            elif isinstance(value, torch.Tensor) and value.dim() == 0:
                scalars.append((key, value.dtype))
            elif value is not None:  # e.g. a Python number: nothing here knows how to split or gather it
                raise ConfigError(f"--strategy async: the optimizer's state '{key}' ({type(value).__name__}) "
                                  "cannot be kept on parameter servers; use one of --optimizer's choices (sgd, "
                                  "adam, adamw, rmsprop, adagrad)")
        return cls(tuple(tensors), tuple(scalars))

    @property
    def empty(self) -> bool:
        return not self.tensors and not self.scalars

    def sizes(self, plan: PartitionPlan, server: int) -> list[int]:
        """The element count of each tensor a server sends: its buffer per tensor key, one per piece per scalar."""
        return [plan.numel(server)] * len(self.tensors) + [len(plan.pieces_of(server))] * len(self.scalars)

    # -- on a server ----------------------------------------------------------------------------------

    def pack(self, optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter]) -> list[torch.Tensor] | None:
        """A server's state as flat tensors (None before its first update: no state yet)."""
        state = optimizer.state
        if not params or not all(all(k in state[p] for k in self.tensors) for p in params):
            return None
        out = [torch.cat([state[p][k].detach().reshape(-1) for p in params]) for k in self.tensors]
        out += [torch.tensor([float(state[p][k]) for p in params], dtype=torch.float64) for k, _ in self.scalars]
        return out

    def unpack(self, optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter],
               flat: Sequence[torch.Tensor]) -> None:
        """Load what :meth:`pack` made (or :meth:`from_single` cut) into a server's optimizer."""
        state: dict[int, dict[str, torch.Tensor]] = {}
        offset = 0
        for i, param in enumerate(params):
            entry = {k: flat[j][offset:offset + param.numel()].clone() for j, k in enumerate(self.tensors)}
            for j, (key, dtype) in enumerate(self.scalars):
                entry[key] = torch.tensor(flat[len(self.tensors) + j][i].item(), dtype=dtype)
            state[i] = entry
            offset += param.numel()
        groups = optimizer.state_dict()["param_groups"]
        optimizer.load_state_dict({"state": state, "param_groups": groups})

    # -- on the trainers' rank 0 ----------------------------------------------------------------------

    def to_single(self, plan: PartitionPlan, per_server: Sequence[Sequence[torch.Tensor] | None],
                  params: Mapping[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
        """The servers' state as ``single``'s ``state_dict()["state"]`` (keyed by parameter index); empty
        when no server holds any state yet."""
        if self.empty or any(flat is None for flat in per_server):
            return {}
        whole = {k: {n: torch.zeros(p.shape, dtype=p.dtype) for n, p in params.items()} for k in self.tensors}
        firsts: dict[str, dict[str, float]] = {k: {} for k, _ in self.scalars}
        for s, flat in enumerate(per_server):
            for j, key in enumerate(self.tensors):
                plan.unflatten(flat[j], s, whole[key])
            for i, piece in enumerate(plan.pieces_of(s)):
                for j, (key, _) in enumerate(self.scalars):
                    if piece.start == 0:
                        firsts[key][piece.name] = flat[len(self.tensors) + j][i].item()
        out = {}
        for index, name in enumerate(params):
            entry = {k: whole[k][name] for k in self.tensors}
            entry.update({k: torch.tensor(firsts[k][name], dtype=dtype) for k, dtype in self.scalars})
            out[index] = entry
        return out

    def from_single(self, plan: PartitionPlan, state: Mapping[int, Mapping[str, Any]],
                    params: Mapping[str, torch.Tensor]) -> list[list[torch.Tensor]] | None:
        """``single``'s ``state_dict()["state"]`` cut into each server's flat tensors (None: no state)."""
        if self.empty or not state:
            return None
        names = list(params)
        missing = [names[i] for i in range(len(names))
                   if i not in state or any(k not in state[i] for k in self.tensors)
                   or any(k not in state[i] for k, _ in self.scalars)]
        if missing:
            raise ConfigError(f"--resume: the checkpoint's optimizer state lacks parameter(s) "
                              f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}; async restores "
                              "the state of every parameter or none")
        out = []
        for s in range(plan.servers):
            flat = [plan.flatten({n: state[i][k].detach().cpu().to(params[n].dtype) for i, n in enumerate(names)}, s)
                    for k in self.tensors]
            pieces = plan.pieces_of(s)
            flat += [torch.tensor([float(state[names.index(p.name)][k]) for p in pieces], dtype=torch.float64)
                     for k, _ in self.scalars]
            out.append(flat)
        return out
