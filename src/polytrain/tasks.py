"""What a model's outputs are scored against: the loss, the accuracy and the units they are averaged over.

Every task answers the same questions, so a training step and an evaluation need no task-specific code:

- ``loss(outputs, targets)``: the mean loss over the batch's *units* (the tensor to backpropagate);
- ``units(targets)``: how many units the batch holds: examples for ``classification``/``binary``, real
  (non-padding) target tokens for ``lm``. Slices of a global batch holding different numbers of units
  are weighted by them, so that the mean over the whole batch is what every strategy minimises;
- ``score(outputs, targets)``: (summed loss, correct count, units) as tensors, for evaluation;
- ``metrics(mean_loss, accuracy)``: the task's extra metrics (``perplexity`` for ``lm``);
- ``model_kwargs(inputs)``: keyword arguments the model's forward gets besides the inputs (packed documents'
  ``position_ids``, see :class:`PackedLanguageModelTask`; none otherwise);
- ``model_labels(inputs, targets)``, ``model_units(labels)``, ``model_global_units(units, examples)``: with
  ``--loss model``, what polytrain passes a model as ``labels=`` and the units the model's own loss averages
  over, in a micro-batch and in the whole global batch (see :class:`LanguageModelTask` for ``lm``).

``outputs`` may be a tensor or a model's output object with ``.logits`` (the Hugging Face convention,
see :func:`outputs_of`); :func:`model_loss_of` takes a model's own ``.loss`` instead (``--loss model``).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

from polytrain.data.tokens import IGNORE_INDEX
from polytrain.errors import ConfigError

__all__ = ["IGNORE_INDEX", "LOSSES", "TASKS", "ExampleTask", "LanguageModelTask", "Score", "Task",
           "check_takes_labels", "get_task", "model_loss_of", "outputs_of"]

#: ``--loss``: the task's loss on the model's logits, or the model's own ``.loss``
LOSSES = ("task", "model")


class Score(NamedTuple):
    """One evaluation batch: summed loss, correct predictions and units (examples or real tokens)."""

    loss_sum: torch.Tensor
    correct: torch.Tensor
    units: torch.Tensor


def _field(output: Any, name: str) -> Any:
    # Hugging Face's ModelOutput is both a Mapping and an object with attributes; plain dicts only the former
    return output.get(name) if isinstance(output, Mapping) else getattr(output, name, None)


def outputs_of(model_output: Any) -> torch.Tensor:
    """The logits in what a model returned: a tensor itself, or the ``.logits`` of an output object/dict."""
    if isinstance(model_output, torch.Tensor):
        return model_output
    logits = _field(model_output, "logits")
    if isinstance(logits, torch.Tensor):
        return logits
    raise ConfigError(f"the model returned {type(model_output).__name__}, not a tensor or an object with "
                      ".logits; make its forward return the logits (or an output with .logits)")


def model_loss_of(model_output: Any) -> torch.Tensor:
    """The model's own loss (``--loss model``): ``.loss`` of an output object/dict."""
    loss = None if isinstance(model_output, torch.Tensor) else _field(model_output, "loss")
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(f"--loss model: the model returned no loss given labels= ({type(model_output).__name__} "
                          "without a .loss tensor); use a model with its own loss (a Hugging Face ...ForCausalLM) "
                          "or --loss task")
    return loss


