"""Reference models by name, plus user factories given as ``package.module:factory``.

A factory is called with the keyword arguments it accepts among ``input_shape`` and ``num_classes``
(taken from the data) and the user's ``--model-arg key=value`` / ``mlp:key=value`` arguments.
"""

from __future__ import annotations

import contextlib
import difflib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from torch import nn

from polytrain.errors import ConfigError
from polytrain.options import option, register_section
from polytrain.models.cifar_cnn import cifar_cnn
from polytrain.models.deferred import build_deferred, materialize_all
from polytrain.models.digits_cnn import digits_cnn
from polytrain.models.mlp import mlp
from polytrain.models.rnn_lm import rnn_lm
from polytrain.models.transformer_lm import transformer_lm
from polytrain.weights.hf import hf_factory, is_hf_spec
from polytrain.specs import call_with_accepted, check_accepted, is_import_path, load_factory, parse_spec

ModelFactory = Callable[..., nn.Module]

_MODELS: dict[str, ModelFactory] = {"cifar_cnn": cifar_cnn, "mlp": mlp, "digits_cnn": digits_cnn, "rnn_lm": rnn_lm,
                                    "transformer_lm": transformer_lm}


def register_model(name: str) -> Callable[[ModelFactory], ModelFactory]:
    """Decorator: make ``factory`` available as ``--model name``."""
    def add(factory: ModelFactory) -> ModelFactory:
        _MODELS[name] = factory
        return factory
    return add


def available_models() -> list[str]:
    return sorted(_MODELS)


def resolve_model_factory(spec: str) -> tuple[ModelFactory, dict[str, Any]]:
    """The factory a model spec names and the arguments written in the spec itself."""
    if is_hf_spec(spec):
        return hf_factory(spec), {}
    if spec in _MODELS or (":" in spec and spec.split(":", 1)[0] in _MODELS):
        parsed = parse_spec(spec, what="--model")
        if parsed.args:
            raise ConfigError(f"--model: '{spec}' has positional values; use key=value (e.g. mlp:hidden=64x32)")
        return _MODELS[parsed.name], dict(parsed.kwargs)
    if is_import_path(spec):
        return load_factory(spec, what="--model"), {}
    close = difflib.get_close_matches(spec.split(":", 1)[0], _MODELS, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise ConfigError(
        f"--model: unknown model '{spec}'{hint}; choose one of {', '.join(available_models())} "
        "or give your own factory as package.module:function"
    )


def check_model(spec: str, args: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """The factory of ``spec`` and its arguments, checked as far as can be without building the model (so
    in the launching process, before any worker starts): one ConfigError line for an unknown name or argument."""
    factory, spec_args = resolve_model_factory(spec)
    clash = set(spec_args) & set(args or {})
    if clash:
        raise ConfigError(f"--model: {', '.join(sorted(clash))} given both in '{spec}' and as --model-arg")
    kwargs = {**spec_args, **(args or {})}
    check_accepted(factory, f"--model {spec}", {**kwargs, "_input_shape": None, "_num_classes": None})
    return factory, kwargs


def build_model(spec: str, args: dict[str, Any] | None = None, *, input_shape: tuple[int, ...],
                num_classes: int, seed: int | None = None) -> nn.Module:
    """Build the model named by ``spec`` for inputs of ``input_shape`` and ``num_classes`` outputs.

    ``seed``: the model with the initial values a polytrain run of that ``--seed`` starts from, whole on the
    CPU (what a plain PyTorch loop needs to be compared with a run). A model that initialises unit by unit
    (:mod:`polytrain.models.deferred`) gets each unit's values from the seed and the unit's name; any other
    is built from torch's generator as it stands, so seed it as the run does (``torch.manual_seed(seed)``).
    Without ``seed``: built as the factory builds it, from torch's generator as it stands."""
    if seed is not None:
        def whole() -> nn.Module:
            return build_model(spec, args, input_shape=input_shape, num_classes=num_classes)

        deferred = build_deferred(whole, seed)
        return materialize_all(deferred) if deferred is not None else whole()
    factory, kwargs = check_model(spec, args)
    try:
        model = call_with_accepted(
            factory, f"--model {spec}", _input_shape=tuple(input_shape), _num_classes=num_classes, **kwargs
        )
    except ValueError as exc:
        raise ConfigError(f"--model {spec}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {spec}: the factory returned {type(model).__name__}, not a torch.nn.Module")
    return model


@register_section("model", "model", order=20)
@dataclass
class ModelConfig:
    model: str = option("auto", "model: auto (the dataset's suggestion) | cifar_cnn | mlp | digits_cnn | rnn_lm | "
                        "transformer_lm | package.module:factory | hf:DIR (a Hugging Face model directory: its "
                        "config.json, and its weights when it has them); arguments as mlp:hidden=64x32",
                        metavar="NAME")
    model_args: dict[str, Any] = option({}, "extra model argument (repeatable)", flag="--model-arg",
                                        metavar="KEY=VALUE", repeat=True)
    init_from: str | None = option(None, "start from these weights: a Hugging Face model directory (config.json "
                                         "and *.safetensors), a polytrain --checkpoint-dir (its newest good "
                                         "checkpoint) or a state_dict file (.pt, .safetensors); each rank reads only "
                                         "the tensors and rows it holds", metavar="PATH")


def model_name(config: Any, data: Any) -> str:
    """The model a run trains: ``--model``, or the data's default for ``auto``."""
    return data.default_model if config.model.model == "auto" else config.model.model


def meta_build(name: str, args: dict[str, Any] | None, data: Any) -> nn.Module:
    """The model ``name`` (with ``args``) for ``data``'s input shape and outputs, built on the meta device (no
    memory); raises what the factory raises there (one that computes with its tensors' values). torch's
    warnings about loads that do nothing on the meta device (``load_state_dict`` of a file) are not shown."""
    with _on_meta():
        return build_model(name, args, input_shape=data.input_shape, num_classes=data.num_outputs)


@contextlib.contextmanager
def _on_meta() -> Iterator[None]:
    """Build on the meta device, without torch's warnings that a load does nothing there."""
    import torch

    with torch.device("meta"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*meta parameter.*no-op")
        yield


def meta_model(config: Any, *, with_data: bool = False) -> nn.Module | None:
    """``config``'s model built on the meta device (no memory), for the checks before launch; None where the
    factory needs the data's real shape (the workers check it then). ``with_data``: such a factory (one that
    loads weights sized for the data's vocabulary, say) is built for the data's shape instead, the data built
    here for it; None still where it cannot be built on the meta device at all."""
    try:
        with _on_meta():
            return build_model(config.model.model, config.model.model_args, input_shape=(16,), num_classes=2)
    except Exception:  # noqa: BLE001 - the factory needs the data's real shape: the workers check it
        if not with_data:
            return None
    from polytrain.data.registry import data_of

    try:
        return meta_build(config.model.model, config.model.model_args, data_of(config))
    except Exception:  # noqa: BLE001 - data or a factory that needs real memory: the workers check it
        return None
