"""A user's data checked in the launching process, before any worker starts.

A data factory (``--data package.module:factory``) or a :class:`~polytrain.data.DataBundle` given from Python is
sampled and checked against itself and against the model, so that a mistake in it is one line (a
:class:`~polytrain.errors.DataError`, exit 2) instead of a traceback from every worker at the first step or, worse,
at the first evaluation:

- both sets are datasets whose lengths are ints, the test set not empty (None: no evaluation);
- a sample of each (its first and last example, gathered as training gathers a batch) are ``(input, target)``
  pairs of one input shape and dtype;
- the targets fit the task: integer class labels for a classifier, 0./1. floats for a binary task, token ids
  (or -100, padding) for a language model;
- the model takes both sets' inputs and gives outputs the task's loss takes, in one forward on the meta device
  (shapes only, no memory, no weights); the labels fit its outputs.

Each line names the data (``--data SPEC``), the set (train/test), the example and what was expected. A model
that cannot be built or run on the meta device (one that computes with its tensors' values) is not run; the
rest is checked all the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from polytrain.data.base import DataBundle
from polytrain.data.registry import example_pair
from polytrain.data.stream import TokenStream
from polytrain.data.tokens import IGNORE_INDEX
from polytrain.errors import ConfigError, DataError
from polytrain.tasks import get_task, outputs_of


@dataclass
class _Sample:
    """Examples ``indices`` of one set, each as a tensor pair, and all of them as one batch."""

    name: str  # train | test
    indices: list[int]
    inputs: list[torch.Tensor]
    targets: list[torch.Tensor]
    batch: tuple[torch.Tensor, torch.Tensor]


def check_user_data(bundle: DataBundle, what: str, model: nn.Module | None = None, model_name: str | None = None,
                    model_args: dict[str, Any] | None = None, own_loss: bool = False) -> None:
    """One DataError line for the first thing wrong with ``bundle``; ``what`` names it (``--data SPEC``). The
    model is ``model``, else ``model_name`` (``auto``: the data's suggestion) built on the meta device;
    ``own_loss``: the model computes its own loss (``--loss model``), so the task's loss is not tried."""
    get_task(bundle.task)  # a task polytrain has
    if isinstance(bundle.train, TokenStream):  # streamed as training goes: nothing to sample before it
        return
    for name in ("train", "test"):
        _check_set(getattr(bundle, name), name, what, required=name == "train")
    samples = [_sample(getattr(bundle, name), name, what) for name in ("train", "test")
               if getattr(bundle, name) is not None]
    _check_inputs(bundle, samples, what)
    _check_targets(bundle, samples, what)
    name = model_name if model_name not in (None, "auto") else bundle.default_model
    meta = model if model is not None else _meta_model(bundle, name, model_args)
    if meta is not None:
        _check_model(bundle, meta, name if model is None else "given as a module", samples, what, own_loss)


def _check_set(dataset: Any, name: str, what: str, *, required: bool) -> None:
    if dataset is None and not required:
        return
    if not isinstance(dataset, Dataset):
        raise DataError(f"{what}: the {name} set is a {type(dataset).__name__}, not a torch.utils.data.Dataset; "
                        "return (train, test) datasets (test may be None: no evaluation)")
    try:
        length = len(dataset)
    except TypeError as exc:
        raise DataError(f"{what}: the {name} set has no length ({exc}); its __len__ must return an int") from None
    if length == 0:  # (the same line as bundle_from_datasets' for the train set)
        hint = "give it examples" if required else "give it examples, or return None as the test set (no evaluation)"
        raise DataError(f"{what}: the {name} set is empty; {hint}")


def _sample(dataset: Dataset, name: str, what: str) -> _Sample:
    indices = sorted({0, len(dataset) - 1})
    if hasattr(dataset, "get_batch"):  # in-memory data: gathered as training gathers it
        x, y = dataset.get_batch(torch.tensor(indices), 0)
        inputs, targets = list(x), list(y)
    else:
        inputs, targets = [], []
        for index in indices:
            x, y = example_pair(dataset, index, what, name)
            inputs.append(x)
            targets.append(y)
    return _Sample(name, indices, inputs, targets, (torch.stack(inputs), torch.stack(targets))
                   if _one_shape(inputs) and _one_shape(targets) else (inputs[0][None], targets[0][None]))


def _one_shape(tensors: list[torch.Tensor]) -> bool:
    return all(t.shape == tensors[0].shape and t.dtype == tensors[0].dtype for t in tensors)


def _shape(t: torch.Tensor | tuple[int, ...]) -> str:
    shape = tuple(t.shape) if isinstance(t, torch.Tensor) else tuple(t)
    return "x".join(map(str, shape)) if shape else "a scalar"


def _check_inputs(bundle: DataBundle, samples: list[_Sample], what: str) -> None:
    first = samples[0].inputs[0]
    lm = bundle.task == "lm"  # token sequences may differ in length, not in dimensions
    if not lm and tuple(first.shape) != tuple(bundle.input_shape):
        raise DataError(f"{what}: train example 0 has inputs of shape {_shape(first)}, but the data says "
                        f"input_shape {_shape(bundle.input_shape)}; make them agree")
    for sample in samples:
        for index, x in zip(sample.indices, sample.inputs):
            if (x.dim() != first.dim()) if lm else (x.shape != first.shape):
                raise DataError(f"{what}: {sample.name} example {index} has inputs of shape {_shape(x)}, but train "
                                f"example 0's are {_shape(first)}; every example of both sets needs inputs of one "
                                "shape")
            if x.dtype != first.dtype:
                raise DataError(f"{what}: {sample.name} example {index} has {x.dtype} inputs, but train example 0's "
                                f"are {first.dtype}; give both sets inputs of one dtype")
            if lm and (x.is_floating_point() or x.is_complex()):
                raise DataError(f"{what}: {sample.name} example {index} has {x.dtype} inputs; a language model "
                                "takes integer token ids")


def _check_targets(bundle: DataBundle, samples: list[_Sample], what: str) -> None:
    for sample in samples:
        for index, y in zip(sample.indices, sample.targets):
            _check_target(bundle, y, f"{what}: {sample.name} example {index}")


def _check_target(bundle: DataBundle, y: torch.Tensor, where: str) -> None:
    task, values = bundle.task, y.flatten()
    if task == "binary":
        bad = values[(values != 0) & (values != 1)]
        if len(bad):
            raise DataError(f"{where} has target {_value(bad[0])}; float targets mean a binary task, whose targets "
                            "are 0. or 1.: return integer class labels 0..N-1 for a classifier")
        return
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        kind = "class labels" if task == "classification" else "token ids"
        raise DataError(f"{where} has a {y.dtype} target ({_value(values[0]) if len(values) else 'empty'}); "
                        f"a {'classifier' if task == 'classification' else 'language model'} takes integer {kind}"
                        + (" (0./1. float targets: a binary task)" if task == "classification" else ""))
    if task == "classification" and y.dim() != 0:
        raise DataError(f"{where} has a target of shape {_shape(y)}; a classifier takes one integer label per "
                        "example")
    low = values[values != IGNORE_INDEX] if task == "lm" else values
    if len(low) and int(low.min()) < 0:
        raise DataError(f"{where} has {'label' if task == 'classification' else 'token id'} {int(low.min())}; "
                        f"{'labels' if task == 'classification' else 'token ids'} start at 0"
                        + (" (-100 marks padding)" if task == "lm" else ""))


def _value(v: torch.Tensor) -> str:
    number = v.item()
    return f"{number:.4g}" if isinstance(number, float) and math.isfinite(number) else str(number)


def _meta_model(bundle: DataBundle, name: str, args: dict[str, Any] | None) -> nn.Module | None:
    """The model ``name`` for ``bundle`` on the meta device; None where it cannot be built there."""
    from polytrain.models.registry import meta_build

    try:
        return meta_build(name, args, bundle)
    except ConfigError:
        raise  # what the workers would refuse too (cifar_cnn on flat inputs): said here, once
    except Exception:  # noqa: BLE001 - a factory that computes with its tensors: not checked on the meta device
        return None


def _check_model(bundle: DataBundle, model: nn.Module, name: str, samples: list[_Sample], what: str,
                 own_loss: bool) -> None:
    task = get_task(bundle.task)
    training = [(m, m.training) for m in model.modules()]
    model.eval()  # one example's batch must not trip batch norm's training checks
    try:
        for sample in samples:
            x, y = (t.to("meta") for t in sample.batch)
            examples = f"example{'s' if len(x) > 1 else ''} {', '.join(map(str, sample.indices[:len(x)]))}"
            try:
                with torch.no_grad():
                    out = torch.func.functional_call(model, _on_meta(model), (x,))
            except Exception as exc:  # noqa: BLE001 - the model's own words, unless meta cannot run it
                if _meta_cannot(exc):
                    return
                raise DataError(f"{what}: the model ({name}) cannot take the {sample.name} set's inputs "
                                f"({examples}, shape {_shape(sample.inputs[0])}, {sample.inputs[0].dtype}): "
                                f"{_first_line(exc)}") from None
            if own_loss:
                continue
            try:
                logits = outputs_of(out)
                task.loss(out, y)
            except Exception as exc:  # noqa: BLE001 - the loss's own words
                if _meta_cannot(exc):
                    return
                shape = _shape(logits) if isinstance(out, torch.Tensor) or hasattr(out, "logits") else "?"
                raise DataError(f"{what}: the model ({name}) gives outputs of shape {shape} for the {sample.name} "
                                f"set's targets of shape {_shape(y)} ({examples}), which the {bundle.task} loss "
                                f"cannot take: {_first_line(exc)}") from None
            _check_labels_fit(bundle, logits, sample, name, what)
    finally:
        for module, mode in training:
            module.training = mode


def _check_labels_fit(bundle: DataBundle, logits: torch.Tensor, sample: _Sample, name: str, what: str) -> None:
    if bundle.task == "binary":
        return
    width = logits.shape[-1]
    for index, y in zip(sample.indices, sample.targets):
        top = int(y.max()) if y.numel() else -1
        if top >= width:
            kind = "label" if bundle.task == "classification" else "token id"
            raise DataError(f"{what}: {sample.name} example {index} has {kind} {top}, but the model ({name}) gives "
                            f"{width} scores per {'example' if bundle.task == 'classification' else 'token'} "
                            f"(0..{width - 1}); {'labels' if kind == 'label' else 'token ids'} must be below "
                            f"{width}" + ("; pass --data-arg num_classes=N for classes the train set lacks"
                                          if kind == "label" else ""))


def _on_meta(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers as meta tensors of the same shapes (the model itself untouched)."""
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {key: t if t.is_meta else torch.empty_like(t, device="meta") for key, t in tensors.items()}


def _meta_cannot(exc: BaseException) -> bool:
    """Whether ``exc`` says the meta device cannot run the model (values asked for), not what the data is."""
    return isinstance(exc, NotImplementedError) or "meta" in str(exc).lower()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
