"""User model factories for the --loss tests, named as ``--model tests.train.lm_factories:NAME``.

They live in a real module (not a test function) because spawned workers import factories by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from polytrain.data.tokens import IGNORE_INDEX


@dataclass
class Output:
    """What a Hugging Face causal LM returns, reduced to the two fields polytrain reads."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


class OwnLossLM(nn.Module):
    """A tiny causal LM (embedding, one GRU, linear head) whose forward computes its own loss from
    ``labels=`` the Hugging Face way: labels aligned with the inputs, shifted inside, -100 ignored."""

    def __init__(self, vocab: int = 256, dim: int = 16, returns_loss: bool = True):
        super().__init__()
        self.vocab_size, self.returns_loss = vocab, returns_loss
        self.embed = nn.Embedding(vocab, dim)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> Output:
        logits = self.head(self.rnn(self.embed(tokens))[0])
        if labels is None or not self.returns_loss:
            return Output(logits)
        shifted = logits[:, :-1].reshape(-1, logits.shape[-1])
        return Output(logits, F.cross_entropy(shifted, labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX))


def own_loss_lm(num_classes: int = 256) -> nn.Module:
    return OwnLossLM(num_classes)


def no_loss_lm(num_classes: int = 256) -> nn.Module:
    """Takes labels= but returns no loss (as a Hugging Face base model without an LM head would)."""
    return OwnLossLM(num_classes, returns_loss=False)
