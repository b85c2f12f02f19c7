"""A user factory returning a Hugging Face ``transformers`` model, named ``--model tests.train.hf_factory:gpt2``.

Built from a config, offline (no hub download): random weights, byte vocabulary. Imported only where
``transformers`` is installed (the test skips otherwise).
"""

from __future__ import annotations

from transformers import GPT2Config, GPT2LMHeadModel


def gpt2(num_classes: int = 256, seq_len: int = 32) -> GPT2LMHeadModel:
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=num_classes, n_positions=seq_len,
                        # GPT-2's own ids (50256) lie outside a byte vocabulary; dropout off so that the
                        # workers' and single's random streams cannot differ
                        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # the loss it would pick anyway, named so that it does not warn
    return model
