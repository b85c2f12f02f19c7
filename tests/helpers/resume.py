"""Resuming a run in real workers and reading back what the strategy holds before its first step."""

from __future__ import annotations

import copy
from typing import Any

import torch

from polytrain.train.trainer import Trainer


def resume_and_read_back(ctx: Any, config: Any) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Run ``config`` (with ``resume``) in this worker: (the checkpoint contents the strategy and session
    give at the resume point, before any step, on the trainers' rank 0, else None; the run's summary)."""
    trainer = Trainer(config, ctx.topology)
    held = trainer.session.state_dict(trainer.session.start_step) if trainer.strategy.own_loop is None else None
    held = copy.deepcopy(held)  # state dicts share the live tensors, which the run then changes
    return held, trainer.fit()


def assert_same_state(held: dict[str, Any], saved: dict[str, Any]) -> None:
    """Model and optimizer state bit for bit equal (tensors, and every other value)."""
    assert held["model"].keys() == saved["model"].keys()
    for name, value in saved["model"].items():
        assert held["model"][name].dtype == value.dtype and torch.equal(held["model"][name], value), name
    ours, theirs = held["optimizer"], saved["optimizer"]
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys()
    for index, state in theirs["state"].items():
        assert ours["state"][index].keys() == state.keys(), index
        for key, value in state.items():
            mine = ours["state"][index][key]
            assert torch.is_tensor(mine) == torch.is_tensor(value), (index, key)
            assert (mine.dtype == value.dtype and torch.equal(mine, value)) if torch.is_tensor(value) \
                else mine == value, (index, key)
