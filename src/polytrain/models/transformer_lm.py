"""``transformer_lm``: a GPT-style decoder written with torch.nn primitives and scaled_dot_product_attention.

``embed`` (token + learned position embeddings) → ``blocks.0 … blocks.N-1`` (pre-norm: x + attn(ln(x)),
x + mlp(ln(x))) → ``head`` (final norm, linear to the vocabulary). The repeated blocks sit in an
``nn.ModuleList`` named ``blocks`` so placement and pipeline splits can name them (``--place
blocks.0=cuda:0,blocks.2=cuda:1``); ``forward`` is just embed → each block → head. ``tp_plan`` says how
``--tp`` splits the blocks' heads and MLPs over tensor-parallel ranks.

The default (4 layers, width 128, 4 heads, 128 positions, ~0.9 M parameters) trains on two CPU cores.
``seq_len`` (the positions) defaults to the data's sequence length. Attention is causal
(``is_causal=True``), so padding after a sequence's real tokens never reaches them.

Packed documents (``--pack``): given ``position_ids`` (batch, time) that restart at 0 where each document
begins (Hugging Face's packed format), the model embeds those positions and attends through a block-diagonal
causal mask, so each document is computed exactly as it would be alone.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from polytrain.models.parts import units

_INIT_STD = 0.02  # GPT-2's


class Embed(nn.Module):
    def __init__(self, vocab: int, dim: int, seq_len: int, dropout: float):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(seq_len, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.positions.num_embeddings:
            raise ValueError(f"a sequence of {length} tokens is longer than the model's seq_len "
                             f"{self.positions.num_embeddings}")
        at = torch.arange(length, device=tokens.device) if position_ids is None else position_ids
        return self.drop(self.tokens(tokens) + self.positions(at))


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.head_dim, self.dropout = heads, dim // heads, dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask`` (batch, 1, time, time), True where a position may attend: a packed batch's block-diagonal
        causal mask (None: plain causal attention)."""
        batch, time, _ = x.shape
        qkv = self.qkv(x)
        width = qkv.shape[-1] // 3  # q, k, v of this rank's heads (all of them, unless split by --tp)
        q, k, v = (t.view(batch, time, -1, self.head_dim).transpose(1, 2) for t in qkv.split(width, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=mask is None)
        return self.proj(y.transpose(1, 2).reshape(batch, time, width))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x), mask))
        return x + self.drop(self.mlp(self.ln2(x)))


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


class TransformerLM(nn.Module):
    """tokens (batch, time <= seq_len) -> logits (batch, time, vocab)."""

    #: how ``--tp`` splits it (:mod:`polytrain.parallel.tp.plan`): each block's heads (q, k and v of a
    #: rank's heads: the fused projection's 3 parts split alike) and its MLP's hidden features
    tp_plan = {
        "blocks.*.attn.qkv": {"style": "colwise", "parts": 3, "heads": "heads"},
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.mlp.0": "colwise",
        "blocks.*.mlp.2": "rowwise",
    }

    def __init__(self, vocab: int, layers: int, dim: int, heads: int, seq_len: int, dropout: float):
        super().__init__()
        self.vocab_size, self.max_seq_len = vocab, seq_len
        self.embed = Embed(vocab, dim, seq_len, dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.head = Head(dim, vocab)
        for name, unit in units(self):  # (polytrain materialises a model built on the meta device the same way)
            self.init_unit(name, unit)

    def init_unit(self, name: str, unit: nn.Module) -> None:
        """GPT-2's initialisation of one unit: normal(0.02) weights, zero biases, LayerNorms at 1 and 0, the
        residual projections of the blocks scaled down with depth."""
        for module in unit.modules():
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        unit.apply(_init)
        if isinstance(unit, Block):
            for proj in (unit.attn.proj, unit.mlp[2]):
                nn.init.normal_(proj.weight, std=_INIT_STD / math.sqrt(2 * len(self.blocks)))

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        # the embed's call takes one argument unless the batch is packed: a pipeline's split check sees each
        # unit applied to the output of the one before (parallel/pp/split.py)
        x = self.embed(tokens) if position_ids is None else self.embed(tokens, position_ids)
        mask = None if position_ids is None else document_mask(position_ids)
        for block in self.blocks:
            x = block(x) if mask is None else block(x, mask)
        return self.head(x)


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """The block-diagonal causal mask (batch, 1, time, time) of packed documents: a position attends to the
    positions at or before it in its own document, a document beginning wherever the position ids do not
    go on by one (as Hugging Face's ``find_packed_sequence_indices`` reads them)."""
    steps = torch.diff(position_ids, dim=-1, prepend=position_ids[:, :1] - 1)
    document = (steps != 1).cumsum(dim=-1)
    same = document.unsqueeze(-1) == document.unsqueeze(-2)
    time = position_ids.shape[-1]
    causal = torch.ones(time, time, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal).unsqueeze(1)


def _init(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=_INIT_STD)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def transformer_lm(input_shape: tuple[int, ...] = (128,), num_classes: int = 256, layers: int = 4, dim: int = 128,
                   heads: int = 4, seq_len: int | None = None, dropout: float = 0.0,
                   vocab: int | None = None) -> nn.Module:
    """``seq_len`` defaults to the data's (``input_shape[0]``); ``vocab`` to ``num_classes``."""
    vocab = num_classes if vocab is None else vocab
    seq_len = (input_shape[0] if input_shape else 128) if seq_len is None else seq_len
    if min(vocab, layers, dim, heads, seq_len) < 1:
        raise ValueError(f"vocab, layers, dim, heads and seq_len must be >= 1, got {vocab}, {layers}, {dim}, "
                         f"{heads}, {seq_len}")
    if dim % heads:
        raise ValueError(f"dim {dim} does not split into {heads} heads; use a dim divisible by heads")
    if not 0 <= dropout < 1:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    return TransformerLM(vocab, layers, dim, heads, seq_len, float(dropout))
