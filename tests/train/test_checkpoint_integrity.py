"""Checkpoint manifests, and --resume past a damaged or foreign checkpoint to the previous good one."""

import hashlib
import json
import shutil

import pytest
import torch

import polytrain
from polytrain.errors import ConfigError
from polytrain.train.checkpoint import Checkpointer, load_checkpoint
from polytrain.train.integrity import signature

RUN = dict(strategy="single", data="digits", batch_size=32, progress="off", log_every=1, eval_every=0, seed=3,
           checkpoint_every=10)
MODEL = "mlp:hidden=32"


def _losses(path):
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines()) if r["event"] == "step"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 20-step run checkpointed at 10 and 20, and a run of another model (hidden 16) checkpointed alike."""
    out = tmp_path_factory.mktemp("runs")
    polytrain.fit(model=MODEL, steps=20, checkpoint_dir=str(out / "ckpt"), metrics_file=str(out / "whole.jsonl"),
                  save_model=str(out / "model.pt"), **RUN)
    polytrain.fit(model="mlp:hidden=16", steps=20, checkpoint_dir=str(out / "other"), **RUN)
    return out


def _copy(runs, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(runs / "ckpt", target)
    return target


def _resume(directory, tmp_path, capsys, **overrides):
    metrics = tmp_path / "resumed.jsonl"
    polytrain.fit(**{**RUN, "model": MODEL, "steps": 20, "checkpoint_dir": str(directory),
                     "metrics_file": str(metrics), "resume": True, **overrides})
    return capsys.readouterr().out, _losses(metrics)


def test_a_run_writes_a_manifest_per_checkpoint(runs):
    state = torch.load(runs / "model.pt", weights_only=True)
    for step in (10, 20):
        pt = runs / "ckpt" / f"step-{step:08d}.pt"
        manifest = json.loads(pt.with_suffix(".json").read_text())
        assert manifest["file"] == pt.name and manifest["step"] == step
        assert manifest["size"] == pt.stat().st_size
        assert manifest["sha256"] == hashlib.sha256(pt.read_bytes()).hexdigest()
        assert manifest["strategy"] == "single" and manifest["world_size"] == 1
        assert manifest["format"] == "polytrain.manifest/1"
        assert manifest["checkpoint_format"] == "polytrain.checkpoint/1"
        assert manifest["model"]["tensors"] == signature(state)  # the trained model's names, shapes, dtypes
    assert (runs / "ckpt" / "latest").read_text().strip() == "step-00000020.pt"


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


def _foreign(runs, path):
    shutil.copy(runs / "other" / path.name, path)
    shutil.copy((runs / "other" / path.name).with_suffix(".json"), path.with_suffix(".json"))


def _foreign_without_manifest(runs, path):
    shutil.copy(runs / "other" / path.name, path)
    path.with_suffix(".json").unlink()


@pytest.mark.parametrize("damage, reason", [
    ("flip", "is corrupted: its SHA-256 is "),
    ("truncate", "is truncated: "),
    ("foreign", "holds another model (1.weight is 16x64 float32 there, 32x64 float32 in the model being resumed)"),
    ("foreign_no_manifest", "holds another model (1.weight is 16x64 float32 there, 32x64 float32 in the model"),
])
def test_resume_skips_a_bad_newest_checkpoint_for_the_previous_good_one(runs, tmp_path, capsys, damage, reason):
    ckpt = _copy(runs, tmp_path)
    newest = ckpt / "step-00000020.pt"
    {"flip": _flip_a_byte, "truncate": _truncate, "foreign": lambda p: _foreign(runs, p),
     "foreign_no_manifest": lambda p: _foreign_without_manifest(runs, p)}[damage](newest)
    out, resumed = _resume(ckpt, tmp_path, capsys)
    assert f"warning: --resume: checkpoint {newest} {reason}" in out, out
    assert "skipped for an earlier one" in out
    assert f"resumed from step 10 ({ckpt / 'step-00000010.pt'})" in out
    whole = _losses(runs / "whole.jsonl")
    assert sorted(resumed) == list(range(11, 21))
    assert all(resumed[s] == whole[s] for s in resumed), "the run continues exactly from the good checkpoint"
    assert load_checkpoint(newest)["step"] == 20  # the new step-20 checkpoint replaced the bad file


def test_no_good_checkpoint_left_is_one_error_naming_each(runs, tmp_path, capsys):
    ckpt = _copy(runs, tmp_path)
    _truncate(ckpt / "step-00000020.pt")
    _flip_a_byte(ckpt / "step-00000010.pt")
    with pytest.raises(ConfigError) as err:
        _resume(ckpt, tmp_path, capsys)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"--resume: none of the 2 checkpoint(s) in {ckpt} can be used: "
                              "step-00000020.pt is truncated: ")
    assert "; step-00000010.pt is corrupted: " in message and message.endswith("start afresh with another "
                                                                               "--checkpoint-dir")


def test_resuming_another_model_from_its_checkpoints_says_so(runs, tmp_path, capsys):
    expected = (r"can be used: step-00000020.pt holds another model \(1.weight is 32x64 float32 there, 16x64 "
                r"float32 .*; resume with the model they were made with")
    with pytest.raises(ConfigError, match=expected):
        _resume(_copy(runs, tmp_path), tmp_path, capsys, model="mlp:hidden=16")


def test_a_sound_checkpoint_made_with_other_settings_stays_an_error(runs, tmp_path, capsys):
    # same model, another optimizer: not a damaged file to skip, a mismatch the user must settle
    with pytest.raises(ConfigError, match=r"was made with a different optimizer; use the same settings"):
        _resume(_copy(runs, tmp_path), tmp_path, capsys, optimizer="adam")


def test_resume_without_a_checkpoint_dir_is_one_error():
    with pytest.raises(ConfigError, match=r"^--resume needs --checkpoint-dir DIR \(where the checkpoints are\)$"):
        polytrain.fit(model=MODEL, steps=1, resume=True, **{k: v for k, v in RUN.items() if k != "checkpoint_every"})


def test_checkpoints_without_a_manifest_still_resume_with_a_warning(runs, tmp_path, capsys):
    ckpt = _copy(runs, tmp_path)
    for manifest in ckpt.glob("*.json"):
        manifest.unlink()  # as an older polytrain left them
    out, resumed = _resume(ckpt, tmp_path, capsys, steps=25)
    assert (f"warning: --resume: checkpoint {ckpt / 'step-00000020.pt'} has no manifest (written before polytrain "
            "checked checkpoints): its integrity cannot be verified") in out
    assert sorted(resumed) == list(range(21, 26))


def test_a_copied_or_broken_manifest_is_caught(runs, tmp_path):
    ckpt = _copy(runs, tmp_path)
    shutil.copy(ckpt / "step-00000010.pt", ckpt / "step-00000030.pt")
    shutil.copy(ckpt / "step-00000010.json", ckpt / "step-00000030.json")
    (ckpt / "step-00000020.json").write_text("{not json")
    choice = Checkpointer(ckpt).choose()
    assert [v.problem.split(" (")[0] for v in choice.rejected] == [
        "has an unreadable manifest step-00000020.json",  # 'latest' is tried first
        "does not match its manifest step-00000030.json, which describes step-00000010.pt",
    ]
    assert choice.good.step == 10 and choice.good.verified
    with pytest.raises(ConfigError, match=rf"^checkpoint {ckpt / 'step-00000030.pt'} does not match its manifest"):
        load_checkpoint(ckpt / "step-00000030.pt")


def test_pruning_keeps_new_checkpoints_when_a_later_bad_one_remains(tmp_path):
    # after falling back from a bad step 30 to step 20, the resumed run's saves must not be pruned for it
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in (10, 20, 30):
        ckpt.save({"model": {"w": torch.full((2,), float(step))}}, step)
    for step in (25, 26):
        ckpt.save({"model": {"w": torch.zeros(2)}}, step)
    assert ckpt.steps() == [25, 26, 30]
    assert sorted(p.name for p in tmp_path.glob("*.json")) == [f"step-000000{s}.json" for s in (25, 26, 30)]
    assert ckpt.latest().name == "step-00000026.pt"
