"""``--lora``: fine-tune LoRA adapters instead of the model's weights, with PEFT (an optional extra).

``--lora r=R[,alpha=A,targets=q_proj|v_proj,dropout=D]``: each layer whose name ends with a target (PEFT's
matching: the whole name, or its last parts after a dot) gets a low-rank adapter, ``W x + (alpha / r) B A x``
with ``A`` of rank ``r`` drawn as PEFT draws it and ``B`` zero, so training starts from the model as it came.
Without ``targets`` a transformers model gets PEFT's default for its architecture (Llama: ``q_proj|v_proj``);
any other model names its targets. The adapters are put into the model in place (PEFT's
``inject_adapter_in_model``: a target's weight becomes ``NAME.base_layer.weight``, its adapters
``NAME.lora_A.default.weight`` and ``NAME.lora_B.default.weight``) before the strategy shards or wraps it; every
other parameter is frozen, so only the adapters have gradients, are exchanged and are held by the optimizer.
Checkpoints hold the whole model (its frozen weights and the adapters) and resume as any run does.

``--save-model DIR`` writes the adapters in PEFT's format (``adapter_config.json``,
``adapter_model.safetensors``: ``PeftModel.from_pretrained(model, DIR)`` loads them); with ``--merge-lora``
also ``DIR/merged.pt``, the model's own ``state_dict`` with each adapter merged into its weight (``W + (alpha / r)
B A``, PEFT's ``merge_and_unload``), which loads into the model as it came.

Strategies: ``single``, ``sync`` and ``fsdp``; the others are refused in one line before launch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from polytrain.errors import ConfigError
from polytrain.options import option, register_section

STRATEGIES = ("single", "sync", "fsdp")
ADAPTER = "default"  # PEFT's adapter name
_CONFIG_ATTR = "_polytrain_lora"


def _check_spec(text: str | None) -> None:
    if text is not None:
        try:
            parse_lora(text)
        except ConfigError as exc:
            raise ValueError(str(exc).removeprefix("--lora: ")) from None  # (the option's check names --lora)


@register_section("lora", "LoRA adapters (PEFT)", order=26)
@dataclass
class LoraSettings:
    lora: str | None = option(None, "train LoRA adapters only (PEFT): rank R, alpha A (default 2R), the layers "
                                    "they adapt (names or last parts of names, | between; default for a "
                                    "transformers model: PEFT's for its architecture), dropout D (default 0)",
                              metavar="r=R[,alpha=A,targets=q_proj|v_proj,dropout=D]", check=_check_spec)
    merge_lora: bool = option(False, "--lora with --save-model DIR: also write DIR/merged.pt, the model's "
                                     "state_dict with the adapters merged into its weights")


@dataclass(frozen=True)
class LoraSpec:
    r: int
    alpha: float
    targets: tuple[str, ...] | None
    dropout: float = 0.0


def parse_lora(text: str) -> LoraSpec:
    """``r=8,alpha=16,targets=q_proj|v_proj,dropout=0.05``; one ConfigError line if malformed."""
    form = "give r=R[,alpha=A,targets=q_proj|v_proj,dropout=D]"
    values: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        key, sep, value = part.partition("=")
        if not sep or key not in ("r", "alpha", "targets", "dropout") or not value or key in values:
            raise ConfigError(f"--lora: {text}: '{part}' is not a setting of it; {form}")
        values[key] = value
    if "r" not in values:
        raise ConfigError(f"--lora: {text}: the rank r is missing; {form}")
    try:
        r, alpha = int(values["r"]), float(values.get("alpha", 2 * int(values["r"])))
        dropout = float(values.get("dropout", 0.0))
    except ValueError:
        raise ConfigError(f"--lora: {text}: r must be a whole number, alpha and dropout numbers; {form}") from None
    if r < 1 or alpha <= 0 or not 0 <= dropout < 1:
        raise ConfigError(f"--lora: {text}: r must be >= 1, alpha > 0 and dropout in [0, 1)")
    targets = tuple(t for t in values["targets"].split("|") if t) if "targets" in values else None
    return LoraSpec(r, alpha, targets, dropout)


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ConfigError("--lora needs PEFT, which is not installed; pip install 'polytrain[lora]' (or peft)") \
            from None
    return peft


def peft_config(spec: LoraSpec, model: nn.Module) -> Any:
    """PEFT's ``LoraConfig`` for ``spec`` on ``model``; one ConfigError line where no layer of the model is a
    target, or a target is a layer polytrain does not adapt."""
    peft = _peft()
    targets = list(spec.targets) if spec.targets else _default_targets(model)
    if not targets:
        raise ConfigError(f"--lora: which layers to adapt? give targets=NAME|NAME (the last parts of layer names, "
                          f"e.g. {', '.join(_linear_examples(model))})")
    config = peft.LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=targets)
    found = adapted(model, config)
    if not found:
        raise ConfigError(f"--lora targets={'|'.join(targets)}: no layer of the model has such a name; its layers "
                          f"are named like {', '.join(_linear_examples(model))}")
    conv = [name for name, module in found if _is_conv1d(module)]
    other = [f"{name} ({type(module).__name__})" for name, module in found
             if not isinstance(module, nn.Linear) and not _is_conv1d(module)]
    if other:
        raise ConfigError(f"--lora: {', '.join(other[:3])}: LoRA adapts nn.Linear (and transformers' Conv1D) layers "
                          "only here; name only those in targets=")
    if conv and len(conv) != len(found):
        raise ConfigError("--lora: the targets mix nn.Linear and Conv1D layers; adapt one kind at a time")
    config.fan_in_fan_out = bool(conv)  # Conv1D keeps its weight as (in, out)
    return config


def adapted(model: nn.Module, config: Any) -> list[tuple[str, nn.Module]]:
    """The layers of ``model`` that ``config``'s targets name, by PEFT's matching."""
    from peft.tuners.tuners_utils import check_target_module_exists

    return [(name, module) for name, module in model.named_modules()
            if name and check_target_module_exists(config, name)]


def _default_targets(model: nn.Module) -> list[str] | None:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is None:
        return None
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    found = DEFAULTS.get(model_type)
    return list(found) if found else None


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _linear_examples(model: nn.Module) -> list[str]:
    names = [n for n, m in model.named_modules() if n and (isinstance(m, nn.Linear) or _is_conv1d(m))]
    return names[:4] or ["(the model has no nn.Linear layer)"]


# -- before launch and in each worker -----------------------------------------------------------------


def check_lora(config: Any, model: nn.Module | None = None) -> LoraSpec | None:
    """Before launch: ``--lora`` well formed, PEFT installed, a strategy that carries it, and (where the model
    can be built on the meta device) targets that name layers of it. One ConfigError line each."""
    settings = config.lora
    if not settings.lora:
        if settings.merge_lora:
            raise ConfigError("--merge-lora merges LoRA adapters; give --lora r=R,... too, or drop --merge-lora")
        return None
    spec = parse_lora(settings.lora)
    _peft()
    if config.train.strategy not in STRATEGIES:
        raise ConfigError(f"--lora with --strategy {config.train.strategy}: LoRA adapters train under "
                          f"{', '.join(STRATEGIES)}; use one of those")
    if getattr(config.model, "init_from", None) or str(config.model.model).startswith("hf:"):
        raise ConfigError("--lora with --init-from or --model hf:DIR is not supported yet; load the weights in "
                          "a factory (from_pretrained, load_state_dict) and give --lora there")
    if settings.merge_lora and not config.train.save_model:
        raise ConfigError("--merge-lora writes the merged model with --save-model DIR; give --save-model DIR")
    if model is None and config.model.model != "auto":
        from polytrain.models.registry import meta_model

        model = meta_model(config)
    if model is not None:
        peft_config(spec, model)
    return spec


def apply_lora(model: nn.Module, text: str | None) -> nn.Module:
    """``model`` with LoRA adapters put in by PEFT, in place, only they trainable (``text``: ``--lora``; None:
    ``model`` as it is). A model still on the meta device (made by units) gets its adapters drawn as each unit
    is made, from that unit's seed."""
    if not text:
        return model
    from peft import inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    config = peft_config(parse_lora(text), model)
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name)
    init_unit = getattr(model, "init_unit", None)
    if callable(init_unit):
        def init_with_adapters(name: str, unit: nn.Module) -> None:
            init_unit(name, unit)
            for module in unit.modules():
                if isinstance(module, LoraLayer):
                    module.reset_lora_parameters(ADAPTER, True)

        model.init_unit = init_with_adapters  # (materialize calls it, the unit's seed set)
    object.__setattr__(model, _CONFIG_ATTR, config)
    return model


