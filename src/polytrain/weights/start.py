"""The weights a run starts from: ``--init-from PATH``, or the weights of ``--model hf:DIR``'s directory, checked
before anything starts and opened in every worker (which reads only what it holds: :mod:`.fill`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from polytrain.models.probe import build_on_meta
from polytrain.weights.fill import check_fits, fill
from polytrain.weights.hf import has_weights, hf_directory, hf_factory, is_hf_spec
from polytrain.weights.opening import open_weights
from polytrain.weights.sources import Source


def weights_path(config: Any) -> tuple[str, str] | None:
    """(the path, how the run names it) of the weights a run starts from: ``--init-from PATH``, else the
    directory of ``--model hf:DIR`` when it holds weights; None: the model's own (its factory's, or the seed's)."""
    if config.model.init_from:
        return config.model.init_from, f"--init-from {config.model.init_from}"
    spec = config.model.model
    if is_hf_spec(spec) and has_weights(hf_directory(spec)):
        return str(hf_directory(spec)), f"--model {spec}"
    return None


def weights_to_load(config: Any) -> Source | None:
    """The weights to start from, opened (headers only: nothing is read until a rank fills what it holds)."""
    found = weights_path(config)
    return open_weights(found[0], where=found[1]) if found is not None else None


def check_weights(config: Any) -> None:
    """Before any worker starts: ``--model hf:DIR`` names a directory transformers can read, and the weights to
    start from can be opened (exist, hold safetensors or a state_dict). One ConfigError line each. Whether they
    fit the model is checked here for ``hf:DIR`` (its config gives every shape), else where the model is built
    (its shapes may come from the data)."""
    model = None
    if is_hf_spec(config.model.model):  # built on the meta device here (no memory): the config is all it needs
        model, _ = build_on_meta(hf_factory(config.model.model))
    source = weights_to_load(config)
    if source is not None:
        if model is not None:
            check_fits(model, source)
        source.close()


def given_model(model: nn.Module, source: Source | None) -> tuple[nn.Module, str]:
    """A module handed to ``fit`` and where its weights come from: its own, or ``source``'s filled into it."""
    if source is None:
        return model, "weights of the module given"
    check_fits(model, source)
    fill(model, source)
    return model, f"weights from {source.where}"