def check_takes_labels(model: torch.nn.Module, name: str) -> None:
    """``--loss model`` calls ``model(inputs, labels=...)``: one ConfigError line, before training, if the
    model's forward cannot take ``labels`` (whether it then returns a loss shows only at the first step)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a C extension): let the first step tell
        return
    if not any(p.name == "labels" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        raise ConfigError(f"--loss model: the forward of --model {name} takes no labels= argument, so it cannot "
                          "compute its own loss; use --loss task (the task's loss on its outputs)")


class Task:
    """The interface; see the module docstring."""

    name: str

    def loss(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def units(self, targets: torch.Tensor) -> int:
        return targets.shape[0]

    def score(self, outputs: Any, targets: torch.Tensor) -> Score:
        raise NotImplementedError

    def metrics(self, mean_loss: float, accuracy: float | None) -> dict[str, float]:
        """Metrics beyond loss and accuracy, from their means over an evaluation."""
        return {}

    def model_kwargs(self, inputs: torch.Tensor) -> dict[str, Any]:
        """Keyword arguments of the model's forward besides ``inputs``."""
        return {}

    # --loss model: the model computes its loss from labels=, the Hugging Face convention

    def model_labels(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """What polytrain passes as ``labels=``; one label per example by default: the targets."""
        return targets

    def model_units(self, labels: torch.Tensor) -> int:
        """The units the model's own loss averages over, for these labels."""
        return len(labels)

    def model_global_units(self, global_units: int, global_examples: int) -> int:
        """The same units in a whole global batch of ``global_units`` task units and ``global_examples``."""
        return global_units


@dataclass(frozen=True)
class ExampleTask(Task):
    """One prediction per example (classification, binary): the unit is the example."""

    name: str
    loss_fn: Callable[..., torch.Tensor]
    predict: Callable[[torch.Tensor], torch.Tensor]
    prepare_targets: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def loss(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        outputs = outputs_of(outputs)
        return self.loss_fn(outputs, self.prepare_targets(outputs, targets))

    @torch.no_grad()
    def score(self, outputs: Any, targets: torch.Tensor) -> Score:
        outputs = outputs_of(outputs)
        prepared = self.prepare_targets(outputs, targets)
        summed = self.loss_fn(outputs, prepared, reduction="sum")
        predicted = self.predict(outputs)
        correct = (predicted == prepared.view_as(predicted)).sum()
        return Score(summed, correct, torch.tensor(len(targets), device=outputs.device))


class LanguageModelTask(Task):
    """Next-token prediction: outputs (batch, time, vocab), targets (batch, time) with IGNORE_INDEX (-100)
    at padded positions, which count nowhere: not in the loss, the accuracy, nor the units (tokens)."""

    name = "lm"

    @staticmethod
    def _flat(outputs: Any, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = outputs_of(outputs)
        if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(targets.shape):
            raise ConfigError(f"task lm: the model's outputs have shape {tuple(logits.shape)} for targets of shape "
                              f"{tuple(targets.shape)}; a language model returns (batch, time, vocabulary)")
        targets = targets.to(logits.device, torch.long, non_blocking=True)
        return logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)

    def loss(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        # the mean over real tokens (cross_entropy divides by the non-ignored count); a batch with none would
        # be NaN, which the data never makes: every sequence has at least one real target token
        logits, flat = self._flat(outputs, targets)
        return F.cross_entropy(logits, flat, ignore_index=IGNORE_INDEX)

    def units(self, targets: torch.Tensor) -> int:
        return int((targets != IGNORE_INDEX).sum())

    @torch.no_grad()
    def score(self, outputs: Any, targets: torch.Tensor) -> Score:
        logits, flat = self._flat(outputs, targets)
        summed = F.cross_entropy(logits, flat, ignore_index=IGNORE_INDEX, reduction="sum")
        real = flat != IGNORE_INDEX
        correct = ((logits.argmax(dim=-1) == flat) & real).sum()
        return Score(summed, correct, real.sum())

    # --loss model. A Hugging Face causal LM takes labels aligned with its inputs and shifts them itself
    # (position t is scored against labels[t + 1]); our targets are already the next tokens. So the labels
    # are the inputs, with IGNORE_INDEX at padded positions (where the target is IGNORE_INDEX: padding only
    # follows a sequence's real tokens). The model then scores every real target but each sequence's last
    # one, which no label to its right holds: a sequence of n real targets counts n - 1 units.

    def model_labels(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return inputs.to(torch.long).masked_fill(targets == IGNORE_INDEX, IGNORE_INDEX)

    def model_units(self, labels: torch.Tensor) -> int:
        return int((labels[:, 1:] != IGNORE_INDEX).sum())

    def model_global_units(self, global_units: int, global_examples: int) -> int:
        return global_units - global_examples  # every sequence has at least one real target

    def metrics(self, mean_loss: float, accuracy: float | None) -> dict[str, float]:
        # exp overflows a float past ~709; a perplexity that large means "no better than chance" anyway
        return {"perplexity": math.exp(mean_loss) if mean_loss < 700 else math.inf}


class PackedLanguageModelTask(LanguageModelTask):
    """Next-token prediction on packed documents (``--pack``): the model is given ``position_ids`` that restart
    at 0 after each ``document_end`` token of its inputs, by which it keeps attention within each document
    (``transformer_lm``'s block-diagonal mask; a Hugging Face model's packed format, with ``use_cache=False``
    where it takes one, since a cache makes it ignore the packing). The data already ignores the targets
    that would cross a document boundary."""

    def __init__(self, document_end: int, extra: dict[str, Any] | None = None):
        self.document_end, self.extra = document_end, dict(extra or {})

    def model_kwargs(self, inputs: torch.Tensor) -> dict[str, Any]:
        from polytrain.data.spans import document_positions

        return {"position_ids": document_positions(inputs, self.document_end), **self.extra}


def packed_task(document_end: int, model: torch.nn.Module, name: str) -> PackedLanguageModelTask:
    """The task of packed documents for ``model``; one ConfigError line if its forward takes no position ids."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    if "position_ids" not in params:
        raise ConfigError(f"--pack: the forward of --model {name} takes no position_ids=, so it cannot keep each "
                          "packed document to itself; use a model that takes them (transformer_lm, a "
                          "Hugging Face causal LM), or leave out --pack (each document its own padded sequence)")
    return PackedLanguageModelTask(document_end, {"use_cache": False} if "use_cache" in params else None)


def _classification_targets(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return targets.to(outputs.device, torch.long, non_blocking=True)


def _binary_targets(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return targets.to(outputs.device, outputs.dtype, non_blocking=True).view_as(outputs)


TASKS: dict[str, Task] = {
    "classification": ExampleTask("classification", F.cross_entropy, lambda out: out.argmax(dim=-1),
                                  _classification_targets),
    "binary": ExampleTask("binary", F.binary_cross_entropy_with_logits, lambda out: (out > 0).to(out.dtype),
                          _binary_targets),
    "lm": LanguageModelTask(),
}


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ConfigError(f"unknown task '{name}'; accepted: {', '.join(TASKS)}") from None
