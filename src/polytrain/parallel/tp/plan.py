"""A tensor-parallel plan: which of a model's layers are split over the ``tp`` ranks, and how, as data.

A plan maps module names to a style, Megatron-style: ``colwise`` splits a ``nn.Linear``'s output features
(each rank computes its columns of the output; its input whole), ``rowwise`` its input features (each rank
takes its columns of the input, the partial outputs are summed). A colwise layer followed by a rowwise one
(attention's heads then its projection, an MLP's two layers) needs one all-reduce in forward and one in
backward. The styles are ``torch.distributed.tensor.parallel``'s ``ColwiseParallel``/``RowwiseParallel``:
the split weights are DTensors, every layer the plan does not name stays whole on every rank.

In a name, ``*`` stands for one part (``blocks.*.attn.qkv``). An entry is a style or a table::

    "blocks.*.attn.qkv" = { style = "colwise", parts = 3, heads = "heads" }
    "blocks.*.attn.proj" = "rowwise"

``parts``: the output is that many equal pieces side by side (a fused q, k, v projection: 3), each split
alike, so a rank holds its share of every piece (its heads' q, k and v), which is what the module's forward
must expect; ``heads``: the pieces split into this many attention heads (a number, or the name of an attribute
of the module's parent holding it), so the ranks must divide them.

A model's own plan is its ``tp_plan`` attribute (``transformer_lm`` has one); ``--tp-plan FILE.toml`` gives
one for any model (top-level keys or a ``[tp_plan]`` table). Printed by ``polytrain plan``; checked
against the model before anything starts (:meth:`TensorPlan.check`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from torch import nn

from polytrain.errors import ConfigError
from polytrain.models.parts import tied_groups

STYLES = ("colwise", "rowwise")


@dataclass(frozen=True)
class Rule:
    """One entry: modules named like ``pattern`` split ``style``-wise."""

    pattern: str
    style: str
    parts: int = 1
    heads: int | str | None = None
    gather: bool = False  # colwise: the output gathered whole on every rank (a vocabulary-split output layer)

    def matches(self, name: str) -> bool:
        return _regex(self.pattern).fullmatch(name) is not None

    def describe(self) -> str:
        more = (f", {self.parts} parts" if self.parts > 1 else "") + \
               (f", heads={self.heads}" if self.heads is not None else "") + (", output gathered" if self.gather else "")
        return f"{self.pattern}: {self.style}{more}"

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"style": self.style}
        if self.parts > 1:
            out["parts"] = self.parts
        if self.heads is not None:
            out["heads"] = self.heads
        if self.gather:
            out["gather"] = True
        return out


@dataclass(frozen=True)
class TensorPlan:
    rules: tuple[Rule, ...]
    source: str  # where it came from, for messages and the printout

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], source: str) -> "TensorPlan":
        """A plan from ``{name: style}`` or ``{name: {style=, parts=, heads=}}``; one ConfigError line if bad."""
        if "tp_plan" in mapping and isinstance(mapping["tp_plan"], Mapping):
            mapping = mapping["tp_plan"]
        if not mapping:
            raise ConfigError(f"{source}: the tensor-parallel plan is empty; map module names to colwise or rowwise")
        rules = []
        for pattern, entry in mapping.items():
            spec = {"style": entry} if isinstance(entry, str) else dict(entry) if isinstance(entry, Mapping) else None
            if spec is None or set(spec) - {"style", "parts", "heads", "gather"} or spec.get("style") not in STYLES:
                raise ConfigError(f"{source}: '{pattern}' = {entry!r} is not a plan entry; give \"colwise\", "
                                  "\"rowwise\" or a table {style = \"colwise\", parts = N, heads = N, gather = true}")
            parts = spec.get("parts", 1)
            if not isinstance(parts, int) or parts < 1 or (parts > 1 and spec["style"] != "colwise"):
                raise ConfigError(f"{source}: '{pattern}': parts must be a whole number >= 1, on a colwise entry")
            heads = spec.get("heads")
            if heads is not None and not isinstance(heads, (int, str)):
                raise ConfigError(f"{source}: '{pattern}': heads must be a number or an attribute name")
            gather = spec.get("gather", False)
            if not isinstance(gather, bool) or (gather and spec["style"] != "colwise"):
                raise ConfigError(f"{source}: '{pattern}': gather must be true or false, on a colwise entry")
            rules.append(Rule(str(pattern), spec["style"], parts, heads, gather))
        return cls(tuple(rules), source)

    @classmethod
    def from_file(cls, path: str) -> "TensorPlan":
        import tomllib

        try:
            with open(Path(path).expanduser(), "rb") as f:
                data = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(f"--tp-plan {path}: cannot read it ({exc.strerror or exc})") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"--tp-plan {path}: not a TOML file ({exc})") from None
        return cls.from_mapping(data, f"--tp-plan {path}")

    # -- against a model -----------------------------------------------------------------------------

    def resolve(self, model: nn.Module) -> list[tuple[str, Rule, nn.Module]]:
        """Each module of ``model`` a rule names, in the model's order (the first matching rule wins)."""
        found = []
        for name, module in model.named_modules():
            rule = next((r for r in self.rules if name and r.matches(name)), None)
            if rule is not None:
                found.append((name, rule, module))
        return found

    def check(self, model: nn.Module, tp: int) -> list[tuple[str, Rule, nn.Module]]:
        """One ConfigError line if the plan cannot split ``model`` over ``tp`` ranks: a name that matches no
        module, a module that is not a ``nn.Linear``, features, pieces or heads that ``tp`` does not divide."""
        found = self.resolve(model)
        for rule in self.rules:
            if not any(r is rule for _, r, _ in found):
                raise ConfigError(f"{self.source}: '{rule.pattern}' names no module of the model; module names "
                                  f"look like {', '.join(_examples(model))}")
        modules = dict(model.named_modules())
        for name, rule, module in found:
            if isinstance(module, nn.Embedding) and rule.style == "rowwise" and rule.parts == 1:
                if module.num_embeddings % tp:
                    raise ConfigError(f"--tp {tp} does not divide the {module.num_embeddings} rows (vocabulary) of "
                                      f"{name}; use a --tp that divides {module.num_embeddings}")
                continue
            if not isinstance(module, nn.Linear):
                raise ConfigError(f"{self.source}: {name} is a {type(module).__name__}; tensor parallel splits "
                                  "nn.Linear layers only (and an nn.Embedding rowwise, by its rows); drop it "
                                  "from the plan")
            width = module.out_features // rule.parts if rule.style == "colwise" else module.in_features
            what = "output features" + (f" per part ({rule.parts} parts)" if rule.parts > 1 else "") \
                if rule.style == "colwise" else "input features"
            if rule.style == "colwise" and module.out_features % rule.parts:
                raise ConfigError(f"{self.source}: {name} has {module.out_features} output features, not "
                                  f"{rule.parts} equal parts")
            heads = _heads(rule, name, modules, module)
            if heads is not None and heads % tp:
                raise ConfigError(f"--tp {tp} does not divide the {heads} attention heads of {name}; use a --tp "
                                  f"that divides {heads}")
            if width % tp:
                raise ConfigError(f"--tp {tp} does not divide the {width} {what} of {name}; use a --tp that "
                                  f"divides {width}")
        self._check_ties(model, found)
        return found

    def _check_ties(self, model: nn.Module, found: list[tuple[str, Rule, nn.Module]]) -> None:
        """A tensor under several names (tied weights) must be split alike under each, so it stays one tensor:
        one ConfigError line if the plan splits its names differently."""
        splits = {name: _placement(rule, module) for name, rule, module in found}
        for group in tied_groups(model):
            how = {n: splits.get(n.rpartition(".")[0]) for n in group}
            if len(set(how.values())) > 1:
                described = ", ".join(f"{n}: {h or 'whole'}" for n, h in how.items())
                raise ConfigError(f"{self.source}: {' and '.join(group)} are one tensor (tied weights), which the "
                                  f"plan splits differently ({described}); split them alike (an embedding "
                                  "rowwise with its tied output layer colwise, gather = true) or neither")

    def apply(self, module: nn.Module, mesh: Any, prefix: str = "") -> int:
        """Split the layers of ``module`` (named ``prefix`` in the whole model) that the plan names, over the
        1-D ``mesh``; returns how many. Each rank cuts its part of the whole values it holds (no exchange)."""
        from torch.distributed.tensor.parallel import parallelize_module

        count = 0
        for name, sub in list(module.named_modules()):
            full = f"{prefix}.{name}" if prefix and name else prefix or name
            rule = next((r for r in self.rules if full and r.matches(full)), None)
            if rule is not None:
                parallelize_module(sub, mesh, parallel_style(rule, sub))
                count += 1
        return count

    def local_shapes(self, model: nn.Module, tp: int) -> dict[str, tuple[int, ...]]:
        """The shape each split parameter has on one of ``tp`` ranks (a colwise layer's rows, a rowwise layer's
        weight columns; a rowwise bias stays whole), by name: what a rank holds, for a memory estimate."""
        out = {}
        for name, rule, module in self.resolve(model):
            for key, param in module.named_parameters(recurse=False):
                shape = list(param.shape)
                if rule.style == "colwise":
                    shape[0] //= tp
                elif key == "weight":
                    shape[1] //= tp
                out[f"{name}.{key}"] = tuple(shape)
        return out

    # -- as data -------------------------------------------------------------------------------------

    def as_dict(self) -> dict[str, Any]:
        return {rule.pattern: rule.as_dict() for rule in self.rules}

    def describe(self, tp: int | None = None, model: nn.Module | None = None) -> str:
        """The plan as ``polytrain plan`` prints it (with a model: how many layers each entry splits)."""
        head = f"tensor-parallel plan ({self.source})" + (f", over tp {tp}" if tp else "") + ":"
        counts = {}
        if model is not None:
            for _, rule, _ in self.resolve(model):
                counts[rule.pattern] = counts.get(rule.pattern, 0) + 1
        lines = [head]
        for rule in self.rules:
            count = f"  ({counts.get(rule.pattern, 0)} layer(s))" if model is not None else ""
            lines.append(f"  {rule.describe()}{count}")
        lines.append("  every other layer whole on each tp rank")
        return "\n".join(lines)


