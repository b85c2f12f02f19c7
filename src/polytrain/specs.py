"""Compact specs: ``name``, ``name:key=value,...``, ``name:POSITIONAL,key=value`` and ``package.module:factory``.

One small grammar serves LR schedules (``exponential:rate=0.1,decay_steps=1000,staircase=true``),
models (``mlp:hidden=64x32``) and data (``cifar10:/data/cifar-10-batches-py``,
``synthetic:shape=3x32x32,size=512``). Values are typed by their look: ``true``/``false``, integers,
floats, ``64x32`` (a tuple of ints); anything else stays a string.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from polytrain.errors import ConfigError

_INT = re.compile(r"^[+-]?\d+$")
_FLOAT = re.compile(r"^[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?$")
_DIMS = re.compile(r"^\d+(x\d+)+$")
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass(frozen=True)
class Spec:
    """A parsed spec: ``name`` plus positional and keyword arguments."""

    name: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        parts = [format_value(a) for a in self.args]
        parts += [f"{k}={format_value(v)}" for k, v in self.kwargs.items()]
        return self.name + (":" + ",".join(parts) if parts else "")


def parse_value(text: str) -> Any:
    """Turn a spec or flag value into bool, int, float, tuple of ints or str."""
    low = text.strip().lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if _INT.match(low):
        return int(low)
    if _FLOAT.match(low):
        return float(low)
    if _DIMS.match(low):
        return tuple(int(p) for p in low.split("x"))
    return text.strip()


def format_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return "x".join(str(v) for v in value)
    return str(value)


def is_import_path(text: str) -> bool:
    """``package.module:factory``: a user factory, tried when the name is not registered."""
    return bool(_IMPORT_PATH.match(text.strip()))


def parse_spec(text: str, *, what: str) -> Spec:
    """Parse ``name[:item,item,...]`` where an item is ``key=value`` or a positional value.

    ``what`` names the setting in error messages (e.g. ``"--lr-schedule"``).
    """
    text = text.strip()
    if not text:
        raise ConfigError(f"{what}: empty value; expected NAME or NAME:key=value,...")
    name, _, rest = text.partition(":")
    name = name.strip()
    if not name:
        raise ConfigError(f"{what}: '{text}' has no name before ':'")
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    if rest:
        for item in rest.split(","):
            if not item.strip():
                raise ConfigError(f"{what}: empty item in '{text}' (two commas in a row?)")
            key, eq, value = item.partition("=")
            if eq:
                key = key.strip()
                if not key.isidentifier():
                    raise ConfigError(f"{what}: '{key}' in '{text}' is not a valid argument name")
                if key in kwargs:
                    raise ConfigError(f"{what}: '{key}' is given twice in '{text}'")
                kwargs[key] = parse_value(value)
            elif kwargs:
                raise ConfigError(f"{what}: positional value '{item}' after key=value items in '{text}'")
            else:
                args.append(parse_value(item))
    return Spec(name, tuple(args), kwargs)


def parse_assignments(items: list[str]) -> dict[str, Any]:
    """``["hidden=64x32", "act=tanh"]`` (a repeated ``--x-arg`` flag) -> typed dict; ValueError if malformed."""
    out: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.strip().isidentifier():
            raise ValueError(f"expected key=value, got '{item}'")
        out[key.strip()] = parse_value(value)
    return out


def load_factory(path: str, *, what: str) -> Callable[..., Any]:
    """Import ``package.module:attr`` and return the callable it names."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{what}: cannot import module '{module_name}' from '{path}': {exc}") from None
    try:
        factory = getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{what}: module '{module_name}' has no attribute '{attr}'") from None
    if not callable(factory):
        raise ConfigError(f"{what}: '{path}' is not callable")
    return factory


_NUMERIC_HINT = re.compile(r"[A-Za-z_]+")
#: the words of an annotation that takes numbers only (``int``, ``float | None``, ``int | Sequence[int]``)
_NUMERIC_WORDS = {"int", "float", "bool", "None", "Sequence", "tuple", "Tuple", "list", "List", "Optional",
                  "Union", "typing"}


def _numeric_examples(annotation: str) -> list[str] | None:
    """Values to show for a parameter annotated ``annotation`` (a string, as ``from __future__ import
    annotations`` keeps it) when it takes numbers only; None when it may take text."""
    words = set(_NUMERIC_HINT.findall(annotation))
    if not words or not words <= _NUMERIC_WORDS or not words & {"int", "float", "bool"}:
        return None
    if words & {"Sequence", "tuple", "Tuple", "list", "List"}:
        return ["64", "64x32"]
    if words <= {"bool", "None", "Optional"}:
        return ["true", "false"]
    return ["64"] if "float" not in words else ["0.1"]


def check_value_types(fn: Callable[..., Any], what: str, kwargs: dict[str, Any]) -> None:
    """One ConfigError line for a user argument given as text where ``fn``'s annotation takes numbers only
    (``mlp:hidden=abc``), before ``fn`` compares it with a number and fails with Python's own words."""
    params = inspect.signature(fn).parameters
    for key, value in kwargs.items():
        param = params.get(key)
        if key.startswith("_") or param is None or not isinstance(value, str) or param.annotation is param.empty:
            continue
        annotation = param.annotation if isinstance(param.annotation, str) else getattr(
            param.annotation, "__name__", str(param.annotation))
        examples = _numeric_examples(annotation)
        if examples is not None:
            shown = " or ".join(f"{key}={e}" for e in examples)
            raise ConfigError(f"{what}: {key}={value!r} is not a value {key} takes ({annotation}); write e.g. {shown}")


def check_accepted(fn: Callable[..., Any], what: str, kwargs: dict[str, Any]) -> None:
    """One ConfigError line if ``fn`` does not accept a user argument of ``kwargs`` (keys starting with ``_``
    are polytrain's context, offered but optional, and not listed as accepted), or is given text where it
    takes numbers only."""
    sig = inspect.signature(fn)
    check_value_types(fn, what, kwargs)
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return
    unknown = [k for k in kwargs if not k.startswith("_") and k not in sig.parameters]
    if unknown:
        context = {k.lstrip("_") for k in kwargs if k.startswith("_")}
        names = [p for p in sig.parameters if p not in ("self",) and p not in context]
        raise ConfigError(
            f"{what}: unknown argument(s) {', '.join(sorted(unknown))}; accepted: {', '.join(names) or 'none'}"
        )


def call_with_accepted(fn: Callable[..., Any], what: str, /, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` with the keyword arguments it accepts; user arguments it does not accept are an error.

    Keys starting with ``_`` are offered but optional (context such as ``input_shape``); other keys are
    the user's and must be accepted.
    """
    check_accepted(fn, what, kwargs)
    sig = inspect.signature(fn)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    accepted = {k.lstrip("_"): v for k, v in kwargs.items() if takes_any or k.lstrip("_") in sig.parameters}
    try:
        return fn(*args, **accepted)
    except TypeError as exc:
        given = ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if not k.startswith("_"))
        raise ConfigError(f"{what}: {exc}" + (f" (given {given})" if given else "")) from None
