"""``--lora`` on PEFT with a transformers Llama loaded by ``from_pretrained`` from a directory the test writes:
``single`` and ``fsdp 2`` train the same adapters, the optimizer holds the adapters only, the export is PEFT's
format (``PeftModel.from_pretrained`` loads it) and the merged model gives the adapted model's logits; bad
``--lora`` settings are one line before launch."""

from __future__ import annotations

import random

import pytest
import torch

import polytrain
from polytrain.config import make_config
from polytrain.errors import ConfigError
from polytrain.models.lora import check_lora
from tests.helpers import zoo
from tests.helpers.threads import one_thread

pytest.importorskip("transformers")
pytest.importorskip("peft")
safetensors = pytest.importorskip("safetensors.torch")

LLAMA = "tests.helpers.zoo:llama"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One run each of single and fsdp 2 (SGD, 3 steps) with adapters on q_proj and v_proj."""
    root = tmp_path_factory.mktemp("lora")
    pretrained = zoo.write_pretrained("llama", root / "llama", seed=7)
    rng = random.Random(0)
    text = root / "words.txt"
    text.write_text(" ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat", "dog", "ran"]) for _ in range(700)))
    common = dict(model=LLAMA, model_args={"path": str(pretrained)}, data=f"text:file={text},seq_len=16",
                  batch_size=8, steps=3, optimizer="adam", lr=0.01, seed=3, progress="off", eval_every=0,
                  timeout=120, lora="r=4,alpha=8,targets=q_proj|v_proj")
    out = {"pretrained": pretrained}
    for name, strategy in (("single", dict(strategy="single")), ("fsdp", dict(strategy="fsdp", workers=2))):
        saved = root / name
        with one_thread():  # (single runs in this process)
            summary = polytrain.fit(**common, **strategy, save_model=str(saved), merge_lora=name == "single")
        out[name] = (summary, saved)
    return out


@pytest.mark.slow
def test_single_and_fsdp_train_the_same_adapters_and_only_they_are_in_the_optimizer(runs):
    single, fsdp = (safetensors.load_file(str(runs[n][1] / "adapter_model.safetensors")) for n in ("single", "fsdp"))
    assert sorted(single) == sorted(fsdp) and len(single) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
    assert all(k.startswith("base_model.model.model.layers.") and ".lora_" in k for k in single)
    for key, value in single.items():
        torch.testing.assert_close(fsdp[key], value, rtol=0, atol=1e-5, msg=key)
    assert all(v.abs().max() > 0 for k, v in single.items() if "lora_B" in k)  # B starts at zero: it trained
    # Adam's state of the adapters alone: exp_avg and exp_avg_sq of each, and its step (a float32 scalar)
    adam_bytes = sum(2 * v.numel() * 4 + 4 for v in single.values())
    assert runs["single"][0]["rank_memory_bytes"][0]["optimizer"] == adam_bytes


@pytest.mark.slow
def test_the_export_loads_in_peft_and_the_merged_model_gives_the_same_logits(runs):
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    saved = runs["single"][1]
    tokens = torch.randint(0, zoo.VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = LlamaForCausalLM.from_pretrained(runs["pretrained"]).eval()
        before = base(tokens).logits
        adapted = PeftModel.from_pretrained(base, saved).eval()(tokens).logits
        merged = LlamaForCausalLM.from_pretrained(runs["pretrained"]).eval()
        merged.load_state_dict(torch.load(saved / "merged.pt", weights_only=True))
        after = merged(tokens).logits
    assert (adapted - before).abs().max() > 1e-4  # the adapters change the model
    torch.testing.assert_close(after, adapted, rtol=0, atol=1e-5)


def test_bad_lora_settings_are_one_line_before_launch():
    def check(**settings):
        return check_lora(make_config(**{"model": LLAMA, "data": "text:seq_len=16", **settings}))

    assert check(lora="r=4").r == 4 and check(lora="r=4").alpha == 8  # PEFT's default targets for a Llama
    for lora, message in [("r=0", "r must be >= 1"), ("alpha=2", "the rank r is missing"),
                          ("r=4,rank=2", "'rank=2' is not a setting of it"), ("r=x", "r must be a whole number")]:
        with pytest.raises(ConfigError, match=f"^--lora: {lora}: {message}"):
            check(lora=lora)
    with pytest.raises(ConfigError, match="^--lora targets=qkv: no layer of the model has such a name; its layers "
                                          "are named like model.layers.0.self_attn.q_proj"):
        check(lora="r=4,targets=qkv")
    with pytest.raises(ConfigError, match="^--lora with --strategy pipeline: LoRA adapters train under single, "
                                          "sync, fsdp"):
        check(lora="r=4", strategy="pipeline", stages=2)
    with pytest.raises(ConfigError, match="^--lora with --init-from or --model hf:DIR is not supported yet"):
        check(lora="r=4", model="hf:/nowhere")
    with pytest.raises(ConfigError, match="^--lora: which layers to adapt. give targets=NAME.NAME .the last parts of "
                                          "layer names, e.g. transformer.h.0.attn.c_attn"):  # no PEFT default for it
        check(lora="r=4", model="tests.helpers.zoo:nanogpt")
    with torch.device("meta"):
        gpt2 = zoo.gpt2()
    gpt2_run = make_config(model=LLAMA, data="text:seq_len=16", lora="r=4,targets=wte")
    with pytest.raises(ConfigError, match=r"^--lora: transformer.wte \(Embedding\): LoRA adapts nn.Linear \(and "
                                          r"transformers' Conv1D\) layers only here"):
        check_lora(gpt2_run, gpt2)
    gpt2_run.lora.lora = "r=4,targets=c_attn|lm_head"
    with pytest.raises(ConfigError, match="^--lora: the targets mix nn.Linear and Conv1D layers"):
        check_lora(gpt2_run, gpt2)
    with pytest.raises(ConfigError, match="^--merge-lora merges LoRA adapters; give --lora"):
        check(merge_lora=True)
    with pytest.raises(ConfigError, match="^--merge-lora writes the merged model with --save-model DIR"):
        check(lora="r=4", merge_lora=True)