def plan_for(model: nn.Module, spec: str, model_name: str = "the model") -> TensorPlan:
    """The plan ``--tp-plan`` gives: ``auto`` is the model's own (``tp_plan``); else a TOML file."""
    if spec != "auto":
        return TensorPlan.from_file(spec)
    hf = hf_plan(model)
    if hf is not None:
        return hf
    own = getattr(model, "tp_plan", None)
    if not own or not isinstance(own, Mapping):  # (transformers' models have a tp_plan of their own: read above)
        raise ConfigError(f"--tp: --model {model_name} has no tensor-parallel plan; give one with --tp-plan "
                          "FILE.toml (module name = \"colwise\" or \"rowwise\"; see docs/tensor-parallel.md)")
    return TensorPlan.from_mapping(own, f"{type(model).__name__}.tp_plan")


#: transformers' tensor-parallel styles (``config.base_model_tp_plan``, a model's ``_tp_plan``) as plan entries
_HF_STYLES = {"colwise": {"style": "colwise"}, "rowwise": {"style": "rowwise"},
              "colwise_gather_output": {"style": "colwise", "gather": True},
              "embedding_rowwise": {"style": "rowwise"}}


def hf_plan(model: nn.Module) -> TensorPlan | None:
    """A Hugging Face model's own tensor-parallel plan (transformers ships one: the model's ``_tp_plan``, which
    transformers resolves over its submodules, the embedding's included; where that is absent, the config's
    ``base_model_tp_plan``, names below the base model, and the class's ``_tp_plan`` for its output layer), as a
    polytrain plan; None for a model that is not a transformers model. A model whose plan is empty has none
    (``plan_for`` then says to give one); a style polytrain does not carry out is one line."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "base_model_tp_plan"):
        return None
    resolved = getattr(model, "_tp_plan", None)
    if isinstance(resolved, Mapping):
        whole = dict(resolved)
    else:
        prefix = getattr(model, "base_model_prefix", "")
        own = vars(type(model)).get("_tp_plan")
        whole = {**{(f"{prefix}.{k}" if prefix and hasattr(model, prefix) else k): v
                    for k, v in (config.base_model_tp_plan or {}).items()},
                 **(own if isinstance(own, Mapping) else {})}
    if not whole:
        return None
    unknown = sorted({v for v in whole.values() if v not in _HF_STYLES})
    source = f"{type(model).__name__}'s transformers tp plan (config.base_model_tp_plan)"
    if unknown:
        raise ConfigError(f"{source}: its styles {', '.join(unknown)} are not ones polytrain splits by "
                          f"({', '.join(_HF_STYLES)}); give a plan with --tp-plan FILE.toml")
    return TensorPlan.from_mapping({k: _HF_STYLES[v] for k, v in whole.items()}, source)


def parallel_style(rule: Rule, module: nn.Module | None = None) -> Any:
    """The ``torch.distributed.tensor.parallel`` style of ``rule``, cutting locally (``src_data_rank=None``:
    every rank holds the same whole values, so nothing is scattered). A rowwise ``nn.Embedding`` is split by
    its rows (the vocabulary), its output summed whole; a ``gather`` colwise layer's output is gathered whole."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    embedding = isinstance(module, nn.Embedding)  # its input (token ids) whole on every rank
    style = RowwiseParallel(input_layouts=Replicate()) if rule.style == "rowwise" and embedding else \
        RowwiseParallel() if rule.style == "rowwise" else \
        ColwiseParallel(output_layouts=Replicate()) if rule.gather else \
        ColwiseParallel() if rule.parts == 1 else _PartsColwise(rule.parts)
    style.src_data_rank = None
    return style


