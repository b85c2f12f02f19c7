"""``--init-from PATH`` and ``--model hf:DIR``: a Hugging Face directory, a polytrain checkpoint directory (one file
or parts) and a state_dict file read by any block of a tensor; what cannot be used is one line before anything
starts. (Runs that start from such weights: tests/weights/test_export.py, test_resume_rows.py.)"""

from __future__ import annotations

import importlib.util
import shutil
import sys

import pytest
import torch

import polytrain
from polytrain.config import make_config
from polytrain.errors import ConfigError
from polytrain.models.registry import model_modules
from polytrain.train.checkpoint import load_checkpoint
from polytrain.train.run import check
from polytrain.weights.opening import open_weights
from tests.weights.conftest import LM

transformers = pytest.importorskip("transformers")
from tests.weights.hf_dirs import save_tiny_llama  # noqa: E402



@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("hf") / "llama")


def test_sources_read_any_block_of_a_tensor_from_every_kind_of_file(llama, lm_parts, tmp_path):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(llama).state_dict()
    source = open_weights(llama)  # (read from the files' bytes, never mapped: a mapping counts against a limit)
    assert len(list(llama.glob("model-*-of-*.safetensors"))) > 1  # several shards and their index
    assert {k: tuple(v[0]) for k, v in source.tensors().items()} == {k: tuple(v.shape) for k, v in reference.items()
                                                                     if "inv_freq" not in k}
    name = "model.layers.1.mlp.up_proj.weight"  # 64 x 32
    assert torch.equal(source.read(name, (slice(10, 20), slice(4, 8))), reference[name][10:20, 4:8])
    assert source.bytes_read == 10 * 4 * 4
    saved = load_checkpoint(lm_parts / "step-00000002.pt")["model"]  # put together whole, as export does
    from_parts = open_weights(lm_parts)
    for key, value in saved.items():  # rows across the two parts' boundary, and a part's own
        rows = slice(value.shape[0] // 2 - 1, value.shape[0]) if value.dim() else None
        assert torch.equal(from_parts.read(key, (rows,) if rows else None), value[rows] if rows else value), key
    torch.save(saved, tmp_path / "sd.pt")
    # the transformers modules a worker imports before its --memory-limit counts (its baseline, as torch)
    modules = model_modules(make_config(model=f"hf:{llama}"))
    assert modules[-1] == "transformers.models.llama.modeling_llama" and all(importlib.util.find_spec(m)
                                                                             for m in modules)
    assert torch.equal(open_weights(tmp_path / "sd.pt").read("head.out.weight"), saved["head.out.weight"])


def test_weights_that_cannot_be_used_are_one_line_before_anything_starts(llama, lm_parts, tmp_path, monkeypatch):
    def refused(pattern, **settings):
        with pytest.raises(ConfigError, match=pattern):
            check(make_config(**{**LM, **settings}))

    refused(r"^--init-from .*nowhere: no such file or directory; give a Hugging Face model directory "
            r"\(config\.json and model\*\.safetensors\), a polytrain --checkpoint-dir, or a state_dict file",
            init_from=str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    refused(r"^--init-from .*empty: no \*\.safetensors file in this directory \(it holds config\.json\)",
            init_from=str(tmp_path / "empty"))
    (tmp_path / "garbage.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    refused(r"^--init-from .*garbage\.safetensors: garbage\.safetensors is not a safetensors file polytrain can read",
            init_from=str(tmp_path / "garbage.safetensors"))
    (tmp_path / "garbage.pt").write_bytes(b"not a torch file")
    refused(r"^--init-from .*garbage\.pt: cannot be read as a state_dict \(", init_from=str(tmp_path / "garbage.pt"))
    torch.save([1, 2], tmp_path / "list.pt")
    refused(r"^--init-from .*list\.pt: holds no state_dict \(tensors by name\)", init_from=str(tmp_path / "list.pt"))
    cut = tmp_path / "cut"
    cut.mkdir()
    for item in llama.iterdir():
        if item.name != "model-00002-of-00007.safetensors":
            (cut / item.name).write_bytes(item.read_bytes())
    refused(r"^--init-from .*cut: model\.safetensors\.index\.json names model-00002-of-00007\.safetensors, which is "
            r"not in the directory; copy the whole model directory", init_from=str(cut))
    damaged = tmp_path / "damaged"
    shutil.copytree(lm_parts, damaged)
    part = next(damaged.glob("step-00000002.part-1-of-2.pt"))
    part.write_bytes(part.read_bytes()[:-10] + b"0123456789")
    refused(r"^--init-from .*damaged: none of the 1 checkpoint\(s\) in .*damaged can be used: step-00000002\.pt has "
            r"a corrupted part step-00000002\.part-1-of-2\.pt", init_from=str(damaged))
    refused(r"^--model hf:.*empty: transformers cannot build a causal language model from its config\.json",
            model=f"hf:{tmp_path / 'empty'}")
    refused(r"^--model hf:.*nowhere: .*nowhere is not a directory", model=f"hf:{tmp_path / 'nowhere'}")
    wrong = {k: v[:, :8] if k == "head.out.weight" else v
             for k, v in polytrain.models.build_model("transformer_lm:layers=2,dim=32,heads=2",
                                                      input_shape=(16,), num_classes=256).state_dict().items()}
    wrong["extra"] = torch.zeros(1)
    del wrong["embed.tokens.weight"]
    torch.save(wrong, tmp_path / "wrong.pt")
    with pytest.raises(ConfigError, match=r"^--init-from .*wrong\.pt does not fit the model \(shapes differ: "
                                          r"head\.out\.weight is 256x8 there, 256x32 in the model; missing 1: "
                                          r"embed\.tokens\.weight; unexpected 1: extra\); give the weights of this"):
        polytrain.fit(**LM, strategy="single", steps=1, init_from=str(tmp_path / "wrong.pt"))
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    refused(r"^--model hf:DIR needs the transformers package: pip install 'polytrain\[interop\]'",
            model=f"hf:{llama}")
