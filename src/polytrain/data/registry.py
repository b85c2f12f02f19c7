"""Datasets by name (``digits``, ``synthetic``, ``cifar10:DIR``, ``text[:FILE]``, ``sentences:FILE``,
``tokens:FILE.bin``, ``hf:PATH``) plus user factories ``package.module:factory``.

A user factory returns a :class:`DataBundle`, or a ``(train, test)`` pair of map-style
``torch.utils.data.Dataset``s (``test`` may be None) whose items are ``(input, target)``; polytrain then
reads the input shape from the first example and the task from the targets (integer class labels, or
0./1. floats for a binary task). ``--data-arg num_classes=N`` saves a scan of the targets.
A factory that accepts ``run_seed`` gets the run's ``--seed`` (for random augmentation). Before any worker
starts, a run calls a factory once in the launching process and checks what it returns
(:mod:`polytrain.train.data_check`).
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils.data import Dataset

from polytrain.data.base import DataBundle
from polytrain.data.cifar10 import check_cifar10, cifar10
from polytrain.data.digits import DIGITS_SIZE, TEST_SIZE, digits
from polytrain.data.sentences import check_sentences, sentences
from polytrain.data.synthetic import check_synthetic, synthetic
from polytrain.data.text import check_text, text
from polytrain.data.hf_data import check_hf, hf
from polytrain.data.token_file import check_tokens, tokens
from polytrain.errors import ConfigError, DataError
from polytrain.specs import call_with_accepted, is_import_path, load_factory, parse_spec

_SCAN_LIMIT = 100_000  # targets read to infer the classes of a user dataset


@dataclass(frozen=True)
class DatasetEntry:
    """A registered dataset: how to build it and, optionally, how to validate its arguments cheaply.

    ``check`` returns the number of training examples when it knows it. ``positional`` names the argument
    that a bare value in the spec fills (``cifar10:DIR`` -> ``directory``).
    """

    build: Callable[..., Any]
    check: Callable[..., int | None] | None = None
    positional: str | None = None
    #: building it costs about what checking it does (memory-mapped data): it is built before launch, so
    #: that the model can be checked against it there
    mapped: bool = False


_DATASETS: dict[str, DatasetEntry] = {
    "digits": DatasetEntry(digits, lambda test_size=TEST_SIZE: DIGITS_SIZE - test_size),
    "synthetic": DatasetEntry(synthetic, check_synthetic),
    "cifar10": DatasetEntry(cifar10, check_cifar10, positional="directory"),
    "text": DatasetEntry(text, check_text, positional="file"),
    "sentences": DatasetEntry(sentences, check_sentences, positional="file"),
    "tokens": DatasetEntry(tokens, check_tokens, positional="file", mapped=True),
    "hf": DatasetEntry(hf, check_hf, positional="path", mapped=True),
}


def register_dataset(name: str, *, check: Callable[..., int | None] | None = None,
                     positional: str | None = None) -> Callable[[Callable], Callable]:
    """Decorator: make ``factory`` available as ``--data name``."""
    def add(factory: Callable) -> Callable:
        _DATASETS[name] = DatasetEntry(factory, check, positional)
        return factory
    return add


def available_datasets() -> list[str]:
    return sorted(_DATASETS)


def _resolve(spec: str, args: dict[str, Any] | None) -> tuple[DatasetEntry, dict[str, Any]]:
    name = spec.split(":", 1)[0].strip()
    if name in _DATASETS:
        entry = _DATASETS[name]
        parsed = parse_spec(spec, what="--data")
        kwargs = dict(parsed.kwargs)
        if parsed.args:
            if entry.positional is None or len(parsed.args) > 1:
                raise ConfigError(f"--data: '{spec}' has positional values; use key=value "
                                  "(e.g. synthetic:shape=3x32x32,size=512)")
            # a folder like 2024 must stay a path, not become the number parse_spec made of it
            kwargs[entry.positional] = spec.split(":", 1)[1].split(",", 1)[0].strip()
    elif is_import_path(spec):
        entry, kwargs = DatasetEntry(load_factory(spec, what="--data")), {}
    else:
        close = difflib.get_close_matches(name, _DATASETS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"--data: unknown dataset '{spec}'{hint}; choose one of "
                          f"{', '.join(available_datasets())} or give your own factory as package.module:function")
    clash = set(kwargs) & set(args or {})
    if clash:
        raise ConfigError(f"--data: {', '.join(sorted(clash))} given both in '{spec}' and as --data-arg")
    return entry, {**kwargs, **(args or {})}


#: the data settings of their own flags that a dataset is given when set, and must then accept
_SETTINGS = {
    "tokenizer": "has no text to tokenize; leave --tokenizer out, or use language-model text: text, sentences, "
                 "tokens, hf",
    "pack": "has no documents to pack; leave --pack out, or use documents: hf, tokens",
}


def _settings(spec: str, entry: DatasetEntry, kwargs: dict[str, Any], **given: Any) -> dict[str, Any]:
    """``kwargs`` with the data settings that are set (``--tokenizer``, ``--pack``); one ConfigError line for
    a dataset that does not take one."""
    out = dict(kwargs)
    for key, value in given.items():
        if not value:
            continue
        if key in out:
            raise ConfigError(f"--data: {key} given both as --{key} and in '{spec}' or --data-arg")
        if not _accepts(entry.build, key):
            raise ConfigError(f"--{key}: --data {spec} {_SETTINGS[key]}")
        out[key] = value
    return out


def check_data(spec: str, args: dict[str, Any] | None = None, *, tokenizer: str | None = None,
               pack: bool = False) -> int | None:
    """Validate a data spec without loading the data; the number of training examples if known."""
    entry, kwargs = _resolve(spec, args)
    kwargs = _settings(spec, entry, kwargs, tokenizer=tokenizer, pack=pack)
    if entry.check is None:
        return None
    return call_with_accepted(entry.check, f"--data {spec}", **kwargs)


def build_data(spec: str, args: dict[str, Any] | None = None, *, seed: int = 0, tokenizer: str | None = None,
               pack: bool = False) -> DataBundle:
    """Load the dataset ``spec`` names; ``seed`` is the run's seed (for random augmentation only);
    ``tokenizer`` and ``pack`` are ``--tokenizer`` and ``--pack``, given to datasets that take them."""
    entry, kwargs = _resolve(spec, args)
    kwargs = _settings(spec, entry, kwargs, tokenizer=tokenizer, pack=pack)
    hints = {k: kwargs.pop(k) for k in ("num_classes", "task") if k in kwargs and not _accepts(entry.build, k)}
    made = call_with_accepted(entry.build, f"--data {spec}", _run_seed=seed, **kwargs)
    if isinstance(made, DataBundle):
        return made
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], Dataset):
        return bundle_from_datasets(spec, made[0], made[1], **hints)
    raise DataError(f"--data {spec}: the factory returned {type(made).__name__}; return a DataBundle or a "
                    "(train, test) pair of torch.utils.data.Dataset")


def data_of(config: Any) -> DataBundle:
    """The dataset of a run's config (its data section and seed)."""
    data = config.data
    return build_data(data.data, data.data_args, seed=config.train.seed, tokenizer=tokenizer_of(config),
                      pack=data.pack)