def lora_of(model: nn.Module) -> Any:
    """The PEFT config of the adapters put into ``model`` (None: none)."""
    return getattr(model, _CONFIG_ATTR, None)


# -- the export ------------------------------------------------------------------------------------------


def export(state: dict[str, torch.Tensor], config: Any, directory: str | Path, merge: bool) -> list[Path]:
    """Write the adapters of ``state`` (the whole model's, on one rank) into ``directory`` in PEFT's format, and
    with ``merge`` the model merged (``merged.pt``); the files written."""
    from safetensors.torch import save_file

    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"--save-model {directory}: with --lora it names a directory (the adapters in PEFT's "
                          "format); give a directory's path")
    directory.mkdir(parents=True, exist_ok=True)
    adapters = {f"base_model.model.{k.replace(f'.{ADAPTER}.', '.')}": v.contiguous()
                for k, v in state.items() if ".lora_" in k}
    save_file(adapters, str(directory / "adapter_model.safetensors"))
    config.save_pretrained(str(directory))  # adapter_config.json
    written = [directory / "adapter_config.json", directory / "adapter_model.safetensors"]
    if merge:
        from polytrain.train.files import atomic_save

        atomic_save(merged(state, config), directory / "merged.pt")
        written.append(directory / "merged.pt")
    return written


def merged(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """The model's own state dict with each adapter merged into its layer's weight, as PEFT's
    ``merge_and_unload`` does: ``W + (alpha / r) B A`` (transposed for a Conv1D's ``(in, out)`` weight)."""
    scale = float(config.lora_alpha) / int(config.r)
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        if ".base_layer." not in key:
            out[key] = value
            continue
        layer, _, leaf = key.partition(".base_layer.")
        if leaf == "weight":
            a = state[f"{layer}.lora_A.{ADAPTER}.weight"].double()
            b = state[f"{layer}.lora_B.{ADAPTER}.weight"].double()
            delta = (b @ a) * scale
            value = (value.double() + (delta.T if config.fan_in_fan_out else delta)).to(value.dtype)
        out[f"{layer}.{leaf}"] = value
    return out


def describe(model: nn.Module) -> str | None:
    """The start-up line: how many layers carry adapters and how many parameters train."""
    config = lora_of(model)
    if config is None:
        return None
    trains = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    layers = sum(1 for name, _ in model.named_modules() if name.endswith(f"lora_A.{ADAPTER}"))
    return (f"lora: r={config.r}, alpha={config.lora_alpha:g} on {layers} layers "
            f"({json.dumps(sorted(config.target_modules))}); {trains:,} of {total:,} parameters train")
