"""Checks between language-model data and a model, made once before training starts.

A model's vocabulary and longest sequence are read from ``vocab_size``/``max_seq_len`` attributes
(``rnn_lm``, ``transformer_lm``), from a Hugging Face ``config`` (``vocab_size``,
``max_position_embeddings`` or ``n_positions``), or for the vocabulary from its first ``nn.Embedding``.
What cannot be read is not checked.
"""

from __future__ import annotations

from torch import nn

from polytrain.data.base import DataBundle
from polytrain.errors import ConfigError

_HF_POSITIONS = ("max_position_embeddings", "n_positions")


def model_vocab_size(model: nn.Module) -> int | None:
    for source in (model, getattr(model, "config", None)):
        if isinstance(getattr(source, "vocab_size", None), int):
            return source.vocab_size
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return embedding.num_embeddings if embedding is not None else None


def model_max_seq_len(model: nn.Module) -> int | None:
    if isinstance(getattr(model, "max_seq_len", None), int):
        return model.max_seq_len
    config = getattr(model, "config", None)
    return next((getattr(config, k) for k in _HF_POSITIONS if isinstance(getattr(config, k, None), int)), None)


def data_max_token_id(bundle: DataBundle) -> int | None:
    """The largest token id in the data, where its datasets can tell (``max_token_id``)."""
    ids = [split.max_token_id for split in (bundle.train, bundle.test) if hasattr(split, "max_token_id")]
    return max(ids) if ids else None


def check_lm_compat(bundle: DataBundle, model: nn.Module, model_name: str = "the model") -> None:
    """One ConfigError line if ``model`` cannot take ``bundle``'s sequences: token ids beyond its
    vocabulary, or sequences longer than its positions. Does nothing for other tasks."""
    if bundle.task != "lm":
        return
    vocab, top = model_vocab_size(model), data_max_token_id(bundle)
    if vocab is not None and top is not None and top >= vocab:
        raise ConfigError(f"--model {model_name}: its vocabulary of {vocab} tokens is smaller than the data's "
                          f"token ids (up to {top} in {bundle.name}); use a vocabulary of at least {top + 1} "
                          f"(byte tokens need {bundle.vocab_size or 256})")
    limit = model_max_seq_len(model)
    if limit is not None and bundle.seq_len is not None and bundle.seq_len > limit:
        raise ConfigError(f"--data {bundle.name}: sequences of up to {bundle.seq_len} tokens are longer than the "
                          f"model's seq_len {limit}; use --model-arg seq_len={bundle.seq_len} or shorter sequences")


def check_lm_model(bundle: DataBundle, config: object) -> None:
    """Before launch: the run's model, built on the meta device (nothing allocated) for ``bundle``'s shape,
    checked against the data (:func:`check_lm_compat`) and, for packed documents, for taking position ids.
    A factory that cannot be built so is left to the workers, which check the same."""
    from polytrain.models.registry import meta_build, model_name
    from polytrain.tasks import packed_task

    name = model_name(config, bundle)
    try:
        model = meta_build(name, config.model.model_args, bundle)
    except Exception:  # noqa: BLE001 - a factory that needs real memory or data: the workers check it
        return
    check_lm_compat(bundle, model, name)
    if bundle.document_end is not None:
        packed_task(bundle.document_end, model, name)


def shape_from_state(state: dict[str, object]) -> dict[str, object]:
    """``input_shape``/``num_classes`` to rebuild ``rnn_lm``/``transformer_lm`` from a saved state_dict: the
    vocabulary from the token embedding's rows, the sequence length from the position embedding's."""
    shape: dict[str, object] = {}
    for key in ("embed.tokens.weight", "embed.weight"):
        if key in state:
            shape["num_classes"] = int(state[key].shape[0])
            break
    if "embed.positions.weight" in state:
        shape["input_shape"] = (int(state["embed.positions.weight"].shape[0]),)
    return shape
