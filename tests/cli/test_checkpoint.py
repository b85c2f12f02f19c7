"""`polytrain checkpoint inspect|export` and `train --resume` past a damaged checkpoint, as a user runs them
(inspect and export, which start no worker, through the command's ``main`` in this process)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import polytrain
from polytrain.models.registry import build_model
from polytrain.train.checkpoint import load_checkpoint
from tests.helpers.cli_batch import fit_settings, run_here

TRAIN = ["--strategy", "sync", "--workers", "2", "--model", "mlp:hidden=32", "--data", "digits", "--batch-size", "32",
         "--seed", "2", "--checkpoint-every", "10", "--eval-every", "0", "--log-every", "1", "--progress", "off"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A sync run on 2 workers, checkpointed at steps 10 and 20, whose model at step 20 is also --save-model's (in
    this process, whose forkserver then starts the workers of the runs after)."""
    out = tmp_path_factory.mktemp("run")
    polytrain.fit(**fit_settings(TRAIN), steps=20, checkpoint_dir=str(out / "ckpt"), save_model=str(out / "model.pt"),
                  metrics_file=str(out / "whole.jsonl"))
    return out


def _flipped_copy(run, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(run / "ckpt", ckpt)
    newest = ckpt / "step-00000020.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01
    newest.write_bytes(bytes(data))
    return ckpt


def test_inspect_lists_every_checkpoint_and_what_the_newest_holds(run, capsys):
    proc = run_here(capsys, "checkpoint", "inspect", str(run / "ckpt"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"{run / 'ckpt'}: 2 checkpoint(s); latest -> step-00000020.pt"
    assert lines[1].startswith("  step-00000010.pt") and "ok, size and SHA-256 match its manifest" in lines[1]
    assert lines[2].startswith("  step-00000020.pt") and lines[2].endswith("<- latest")
    assert lines[3] == "step-00000020.pt (the newest good one):"
    assert "  step 20, strategy sync, world size 2" in lines
    assert "  data position: epoch 0, batch 20 of it (global batch 32; example 640 of the epoch's 1408); data digits" \
        in lines
    assert any(line.split() == ["1.weight", "32x64", "float32", "8.0", "KiB"] for line in lines), proc.stdout
    assert any(line.startswith("  optimizer: ") for line in lines)
    assert lines[-1].startswith("  tensors in all: ") and "; file " in lines[-1]


def test_export_writes_the_model_that_save_model_wrote(run, tmp_path, capsys):
    proc = run_here(capsys, "checkpoint", "export", str(run / "ckpt"), str(tmp_path / "exported.pt"))
    assert proc.returncode == 0, proc.stderr
    assert f"the model of step 20 (4 tensors, pt) from {run / 'ckpt' / 'step-00000020.pt'}" in proc.stdout
    exported = torch.load(tmp_path / "exported.pt", weights_only=True)
    saved = torch.load(run / "model.pt", weights_only=True)
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved)
    build_model("mlp:hidden=32", input_shape=(1, 8, 8), num_classes=10).load_state_dict(exported)  # strict


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """An fsdp run on 2 workers: its checkpoint written in parts, and its --save-model."""
    out = tmp_path_factory.mktemp("sharded")
    polytrain.fit(**fit_settings(["--strategy", "fsdp", *TRAIN[2:]]), steps=4, checkpoint_dir=str(out / "ck"),
                  save_model=str(out / "model.pt"))
    return out


def _export_equals_saved(sharded, capsys, path, reader, kind):
    out = run_here(capsys, "checkpoint", "export", str(sharded / "ck"), str(path))
    assert out.returncode == 0, out.stderr
    assert f"(4 tensors, {kind})" in out.stdout
    exported, saved = reader(path), torch.load(sharded / "model.pt", weights_only=True)
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved)
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as open() makes a file (0644), safetensors' too


def test_a_sharded_runs_parts_are_inspected_and_exported_in_singles_layout(sharded, tmp_path, capsys):
    """fsdp writes its checkpoint in parts; inspect counts their bytes and checksums, export puts the model
    together in single's layout, equal to --save-model's."""
    inspect = run_here(capsys, "checkpoint", "inspect", str(sharded / "ck"))
    assert inspect.returncode == 0, inspect.stderr
    assert "ok, size and SHA-256 match its manifest (and its 2 parts')" in inspect.stdout
    assert inspect.stdout.splitlines()[-1].endswith("written by 2 ranks in parts, each its shard")
    _export_equals_saved(sharded, capsys, tmp_path / "m.pt", lambda p: torch.load(p, weights_only=True), "pt")


def test_a_sharded_runs_parts_are_exported_as_safetensors(sharded, tmp_path, capsys):
    safetensors = pytest.importorskip("safetensors.torch")
    _export_equals_saved(sharded, capsys, tmp_path / "m.safetensors", safetensors.load_file, "safetensors")


def test_inspect_and_export_pass_over_a_corrupted_checkpoint(run, tmp_path, capsys):
    ckpt = _flipped_copy(run, tmp_path)
    inspect = run_here(capsys, "checkpoint", "inspect", str(ckpt))
    assert inspect.returncode == 0, inspect.stderr
    assert "step-00000020.pt" in inspect.stdout and "BAD: is corrupted: its SHA-256 is " in inspect.stdout
    assert "step-00000010.pt (the newest good one):" in inspect.stdout
    export = run_here(capsys, "checkpoint", "export", str(ckpt), str(tmp_path / "m.pt"))
    assert export.returncode == 0, export.stderr
    assert f"polytrain: warning: checkpoint {ckpt / 'step-00000020.pt'} is corrupted: " in export.stderr
    exported = torch.load(tmp_path / "m.pt", weights_only=True)
    at_10 = load_checkpoint(ckpt / "step-00000010.pt")["model"]
    assert all(torch.equal(exported[k], at_10[k]) for k in at_10)
    named = run_here(capsys, "checkpoint", "export", str(ckpt), str(tmp_path / "x.pt"), "--step", "20")
    assert named.returncode == 2 and not (tmp_path / "x.pt").exists()
    assert len(named.stderr.strip().splitlines()) == 1
    assert named.stderr.startswith(f"polytrain: error: checkpoint {ckpt / 'step-00000020.pt'} is corrupted: ")
    unknown = run_here(capsys, "checkpoint", "inspect", str(ckpt), "--step", "7")
    assert unknown.returncode == 2
    assert unknown.stderr == f"polytrain: error: {ckpt}: no checkpoint of step 7 (steps: 10, 20)\n"


def test_a_directory_without_a_good_checkpoint_is_one_line(run, tmp_path, capsys):
    ckpt = _flipped_copy(run, tmp_path)
    (ckpt / "step-00000010.pt").write_bytes(b"")
    for command in (["inspect", str(ckpt)], ["export", str(ckpt), str(tmp_path / "m.pt")]):
        proc = run_here(capsys, "checkpoint", *command)
        assert proc.returncode == 2
        assert len(proc.stderr.strip().splitlines()) == 1
        assert proc.stderr.startswith(f"polytrain: error: none of the 2 checkpoint(s) in {ckpt} can be used: "
                                      "step-00000020.pt is corrupted: its SHA-256 is ")
        assert "; step-00000010.pt is truncated: 0 bytes" in proc.stderr
    assert run_here(capsys, "checkpoint", "inspect", str(tmp_path / "empty")).stderr.strip() == \
        f"polytrain: error: {tmp_path / 'empty'}: no checkpoint there (no step-NNNNNNNN.pt file)"


def test_resume_on_two_workers_continues_from_the_previous_good_checkpoint(run, cli_env, tmp_path):
    """A command of its own: its workers' lines are its output (workers forked from this process's forkserver
    write where that server's output went when it started)."""
    ckpt = _flipped_copy(run, tmp_path)
    metrics = tmp_path / "resumed.jsonl"
    proc = subprocess.run([sys.executable, "-m", "polytrain", "train", *TRAIN, "--steps", "20", "--checkpoint-dir",
                           str(ckpt), "--resume", "--metrics-file", str(metrics)], env=cli_env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"warning: --resume: checkpoint {ckpt / 'step-00000020.pt'} is corrupted: its SHA-256 is " in proc.stdout
    assert f"resumed from step 10 ({ckpt / 'step-00000010.pt'})" in proc.stdout
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    whole = {r["step"]: r["loss"] for r in map(json.loads, (run / "whole.jsonl").read_text().splitlines())
             if r["event"] == "step"}
    resumed = {r["step"]: r["loss"] for r in steps if r["event"] == "step"}
    assert sorted(resumed) == list(range(11, 21)) and all(resumed[s] == whole[s] for s in resumed)


def test_export_of_a_checkpoint_without_a_model_or_to_an_unwritable_path_is_one_line(tmp_path, capsys):
    from polytrain.cli.main import main
    from polytrain.train.checkpoint import Checkpointer

    hand_made = Checkpointer(tmp_path / "no-model").save({"optimizer": {}}, 1)  # intact, but no model in it
    assert main(["checkpoint", "export", str(tmp_path / "no-model"), str(tmp_path / "m.pt")]) == 2
    assert capsys.readouterr().err == f"polytrain: error: checkpoint {hand_made} holds no model state_dict\n"
    Checkpointer(tmp_path / "ok").save({"model": {"w": torch.ones(2)}}, 1)
    out = tmp_path / "a-directory"
    out.mkdir()
    (out / "notes.txt").write_text("not a model's")  # (an empty directory, or a model's, takes a Hugging Face one)
    assert main(["checkpoint", "export", str(tmp_path / "ok"), str(out)]) == 2
    err = capsys.readouterr().err
    assert err == (f"polytrain: error: {out}: is a directory; give the path of the file to write (e.g. "
                   f"{out}/model.pt), or --format hf for a Hugging Face directory there\n")
    too_long = str(tmp_path / ("x" * 300 + ".pt"))  # no file system takes a 300-byte name
    assert main(["checkpoint", "export", str(tmp_path / "ok"), too_long]) == 2
    assert capsys.readouterr().err == f"polytrain: error: {too_long}: cannot write the model there (File name too long)\n"


def test_export_into_a_missing_directory_creates_nothing_and_is_one_line(tmp_path, capsys):
    from polytrain.cli.main import main
    from polytrain.train.checkpoint import Checkpointer

    Checkpointer(tmp_path / "ok").save({"model": {"w": torch.ones(2)}}, 1)
    missing = tmp_path / "missing" / "deeper"
    assert main(["checkpoint", "export", str(tmp_path / "ok"), str(missing / "m.pt")]) == 2
    assert capsys.readouterr().err == (f"polytrain: error: {missing / 'm.pt'}: its directory {missing} does not exist; "
                                       "create it first, or give a path in an existing directory\n")
    assert not (tmp_path / "missing").exists()
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert main(["checkpoint", "export", str(tmp_path / "ok"), str(a_file / "m.pt")]) == 2
    assert capsys.readouterr().err == (f"polytrain: error: {a_file / 'm.pt'}: {a_file} is a file, not a directory; "
                                       "give a path in an existing directory\n")
    assert main(["checkpoint", "export", str(tmp_path / "ok"), str(tmp_path / "m.pt")]) == 0  # an existing one
    assert torch.equal(torch.load(tmp_path / "m.pt", weights_only=True)["w"], torch.ones(2))


def test_inspect_into_a_closed_pipe_ends_quietly(run, cli_env):
    """`polytrain checkpoint inspect DIR | head -1`: the reader goes away; no BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "polytrain", "checkpoint", "inspect", str(run / "ckpt")],
                            env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before it writes a line: every write finds no reader
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
