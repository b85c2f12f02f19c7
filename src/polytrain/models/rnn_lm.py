"""``rnn_lm``: the LSTM language model of TensorFlow's PTB tutorial (Zaremba et al., 2014), "small" by default.

The tutorial's small configuration: 2 LSTM layers of 200 units, embedding width = hidden width, weights
initialised uniformly in [-0.1, 0.1] (``init_scale``), no dropout (its keep_prob is 1.0; "medium" is
``hidden=650,dropout=0.5,init_scale=0.05``, "large" ``hidden=1500,dropout=0.65,init_scale=0.04``), untied
input and output embeddings (``tied=true`` shares them, Press & Wolf 2017). The rest of that recipe is
training settings: SGD ``--lr 1.0``, gradient norm clipped at 5, 20 unrolled steps, batch 20, the LR
halved every epoch after the 4th, 13 epochs. Vocabulary: the data's (256 byte tokens here, not the
tutorial's 10,000 words).

Unlike the tutorial, the LSTM state starts at zero for every sequence: batches are shuffled windows or
sentences, not one stream carried across steps. Padding follows a sequence's real tokens, so it never
changes the outputs at real positions (the LSTM runs forward only).
"""

from __future__ import annotations

import torch
from torch import nn


class RNNLanguageModel(nn.Module):
    """tokens (batch, time) -> logits (batch, time, vocab)."""

    def __init__(self, vocab: int, hidden: int, layers: int, dropout: float, tied: bool, init_scale: float):
        super().__init__()
        self.vocab_size, self.max_seq_len = vocab, None  # an RNN takes sequences of any length
        self.embed = nn.Embedding(vocab, hidden)
        self.drop = nn.Dropout(dropout)
        self.rnn = nn.LSTM(hidden, hidden, layers, batch_first=True, dropout=dropout if layers > 1 else 0.0)
        self.head = nn.Linear(hidden, vocab)
        self.init_scale = init_scale
        if tied:
            self.head.weight = self.embed.weight
        for param in self.parameters():
            nn.init.uniform_(param, -init_scale, init_scale)
        if not tied:  # a tied embedding is one tensor in two units: built whole, never unit by unit
            self.init_unit = self._init_unit

    def _init_unit(self, name: str, unit: nn.Module) -> None:
        """Every weight uniform in [-init_scale, init_scale], as the tutorial initialises the whole model."""
        for param in unit.parameters():
            nn.init.uniform_(param, -self.init_scale, self.init_scale)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.drop(self.embed(tokens)))
        return self.head(self.drop(out))


def rnn_lm(input_shape: tuple[int, ...] = (20,), num_classes: int = 256, hidden: int = 200, layers: int = 2,
           dropout: float = 0.0, tied: bool = False, init_scale: float = 0.1, vocab: int | None = None) -> nn.Module:
    """``num_classes`` (the data's vocabulary) sizes the embedding unless ``vocab`` is given."""
    vocab = num_classes if vocab is None else vocab
    if min(vocab, hidden, layers) < 1:
        raise ValueError(f"vocab, hidden and layers must be >= 1, got {vocab}, {hidden}, {layers}")
    if not 0 <= dropout < 1:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    return RNNLanguageModel(vocab, hidden, layers, float(dropout), bool(tied), float(init_scale))
