"""Sampling text from a byte-level language model, one token at a time."""

from __future__ import annotations

import torch
from torch import nn

from polytrain.data.tokens import VOCAB_SIZE
from polytrain.models.lm import model_max_seq_len
from polytrain.tasks import outputs_of

START = b"\n"  # an empty prompt starts where a sentence would (sentences:FILE begins each with a newline)


@torch.no_grad()
def sample_bytes(model: nn.Module, prompt: bytes, tokens: int, temperature: float = 1.0, seed: int = 0) -> bytes:
    """``tokens`` bytes continuing ``prompt``; ``temperature`` 0 takes the likeliest byte every time.

    The whole context is run again for every token (no cache): simple, and fast enough for the small
    models here. A model with a position limit sees the last ``seq_len`` bytes.
    """
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    context = list(prompt or START)
    window = model_max_seq_len(model)
    made: list[int] = []
    for _ in range(tokens):
        ids = torch.tensor([context[-window:] if window else context], device=device)
        logits = outputs_of(model(ids))[0, -1, :VOCAB_SIZE].float().cpu()  # only byte ids can be printed
        if temperature <= 0:
            token = int(logits.argmax())
        else:
            token = int(torch.multinomial(torch.softmax(logits / temperature, dim=0), 1, generator=generator))
        context.append(token)
        made.append(token)
    model.train(was_training)
    return bytes(made)
