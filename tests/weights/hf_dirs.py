"""Tiny Hugging Face model directories the tests write themselves (no hub): a Llama (rotary embeddings, grouped-query
attention, untied head) saved by ``save_pretrained`` in several safetensors shards with their index."""

from __future__ import annotations

from pathlib import Path


def tiny_llama_config(vocab: int = 256):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def save_tiny_llama(directory: Path, seed: int = 7) -> Path:
    """A tiny Llama with weights from ``seed``, saved in shards of about 20 kB (several files and an index)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(directory, max_shard_size="20KB")
    return directory