def _parts_colwise() -> type:
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torch.distributed.tensor.placement_types import _StridedShard

    class PartsColwise(ColwiseParallel):
        """Colwise for an output of ``parts`` pieces side by side (a fused q, k, v projection): each piece split
        over the ranks, a rank holding its share of each (the weight's rows as ``_StridedShard(0, parts)``),
        its output those shares side by side, as a local tensor."""

        def __init__(self, parts: int):
            super().__init__()
            self.parts = parts

        def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
            for key, param in module.named_parameters():
                placed = distribute_tensor(param, device_mesh, [_StridedShard(0, split_factor=self.parts)],
                                           src_data_rank=self.src_data_rank)
                module.register_parameter(key, nn.Parameter(placed, requires_grad=param.requires_grad))

        @staticmethod
        def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any,
                               device_mesh: Any) -> Any:
            return outputs.to_local()  # this rank's share of each piece, side by side (no exchange)

    return PartsColwise


def _PartsColwise(parts: int) -> Any:  # noqa: N802 - a class made on first use (imports torch's TP lazily)
    global _PARTS_CLASS
    if _PARTS_CLASS is None:
        _PARTS_CLASS = _parts_colwise()
    return _PARTS_CLASS(parts)


_PARTS_CLASS: Any = None


def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile(".".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split(".")))


