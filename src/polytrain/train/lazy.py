"""A checkpoint read as each rank holds the model: its files verified (size and SHA-256 against the manifest, as
``--resume`` verifies them), mapped rather than loaded, and never put together. The model and the optimizer's
per-parameter state are :class:`~polytrain.weights.sources.Source` objects: a rank reads the rows (or any block)
of the tensors it holds, from one file written by any strategy or from the parts a sharded run wrote at any
world size. What else a checkpoint holds (step, data position, RNG states, config) is small and copied out.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from polytrain.errors import ConfigError
from polytrain.train.integrity import Signature, Verdict
from polytrain.weights.sources import MappedSource, PartsSource, Source

TENSOR = object()  # optimizer_state's mark of a tensor to read by region
_TENSORS = ("model", "optimizer", "sharded", "outer")  # (outer: diloco's anchor, a whole model)


@dataclass
class LazyCheckpoint:
    path: Path
    #: everything but the model and optimizer tensors (step, data position, rng, config, ...), copied out
    run: dict[str, Any]
    model: Source
    #: the optimizer's per-parameter tensors, named ``INDEX/KEY`` (single's parameter indices)
    optimizer: Source
    #: the optimizer's per-parameter values that are not tensors (a step count kept as a number), by (INDEX, KEY)
    optimizer_values: dict[tuple[int, str], Any]
    param_groups: list[dict[str, Any]]
    #: :meth:`optimizer_state`'s mark of a tensor to read by region
    TENSOR: ClassVar[object] = TENSOR

    def __post_init__(self) -> None:
        self._keys: dict[int, list[str]] = {}
        for name in self.optimizer.tensors():
            index, key = name.split("/", 1)
            self._keys.setdefault(int(index), []).append(key)

    def optimizer_state(self, index: int) -> dict[str, Any]:
        """The keys parameter ``index`` has state for: ``{key: TENSOR}`` for a tensor (read it by region from
        :attr:`optimizer` as ``INDEX/KEY``), the value itself otherwise."""
        keys: dict[str, Any] = {key: TENSOR for key in self._keys.get(index, [])}
        keys.update({k: v for (i, k), v in self.optimizer_values.items() if i == index})
        return keys


def open_checkpoint(directory: str | Path, where: str, expected: Signature | None = None) -> LazyCheckpoint:
    """The newest good checkpoint in ``directory`` (checked against the model ``expected``, if given), mapped;
    one ConfigError line (named by ``where``) when there is none that can be used."""
    from polytrain.train.checkpoint import Checkpointer, warn_choice
    from polytrain.log import get_logger

    checkpointer = Checkpointer(directory)
    choice = checkpointer.choose(expected, lazy=True)
    if choice.good is None:
        if choice.rejected:
            raise ConfigError(f"{where}: {choice.no_good_message(checkpointer.directory)}")
        raise ConfigError(f"{where}: no checkpoint in this directory (no step-NNNNNNNN.pt file)")
    warn_choice(choice, get_logger().warning, f"{where}: ")
    return lazy_checkpoint(choice.good, where)


def open_verified(path: str | Path) -> LazyCheckpoint:
    """A checkpoint file that another rank has verified (``--resume``: the trainers' rank 0): mapped, its parts
    mapped, nothing hashed again."""
    from polytrain.weights.sources import load_mapped

    path = Path(path)
    state = load_mapped(path)
    parts = [load_mapped(path.with_name(str(f))) for f in state["sharded"]["files"]] if "sharded" in state else None
    return lazy_checkpoint(Verdict(path, state=state, parts=parts))


def lazy_checkpoint(verdict: Verdict, where: str | None = None) -> LazyCheckpoint:
    """A verified checkpoint (``verify(..., lazy=True)``) as sources to read by region."""
    state = verdict.state
    assert state is not None
    where = where or str(verdict.path)
    run = {key: _copied(value) for key, value in state.items() if key not in _TENSORS}
    if verdict.parts is not None:
        info = state["sharded"]
        shapes = {name: (tuple(shape), getattr(torch, dtype)) for name, shape, dtype in info["model"]}
        model: dict[str, list[Any]] = {}
        optimizer: dict[str, list[Any]] = {}
        values: dict[tuple[int, str], Any] = {}
        for part in verdict.parts:
            for name, piece in part["model"].items():
                model.setdefault(name, []).append(piece)
            for index, per in part["optimizer"].items():
                for key, piece in per.items():
                    if torch.is_tensor(piece[1]):
                        optimizer.setdefault(f"{int(index)}/{key}", []).append(piece)
                    else:
                        values[(int(index), key)] = piece[1]
        return LazyCheckpoint(verdict.path, run, PartsSource(model, shapes, where), PartsSource(optimizer, {}, where),
                              values, list(info["param_groups"]))
    saved = state.get("optimizer") or {"state": {}, "param_groups": []}
    tensors = {f"{int(i)}/{k}": v for i, per in saved["state"].items() for k, v in per.items() if torch.is_tensor(v)}
    values = {(int(i), k): v for i, per in saved["state"].items() for k, v in per.items() if not torch.is_tensor(v)}
    return LazyCheckpoint(verdict.path, run, MappedSource(state.get("model") or {}, where),
                          MappedSource(tensors, where), values, _copied(saved["param_groups"]))


def _copied(value: Any) -> Any:
    """``value`` with every tensor copied out of the file's mapping (nothing may write into a checkpoint)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copied(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_copied(v) for v in value)
    return value
