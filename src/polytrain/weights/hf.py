"""``--model hf:DIR``: a Hugging Face causal language model built from the directory's ``config.json``, on the
meta device like polytrain's own models, its weights the directory's ``*.safetensors`` (read as ``--init-from
DIR`` reads them: each rank only what it holds). ``transformers`` stays an optional extra (``interop``).

The model gets an ``init_unit(name, unit)`` made of transformers' own ``_init_weights`` for each module of the
unit, so that it is built unit by unit and each rank makes only its part, and a directory with a config but no
weights is a model initialised from ``--seed`` (rotary ``inv_freq`` and the other non-persistent buffers are
computed by ``_init_weights`` as ``from_pretrained`` computes them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from torch import nn

from polytrain.errors import ConfigError

PREFIX = "hf:"
EXTRA = "pip install 'polytrain[interop]'"


def is_hf_spec(spec: str) -> bool:
    return spec.startswith(PREFIX)


def hf_directory(spec: str) -> Path:
    """The directory ``hf:DIR`` names, checked: it exists and holds ``config.json``."""
    directory = Path(spec[len(PREFIX):]).expanduser()
    if not spec[len(PREFIX):]:
        raise ConfigError("--model hf:DIR: give the Hugging Face model directory (config.json and its "
                          "*.safetensors), e.g. --model hf:models/tiny-llama")
    if not directory.is_dir():
        raise ConfigError(f"--model {spec}: {directory} is not a directory; give a Hugging Face model directory "
                          "(config.json and its *.safetensors, as save_pretrained writes it)")
    if not (directory / "config.json").is_file():
        raise ConfigError(f"--model {spec}: {directory} has no config.json; give a directory save_pretrained wrote "
                          "(or save the model's config there: config.save_pretrained(DIR))")
    return directory


def hf_modules(spec: str) -> list[str]:
    """The transformers modules that build ``hf:DIR``'s model (its architecture's ``modeling_*`` module by the
    config's ``model_type``), for a worker to import before its ``--memory-limit`` counts (their data is
    library code, as torch's is); [] where the config does not say."""
    import json

    try:
        kind = json.loads((Path(spec[len(PREFIX):]).expanduser() / "config.json").read_text())["model_type"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    kind = str(kind).replace("-", "_")
    return ["transformers", "transformers.modeling_utils", f"transformers.models.{kind}.modeling_{kind}"]


def transformers_module() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"--model hf:DIR needs the transformers package: {EXTRA}") from None
    return transformers


def has_weights(directory: Path) -> bool:
    return any(directory.glob("*.safetensors"))


def hf_factory(spec: str) -> Callable[[], nn.Module]:
    """The factory of ``--model hf:DIR`` (it takes no --model-arg: the config says everything)."""
    directory = hf_directory(spec)
    transformers_module()

    def hf_model() -> nn.Module:
        transformers = transformers_module()
        try:
            config = transformers.AutoConfig.from_pretrained(str(directory))
            model = transformers.AutoModelForCausalLM.from_config(config)
        except (ValueError, KeyError, OSError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ConfigError(f"--model {spec}: transformers cannot build a causal language model from its "
                              f"config.json ({first})") from None
        return with_init_unit(model)

    return hf_model


def with_init_unit(model: nn.Module) -> nn.Module:
    """``model`` (a transformers ``PreTrainedModel``) with ``init_unit``: transformers' ``_init_weights`` on
    each module of the unit, drawing from torch's default generator (seeded per unit by polytrain)."""
    init = getattr(model, "_init_weights", None)
    if not callable(init) or callable(getattr(model, "init_unit", None)):
        return model

    def init_unit(name: str, unit: nn.Module) -> None:
        for module in unit.modules():
            init(module)

    model.init_unit = init_unit
    return model