def _heads(rule: Rule, name: str, modules: dict[str, nn.Module], module: nn.Module) -> int | None:
    """The attention heads a colwise layer's output holds: the rule's, or where its parent module says its
    ``head_dim`` (a Hugging Face attention: q, and k and v of grouped-query attention, have their own)."""
    if rule.heads is None and rule.style == "colwise":
        head_dim = getattr(modules.get(name.rpartition(".")[0]), "head_dim", None)
        if isinstance(head_dim, int) and head_dim > 0 and isinstance(module, nn.Linear):
            return module.out_features // rule.parts // head_dim
    if rule.heads is None or isinstance(rule.heads, int):
        return rule.heads
    parent = modules.get(name.rpartition(".")[0])
    value = getattr(parent, rule.heads, None)
    if not isinstance(value, int):
        raise ConfigError(f"heads = \"{rule.heads}\" for {name}: its parent module has no whole-number attribute "
                          f"'{rule.heads}'; give the number of heads")
    return value


def _placement(rule: Rule, module: nn.Module) -> str:
    """How ``rule`` splits ``module``'s weight: by rows or by columns (a tied tensor must be split alike)."""
    rows = (rule.style == "colwise") == isinstance(module, nn.Linear)  # an Embedding's rowwise split is its rows
    return "rows" if rows else "columns"


def _examples(model: nn.Module) -> Iterator[str]:
    names = [n for n, m in model.named_modules() if n and isinstance(m, nn.Linear)][:4]
    return iter(names or [n for n, _ in model.named_modules() if n][:4])
