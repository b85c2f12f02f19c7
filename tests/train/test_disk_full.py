"""A full disk (or a read-only one) while a checkpoint or --save-model is written, on a real small tmpfs this
test mounts: one error line naming the directory, the bytes needed and free; the previous checkpoint stays
`latest` and intact; nothing partial is left; --on-checkpoint-error warn goes on. Needs root (mount)."""

import io
import os
import re
import shutil
import subprocess

import pytest
import torch

from polytrain.errors import CheckpointError
from polytrain.train.checkpoint import Checkpointer
from polytrain.train.files import estimate_bytes
from polytrain.train.integrity import verify
from tests.helpers.cli_batch import run_here

PAGE = 4096  # tmpfs counts whole pages
# a 2-worker sync checkpoint of this model is about 187 kB, so a 300 kB tmpfs holds the first one and not the second
COMMON = ["--data", "digits", "--model", "mlp:hidden=256", "--batch-size", "32", "--steps", "30", "--progress", "off",
          "--eval-every", "0", "--checkpoint-every", "10"]
NO_ROOM = re.compile(r"checkpoint step-00000020\.pt: no space left on device in (\S+) \(needs about (\d+) kB, "
                     r"(\d+) kB free\)")


@pytest.fixture
def small_fs(tmp_path):
    """``mount(size)``: a tmpfs of ``size`` bytes at a fresh directory, unmounted after the test."""
    mounted = []

    def mount(size: int, name: str = "small"):
        where = tmp_path / name
        where.mkdir()
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs needs root")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], check=True)


def _train(capfd, monkeypatch, *args):
    """The command's main in this process; its workers forked from this process (POLYTRAIN_START_METHOD=fork: no
    fresh import of torch), so that what they write is captured with the command's own output."""
    monkeypatch.setenv("POLYTRAIN_START_METHOD", "fork")
    return run_here(capfd, "train", *COMMON, *args)


def _only_the_first_checkpoint(directory):
    names = {p.name for p in directory.iterdir()}
    assert names - {"polytrain.lock"} == {"latest", "step-00000010.pt", "step-00000010.json"}, names
    assert (directory / "latest").read_text().strip() == "step-00000010.pt"
    assert verify(directory / "step-00000010.pt").verified


def test_a_checkpoint_that_does_not_fit_stops_the_run_with_one_line_and_the_previous_one_stays_latest(
        small_fs, capfd, monkeypatch):
    directory = small_fs(300 * 1024) / "c10"
    done = _train(capfd, monkeypatch, "--strategy", "sync", "--workers", "2", "--checkpoint-dir", str(directory))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("polytrain: error: [rank 0] checkpoint step-00000020.pt: no space left on device")
    assert line.endswith("; free space or give another --checkpoint-dir")
    where, needed, free = NO_ROOM.search(line).groups()
    assert where == str(directory) and int(needed) > int(free) > 0
    assert int(needed) >= 187  # the checkpoint's size, about
    _only_the_first_checkpoint(directory)
    inspect = run_here(capfd, "checkpoint", "inspect", str(directory))
    assert inspect.returncode == 0, inspect.stderr
    assert "latest -> step-00000010.pt" in inspect.stdout
    assert "ok, size and SHA-256 match its manifest" in inspect.stdout


def test_a_sharded_checkpoint_that_does_not_fit_is_one_line_and_leaves_no_part(small_fs, capfd, monkeypatch):
    """fsdp: each rank writes its part; one part the disk refuses undoes every part of that step."""
    directory = small_fs(300 * 1024) / "c10"
    done = _train(capfd, monkeypatch, "--strategy", "fsdp", "--workers", "2", "--checkpoint-dir", str(directory))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    assert re.match(r"polytrain: error: \[rank \d\] checkpoint step-00000020\.pt: part \d of 2: no space left on "
                    r"device in \S+ \(needs about \d+ kB, \d+ kB free\); free space or give another --checkpoint-dir$",
                    line), line
    names = {p.name for p in directory.iterdir()}
    assert names - {"polytrain.lock"} == {"latest", "step-00000010.pt", "step-00000010.json",
                                          "step-00000010.part-0-of-2.pt", "step-00000010.part-1-of-2.pt"}, names
    assert (directory / "latest").read_text().strip() == "step-00000010.pt"
    assert verify(directory / "step-00000010.pt").verified


def test_with_on_checkpoint_error_warn_the_run_goes_on_and_tries_every_checkpoint(small_fs, capfd, monkeypatch):
    directory = small_fs(300 * 1024) / "c10"
    done = _train(capfd, monkeypatch, "--strategy", "single", "--checkpoint-dir", str(directory),
                  "--on-checkpoint-error", "warn")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "done: 30 steps" in done.stdout
    warnings = [line for line in done.stdout.splitlines() if line.startswith("warning: checkpoint ")]
    assert [w.split(":")[1].strip() for w in warnings] == ["checkpoint step-00000020.pt",
                                                           "checkpoint step-00000030.pt"], done.stdout
    for warning in warnings:
        assert "no space left on device in " + str(directory) in warning
        assert warning.endswith("going on without it (--on-checkpoint-error warn), the next checkpoint tries again")
    _only_the_first_checkpoint(directory)


