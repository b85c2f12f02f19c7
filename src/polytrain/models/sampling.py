"""Sampling text from a language model, one token at a time: byte tokens, or a tokenizer's."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from polytrain.data.tokens import VOCAB_SIZE
from polytrain.models.lm import model_max_seq_len
from polytrain.tasks import outputs_of

START = b"\n"  # an empty prompt starts where a sentence would (sentences:FILE begins each with a newline)


@torch.no_grad()
def sample_tokens(model: nn.Module, prompt: list[int], tokens: int, temperature: float = 1.0, seed: int = 0,
                  vocab: int | None = None) -> list[int]:
    """``tokens`` ids continuing ``prompt`` (a non-empty list of ids); ``temperature`` 0 takes the likeliest
    token every time; only ids below ``vocab`` (those the tokenizer can print) are drawn.

    The whole context is run again for every token (no cache): simple, and fast enough for the small
    models here. A model with a position limit sees its last ``seq_len`` tokens.
    """
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    context = list(prompt)
    window = model_max_seq_len(model)
    made: list[int] = []
    for _ in range(tokens):
        ids = torch.tensor([context[-window:] if window else context], device=device)
        logits = outputs_of(model(ids))[0, -1, :vocab].float().cpu()
        if temperature <= 0:
            token = int(logits.argmax())
        else:
            token = int(torch.multinomial(torch.softmax(logits / temperature, dim=0), 1, generator=generator))
        context.append(token)
        made.append(token)
    model.train(was_training)
    return made


def sample_bytes(model: nn.Module, prompt: bytes, tokens: int, temperature: float = 1.0, seed: int = 0) -> bytes:
    """``tokens`` bytes continuing ``prompt`` from a byte-level model (an empty prompt starts a new line)."""
    return bytes(sample_tokens(model, list(prompt or START), tokens, temperature, seed, VOCAB_SIZE))


def sample_text(model: nn.Module, tokenizer: Any, prompt: str, tokens: int, temperature: float = 1.0,
                seed: int = 0) -> str:
    """The prompt and ``tokens`` more of ``tokenizer``'s tokens, decoded; an empty prompt starts a document
    (after the end-of-document token)."""
    ids = tokenizer.encode(prompt)
    start = ids or [tokenizer.require_eos()]
    made = sample_tokens(model, start, tokens, temperature, seed, tokenizer.vocab_size)
    return tokenizer.decode(ids + made)
