"""The whole model's state of a pipeline rank that holds only its stages: gathered from every stage into the
model's state dict and optimizer state as ``single`` saves them (checkpoints, ``--save-model``), and loaded
back, each rank taking its stages' tensors and optimizer state (a model not cut yet keeps it until its stages
are made). A mixin of :class:`~polytrain.parallel.pp.strategy.Pipeline`, which sets the attributes read here."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from polytrain.models.parts import retie
from polytrain.parallel.dtensor import full, like


class StageState:
    """``state_dict`` and ``load_state_dict`` of a rank that holds some stages of the model."""

    def _mine(self, key: str) -> bool:
        if self._owned_set is not None:  # traced: the stages' own names
            return key in self._owned_set
        return key.startswith(self._owned_keys)

    def _whole_model(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict on the trainers' rank 0 (None elsewhere): each stage's tensors
        gathered from the first replica. Collective."""
        if self.split is None:  # not cut yet: a whole model is the same on every rank; a deferred one is unmade
            if not self.trainers.is_main:
                return None
            if self._maker is None and self._replay is None:
                return self.model.state_dict()
            return dict(self._loaded["model"]) if self._loaded is not None else self._initial_state()
        whole = self.model.state_dict()
        mine = {k: full(v).detach().cpu() for k, v in whole.items() if self._mine(k)}  # (sharded: collective)
        parts = self.trainers.all_gather_object(mine if self.topology.axis_rank("dp") == 0 else {})
        if not self.trainers.is_main:
            return None
        for part in parts:
            whole.update(part)
        return retie(whole, self.model)

    def _optimizer_state(self) -> dict[str, Any]:
        """This rank's optimizer state dict (indices the whole model's): the one loaded into a deferred model
        not cut yet, which holds no state of its own."""
        assert self.optimizer is not None
        if self.split is None and (self._maker is not None or self._replay is not None) and self._loaded is not None:
            return self._loaded["optimizer"]
        state = self.optimizer.state_dict()
        if not self.sharded and self.tp == 1:  # (tp: each split tensor's state gathered whole)
            return state
        whole = {i: {k: full(v).cpu() if isinstance(v, DTensor) else v for k, v in per.items()}
                 for i, per in state["state"].items()}  # gathered over dp, in the same order on every replica
        return {**state, "state": whole}

    def state_dict(self, optimizer: bool = True) -> dict[str, Any] | None:
        model = self._whole_model()
        if not optimizer:
            return None if model is None else {"model": model}
        optimizer = self._optimizer_state()  # indices are the whole model's; each rank holds its stages'
        states = self.trainers.all_gather_object(optimizer["state"] if self.topology.axis_rank("dp") == 0 else {})
        if model is None:
            return None
        merged: dict[int, Any] = {}
        for part in states:
            merged.update(part)
        return {"model": model, "optimizer": {**optimizer, "state": dict(sorted(merged.items()))}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load the whole model's state (every rank gets all of it): a rank takes its stages' tensors and
        optimizer state; a deferred model not cut yet keeps the state until its stages are made."""
        if self.split is not None:
            self._load_own(state)
        elif self._maker is not None or self._replay is not None:
            self._loaded = state
        else:
            super().load_state_dict(state)

    def _load_own(self, state: dict[str, Any]) -> None:
        """This rank's stages' tensors and optimizer state from the whole model's ``state``."""
        assert self.optimizer is not None
        model = state["model"]
        expected = set(self.model.state_dict())
        if set(model) != expected:
            missing, unexpected = sorted(expected - set(model)), sorted(set(model) - expected)
            raise RuntimeError(f"loading the model's state: missing keys {missing}, unexpected keys {unexpected}")
        live = self.model.state_dict()
        self.model.load_state_dict({k: like(v, live[k]) for k, v in model.items() if self._mine(k)}, strict=False)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        owned = {id(p) for p in self.owned}
        mine = {i for i, p in enumerate(params) if id(p) in owned}
        optimizer = state["optimizer"]
        own = {k: {key: like(value, params[int(k)]) if torch.is_tensor(value) and key != "step" else value
                   for key, value in per.items()}
               for k, per in optimizer["state"].items() if int(k) in mine}
        self.optimizer.load_state_dict({**optimizer, "state": own})