def test_a_model_that_does_not_fit_is_one_line(small_fs, capfd, monkeypatch, tmp_path):
    small = small_fs(64 * 1024)
    done = _train(capfd, monkeypatch, "--strategy", "single", "--checkpoint-dir", str(tmp_path / "ckpt"),
                  "--save-model", str(small / "model.pt"))
    assert done.returncode == 1, done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    assert re.fullmatch(rf"polytrain: error: cannot write {re.escape(str(small / 'model.pt'))}: no space left on "
                        rf"device in {re.escape(str(small))} \(needs about \d+ kB, \d+ kB free\); free space or "
                        "give another path", line), line
    assert os.listdir(small) == []


# -- the Checkpointer on a tmpfs left with exactly so many free pages: each step of a save failing -------


def _pages(n):
    return -(-n // PAGE)


def _model_where_the_file_needs_a_page_more_than_the_estimate():
    """A state whose estimate fits in fewer pages than its file: the free-space check passes, the write fails."""
    for floats in range(30000, 31100, 8):
        state = {"model": {"w": torch.arange(floats, dtype=torch.float32)}}
        full = {"format": "polytrain.checkpoint/1", "step": 2, **state}
        buffer = io.BytesIO()
        torch.save(full, buffer)
        if _pages(estimate_bytes(full)) < _pages(buffer.getbuffer().nbytes):
            return state, estimate_bytes(full), buffer.getbuffer().nbytes
    raise AssertionError("no such model size")


def _leave_free(directory, pages):
    free = shutil.disk_usage(directory).free
    assert free >= pages * PAGE
    with open(directory / "filler", "wb") as fh:
        fh.write(b"\0" * (free - pages * PAGE))
    assert shutil.disk_usage(directory).free == pages * PAGE


@pytest.mark.parametrize("fails", ["the file mid-write", "its manifest", "the latest pointer"])
def test_whichever_write_fails_the_previous_checkpoint_stays_latest_and_nothing_is_left(small_fs, fails):
    fs = small_fs(1024 * 1024)
    directory = fs / "ckpt"
    state, estimate, size = _model_where_the_file_needs_a_page_more_than_the_estimate()
    checkpointer = Checkpointer(directory)
    checkpointer.save({"model": {"w": torch.zeros(10)}}, 1)
    before = sorted(os.listdir(directory))
    free_pages = {"the file mid-write": _pages(estimate), "its manifest": _pages(size),
                  "the latest pointer": _pages(size) + 1}[fails]
    _leave_free(fs, free_pages)
    with pytest.raises(CheckpointError) as caught:
        checkpointer.save(state, 2)
    message = str(caught.value)
    assert message.startswith(f"checkpoint step-00000002.pt: no space left on device in {directory} (needs ")
    assert message.endswith("; free space or give another --checkpoint-dir")
    needed, free = map(int, re.search(r"\(needs about (\d+) kB, (\d+) kB free\)", message).groups())
    assert needed > free == round(free_pages * PAGE / 1000)
    assert "\n" not in message
    assert sorted(os.listdir(directory)) == before
    assert (directory / "latest").read_text().strip() == "step-00000001.pt"
    assert verify(directory / "step-00000001.pt").verified
    (fs / "filler").unlink()  # room again: the next save goes through
    assert checkpointer.save(state, 3) == directory / "step-00000003.pt"
    assert verify(directory / "step-00000003.pt").verified


def test_a_read_only_file_system_is_one_line_and_warn_returns_none(small_fs):
    fs = small_fs(256 * 1024)
    checkpointer = Checkpointer(fs, on_error="warn")
    checkpointer.save({"model": {"w": torch.zeros(10)}}, 1)
    subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
    assert checkpointer.save({"model": {"w": torch.ones(10)}}, 2) is None
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint step-00000002.pt: read-only file system in "
                                                        f"{fs} (EROFS); check the disk or give another "
                                                        "--checkpoint-dir")):
        Checkpointer(fs).save({"model": {"w": torch.ones(10)}}, 2)
    assert sorted(os.listdir(fs)) == ["latest", "step-00000001.json", "step-00000001.pt"]


def test_an_error_that_is_not_the_disks_keeps_its_traceback_and_leaves_nothing(tmp_path):
    checkpointer = Checkpointer(tmp_path)
    with pytest.raises(Exception) as caught:
        checkpointer.save({"model": {"w": torch.zeros(10)}, "bad": lambda: None}, 1)  # cannot be pickled
    assert not isinstance(caught.value, CheckpointError)
    assert os.listdir(tmp_path) == []


def test_a_hugging_face_directory_that_does_not_fit_is_one_line_and_leaves_nothing(small_fs):
    import polytrain

    small = small_fs(PAGE)  # one page: the model's 4.9 kB of tensors do not fit
    with pytest.raises(CheckpointError, match=rf"^--save-model {re.escape(str(small))}/out: cannot write the model "
                                              r"there \(No space left on device\); free space or give another path$"):
        polytrain.fit(strategy="single", data="digits", model="mlp:hidden=16", steps=1, batch_size=32,
                      progress="off", eval_every=0, save_model=str(small / "out"))
    assert os.listdir(small / "out") == []  # no shard left under its temporary name, no index
