"""The model comes and leaves as it came: ``--model hf:DIR`` starts fsdp from the directory's weights, each rank
reading its rows; ``--save-model DIR`` and ``polytrain checkpoint export`` write a Hugging Face directory (config,
``model-0000K-of-0000N.safetensors`` shards, their index) that ``from_pretrained`` loads with no missing keys,
one tensor at a time; the safetensors files are the format's own (``safe_open`` reads them)."""

from __future__ import annotations

import json

import pytest
import torch

from polytrain.config import make_config
from polytrain.train.checkpoint import load_checkpoint
from polytrain.weights.safetensors_file import Entry, SafetensorsFile, plan_shards
from tests.helpers.cli_batch import run_here
from tests.helpers.spawn import spawn


def test_a_file_written_one_tensor_at_a_time_is_what_safetensors_reads(tmp_path):
    safetensors = pytest.importorskip("safetensors")
    tensors = {"w": torch.randn(3, 5), "half": torch.randn(7, dtype=torch.bfloat16), "ids": torch.arange(4),
               "flag": torch.tensor([True, False]), "scalar": torch.tensor(2.5)}
    out = SafetensorsFile(tmp_path / "x.safetensors", [Entry(k, tuple(v.shape), v.dtype) for k, v in tensors.items()])
    for name in reversed(tensors):  # in any order: each at its place
        out.write(name, tensors[name])
    out.finish()
    with safetensors.safe_open(str(tmp_path / "x.safetensors"), framework="pt") as handle:
        assert set(handle.keys()) == set(tensors) and handle.metadata() == {"format": "pt"}
        for name, value in tensors.items():
            read = handle.get_tensor(name)
            assert read.dtype == value.dtype and torch.equal(read, value), name
    assert not list(tmp_path.glob(".*tmp"))  # nothing left under a temporary name


def test_shards_are_cut_by_size_and_by_who_can_write_them():
    entries = [Entry(f"t{i}", (10,), torch.float32) for i in range(6)]  # 40 bytes each
    assert [len(f) for f, _ in plan_shards(entries, max_bytes=100)] == [2, 2, 2]
    stages = [frozenset({0})] * 3 + [frozenset({1})] * 3  # a pipeline: each rank its stage's tensors
    planned = plan_shards(entries, max_bytes=10**6, writers=stages)
    assert [([e.name for e in f], set(w)) for f, w in planned] == [(["t0", "t1", "t2"], {0}), (["t3", "t4", "t5"], {1})]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """fsdp 2 runs one step at lr 0 of the tiny Llama of a Hugging Face directory (``--model hf:DIR``: its
    config and weights), checkpointing and saving it as a Hugging Face directory: what each rank read, and
    where."""
    pytest.importorskip("transformers")
    from tests.weights.hf_dirs import save_tiny_llama

    root = tmp_path_factory.mktemp("export")
    llama = save_tiny_llama(root / "llama")
    config = make_config(model=f"hf:{llama}", data="text:seq_len=16", batch_size=8, steps=1, lr=0.0,
                         optimizer="adam", seed=4, eval_every=0, progress="off", timeout=120, strategy="fsdp",
                         workers=2, checkpoint_dir=str(root / "ck"), save_model=str(root / "saved"),
                         save_shard_size="60KB")
    return root, spawn(_read_and_fit, 2, config)


def _read_and_fit(ctx, config):
    """This rank's bytes read of the weights while its part was made, of their whole; then the run."""
    from polytrain.models.deferred import weights_of
    from polytrain.train.trainer import Trainer

    trainer = Trainer(config, ctx.topology)
    source = weights_of(trainer.strategy.module)
    whole = sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in source.tensors().values())
    read = source.bytes_read
    trainer.fit()
    return read, whole


def test_an_hf_directory_trains_under_fsdp_each_rank_reading_its_rows(trained):
    root, read = trained
    for rank_read, whole in read:  # each rank read its rows of each parameter (the norms' small weights whole)
        assert rank_read < 0.6 * whole


def test_save_model_and_export_write_what_from_pretrained_loads(trained, capsys):
    from transformers import AutoModelForCausalLM

    root, _ = trained
    exported = run_here(capsys, "checkpoint", "export", str(root / "ck"), str(root / "exported"), "--shard-size",
                        "40KB")
    assert exported.returncode == 0, exported.stderr
    assert "(21 tensors, hf, " in exported.stdout and exported.stderr == ""
    saved_index = json.loads((root / "saved" / "model.safetensors.index.json").read_text())
    assert len(set(saved_index["weight_map"].values())) > 1  # shards of at most 60 KB, each rank writing its own
    assert (root / "saved" / "config.json").is_file() and (root / "exported" / "config.json").is_file()
    original = AutoModelForCausalLM.from_pretrained(root / "llama").state_dict()
    at_1 = load_checkpoint(root / "ck" / "step-00000001.pt")["model"]
    for directory in ("saved", "exported"):
        model, info = AutoModelForCausalLM.from_pretrained(root / directory, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (directory, info)
        state = model.state_dict()
        for key, value in at_1.items():  # lr 0: the directory's weights, through the checkpoint, bit for bit
            assert torch.equal(state[key], value) and torch.equal(value, original[key]), (directory, key)


def test_where_a_model_cannot_be_written_is_one_line_before_anything_starts(tmp_path, capsys):
    from polytrain.errors import ConfigError
    from polytrain.train.checkpoint import Checkpointer
    from polytrain.train.run import check
    from tests.weights.conftest import LM

    taken = tmp_path / "finetuned"  # a file where a Hugging Face directory is asked for
    taken.write_text("a file")
    with pytest.raises(ConfigError, match=rf"^--save-model {taken}: is a file; give a directory to write a Hugging "
                                          r"Face model into \(a path without a suffix, or ending in /\), or FILE\.pt"):
        check(make_config(**LM, save_model=str(taken)))
    with pytest.raises(ConfigError, match=r"^--save-shard-size: expected a size such as 600MiB, 2GB .*got 'lots'$"):
        check(make_config(**LM, save_model=str(tmp_path / "out"), save_shard_size="lots"))
    Checkpointer(tmp_path / "ck").save({"model": {"w": torch.ones(2)}, "step": 1}, 1)
    bad_size = run_here(capsys, "checkpoint", "export", str(tmp_path / "ck"), str(tmp_path / "out"), "--shard-size",
                        "lots")
    assert bad_size.returncode == 2 and bad_size.stderr.startswith("polytrain: error: --shard-size: expected a size")
    onto_a_file = run_here(capsys, "checkpoint", "export", str(tmp_path / "ck"), str(taken), "--format", "hf")
    assert onto_a_file.returncode == 2
    assert onto_a_file.stderr == f"polytrain: error: {taken}: is a file; give a directory to write the Hugging Face " \
                                 "model into\n"
    assert not (tmp_path / "out").exists()