def check_data_of(config: Any) -> tuple[int | None, DataBundle | None]:
    """:func:`check_data` for a run's config: the number of training examples if known, and the dataset
    itself where building it costs no more than checking it (memory-mapped data; else None)."""
    data = config.data
    entry, _ = _resolve(data.data, data.data_args)
    if entry.mapped:
        bundle = data_of(config)
        return (len(bundle.train) if hasattr(bundle.train, "__len__") else None), bundle
    return check_data(data.data, data.data_args, tokenizer=tokenizer_of(config), pack=data.pack), None


def tokenizer_of(config: Any) -> str | None:
    """The run's tokenizer: ``--tokenizer``; else, for ``--model hf:DIR`` and data that takes one, the model
    directory's own tokenizer (a model's vocabulary is its tokenizer's); else None (bytes)."""
    from polytrain.data.tokenizer import model_tokenizer

    data = config.data
    if data.tokenizer:
        return data.tokenizer
    own = model_tokenizer(config.model.model)
    return own if own and _accepts(_resolve(data.data, data.data_args)[0].build, "tokenizer") else None


def _accepts(fn: Callable, name: str) -> bool:
    params = inspect.signature(fn).parameters
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def bundle_from_datasets(name: str, train: Dataset, test: Dataset | None, *, num_classes: int | None = None,
                         task: str | None = None) -> DataBundle:
    """Describe plain map-style datasets: input shape from the first example, task and classes from targets."""
    if len(train) == 0:
        raise DataError(f"--data {name}: the train set is empty; give it examples")
    first_input, target = example_pair(train, 0, f"--data {name}")
    if task is None:
        task = "binary" if target.is_floating_point() else "classification"
    if num_classes is None:
        num_classes = 2 if task == "binary" else _count_classes(train, name)
    return DataBundle(name=name, train=train, test=test, input_shape=tuple(first_input.shape),
                      num_classes=int(num_classes), task=task,
                      default_model="mlp" if first_input.dim() != 3 else "cifar_cnn")


def example_pair(data: Dataset, index: int, what: str, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """Example ``index`` of ``data`` (the ``split`` set of ``what``, e.g. ``--data SPEC``) as an (input, target)
    pair of tensors; one DataError line if it is not one."""
    item = data[index]
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise DataError(f"{what}: {split} example {index} is a {type(item).__name__}, not an (input, target) pair; "
                        "make the dataset's __getitem__ return (input, target)")
    pair = []
    for part, value in zip(("input", "target"), item):
        try:
            pair.append(torch.as_tensor(value))
        except (TypeError, ValueError, RuntimeError) as exc:
            raise DataError(f"{what}: {split} example {index} has an {part} of type {type(value).__name__}, which "
                            f"is not a tensor ({exc}); return tensors or numbers") from None
    return pair[0], pair[1]


def _count_classes(data: Dataset, name: str) -> int:
    targets = getattr(data, "targets", None)
    if targets is None:
        count = min(len(data), _SCAN_LIMIT)
        targets = [example_pair(data, i, f"--data {name}")[1] for i in range(count)]
    labels = torch.as_tensor(targets if not isinstance(targets, list) else [_label(t) for t in targets])
    bad = (labels < 0).nonzero() if not labels.is_floating_point() else torch.zeros(1, 1, dtype=torch.long)
    if labels.numel() and len(bad):
        index = int(bad[0][0])
        value = labels[index].item()
        raise DataError(f"--data {name}: train example {index} has target {value:.4g}; class targets "
                        "must be integers >= 0; for a binary task return float 0./1. targets, or pass "
                        "--data-arg num_classes=N")
    return int(labels.max()) + 1


def _label(target: Any) -> Any:
    value = torch.as_tensor(target)
    return value.item() if value.numel() == 1 else value
