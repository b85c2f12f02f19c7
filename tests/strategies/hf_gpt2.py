"""A user factory returning a Hugging Face GPT-2 with tied embeddings (``lm_head.weight`` is
``transformer.wte.weight``), ``--model tests.strategies.hf_gpt2:gpt2``: built from a config, offline (no
download), a byte vocabulary, dropout off (so every strategy draws the same numbers). Imported only where
``transformers`` is installed."""

from __future__ import annotations

from transformers import GPT2Config, GPT2LMHeadModel


def gpt2(num_classes: int = 256, seq_len: int = 16, layers: int = 4, dim: int = 32) -> GPT2LMHeadModel:
    config = GPT2Config(n_layer=layers, n_embd=dim, n_head=2, vocab_size=num_classes, n_positions=seq_len,
                        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    return model


class _Branchy(GPT2LMHeadModel):
    """Its forward takes a branch on its inputs' values: torch.export cannot trace it into one graph."""

    def forward(self, input_ids=None, **kwargs):
        if input_ids.sum() > 0:
            input_ids = input_ids.flip(1)
        return super().forward(input_ids, **kwargs)


def branchy(num_classes: int = 256, seq_len: int = 16) -> GPT2LMHeadModel:
    model = gpt2(num_classes, seq_len, layers=2)
    model.__class__ = _Branchy
    return model
