"""Models no one on the project wrote, built the way their users build them, tiny, for the tests:

* ``llama``: a transformers ``LlamaForCausalLM`` (rotary embeddings with non-persistent buffers, grouped-query
  attention, RMSNorm, SwiGLU), from a config or ``from_pretrained(path)`` of a directory a test wrote;
* ``gpt2``: a transformers ``GPT2LMHeadModel`` with tied ``wte``/``lm_head`` (its layers are ``Conv1D``);
* ``nanogpt``: nanoGPT's shape (blocks in ``transformer.h`` inside an ``nn.ModuleDict``, ``lm_head`` tied to
  ``transformer.wte``, one fused ``c_attn`` for q, k, v), its weights from ``load_state_dict`` of a file;
* ``unit_gpt``: the same shape with an ``init_unit`` that reads each unit's tensors from a file.

``--model tests.helpers.zoo:llama --model-arg path=DIR``; the ``write_*`` functions save what the factories
load (no hub: everything is made here). transformers is imported only by the Hugging Face factories.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, DIM, LAYERS = 256, 16, 32, 2


def _llama_config(num_classes: int, seq_len: int, layers: int, tie: bool):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=num_classes, hidden_size=DIM, intermediate_size=2 * DIM, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq_len,
                       tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def llama(num_classes: int = VOCAB, seq_len: int = SEQ, path: str | None = None, layers: int = LAYERS,
          tie: bool = False):
    from transformers import LlamaForCausalLM

    if path:
        return LlamaForCausalLM.from_pretrained(path)
    return LlamaForCausalLM(_llama_config(num_classes, seq_len, layers, tie))


def gpt2(num_classes: int = VOCAB, seq_len: int = SEQ, path: str | None = None, layers: int = LAYERS):
    from transformers import GPT2Config, GPT2LMHeadModel

    if path:
        model = GPT2LMHeadModel.from_pretrained(path)
    else:
        model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=DIM, n_head=2, vocab_size=num_classes,
                                           n_positions=seq_len, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                                           embd_pdrop=0.0, attn_pdrop=0.0))
    model.loss_type = "ForCausalLM"
    return model


def write_pretrained(kind: str, path: str | Path, seed: int = 1) -> Path:
    """A Hugging Face model directory of ``llama`` or ``gpt2`` with weights drawn from ``seed``."""
    torch.manual_seed(seed)
    model = {"llama": llama, "gpt2": gpt2}[kind]()
    model.save_pretrained(path)
    return Path(path)


# -- nanoGPT's shape ------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)  # q, k, v in one
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd: int):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention(n_embd, n_head)
        self.ln_2, self.mlp = nn.LayerNorm(n_embd), MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int = VOCAB, block_size: int = SEQ, n_layer: int = LAYERS, n_embd: int = DIM,
                 n_head: int = 2, tie: bool = True):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie:
            self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def nanogpt(num_classes: int = VOCAB, seq_len: int = SEQ, path: str | None = None) -> GPT:
    """nanoGPT's model, its weights loaded from ``path`` (a state_dict file) with ``load_state_dict``."""
    model = GPT(num_classes, seq_len)
    if path:
        model.load_state_dict(torch.load(path, weights_only=True))
    return model


class UnitGPT(GPT):
    """nanoGPT's shape, untied, whose units are initialised by ``init_unit``: each reads its own tensors from
    ``path``."""

    def __init__(self, path: str, **kwargs):
        super().__init__(tie=False, **kwargs)
        self.path = path

    def init_unit(self, name: str, unit: nn.Module) -> None:
        state = torch.load(self.path, weights_only=True, mmap=True)
        for key, tensor in unit.state_dict(keep_vars=True).items():
            tensor.copy_(state[f"{name}.{key}"])


def unit_gpt(num_classes: int = VOCAB, seq_len: int = SEQ, path: str = "") -> UnitGPT:
    return UnitGPT(path, vocab_size=num_classes, block_size=seq_len)


def write_state(path: str | Path, seed: int = 1, tie: bool = True) -> Path:
    """A nanoGPT state_dict file with weights drawn from ``seed`` (``tie``: for ``nanogpt``, else ``unit_gpt``)."""
    torch.manual_seed(seed)
    torch.save(GPT(tie=tie).state_dict(), path)
    return Path(path)
