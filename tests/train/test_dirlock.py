"""One run per --checkpoint-dir: the lock file polytrain.lock. Real runs: a second run on a directory in use is
refused with one line naming the first; a launcher killed with SIGKILL leaves the lock free (its workers never
hold it); a stale lock is taken over with one warning; `checkpoint inspect` names a live owner; what a killed
writer left is removed when the lock is taken. One endless run serves the tests that need a live owner (the last
of them kills it); commands that start no worker run through the command's ``main`` in this process."""

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from polytrain.errors import ConfigError
from polytrain.train.checkpoint import Checkpointer
from polytrain.train.dirlock import LOCK_NAME, DirLock, live_owner
from polytrain.train.integrity import verify
from tests.helpers.cli_batch import run_here
from tests.helpers.procs import alive, descendants

# a run that goes on until it is killed: 2 worker processes, a checkpoint every 20 steps
ENDLESS = ["--strategy", "sync", "--workers", "2", "--data", "digits", "--model", "mlp:hidden=16", "--batch-size",
           "32", "--steps", "100000000", "--checkpoint-every", "20", "--progress", "off", "--log-every", "1000000",
           "--eval-every", "0"]
SHORT = ["--strategy", "single", "--data", "digits", "--model", "mlp:hidden=16", "--batch-size", "32", "--steps",
         "4", "--progress", "off", "--eval-every", "0"]


class Endless:
    """The endless run, started, waited for until it holds the lock and wrote a checkpoint, and killed at the end."""

    def __init__(self, cli_env, directory, log):
        self.directory, self.log = directory, log
        with open(log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "polytrain", "train", *ENDLESS, "--checkpoint-dir",
                                          str(directory)], env=cli_env, stdout=out, stderr=subprocess.STDOUT)
        self.processes = [self.proc.pid]

    def wait_until_running(self):
        deadline = time.monotonic() + 240
        while not (self._owner_pid() == self.proc.pid and Checkpointer(self.directory).latest() is not None
                   and len(alive(descendants(self.proc.pid))) >= 3):  # the launcher and its 2 workers
            assert self.proc.poll() is None, f"the first run ended: {self.log.read_text()}"
            assert time.monotonic() < deadline, f"the first run did not start: {self.log.read_text()}"
            time.sleep(0.05)
        self.processes = descendants(self.proc.pid)

    def _owner_pid(self):
        try:
            return json.loads((self.directory / LOCK_NAME).read_text()).get("pid")
        except (OSError, ValueError):
            return None

    def kill(self):
        for pid in alive(self.processes):
            os.kill(pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture(scope="module")
def endless(module_cli_env, tmp_path_factory):
    """The endless run on its directory, holding the lock (the SIGKILL test, the last to use it, ends it)."""
    where = tmp_path_factory.mktemp("endless")
    run = Endless(module_cli_env, where / "ckpt", where / "endless.log")
    run.wait_until_running()
    yield run
    run.kill()


def _running(endless):
    assert endless.proc.poll() is None and endless._owner_pid() == endless.proc.pid, endless.log.read_text()
    return endless


def test_a_second_run_on_a_directory_in_use_is_refused_with_one_line_naming_the_first(endless, capsys):
    first = _running(endless)
    directory = first.directory
    second = run_here(capsys, "train", *SHORT, "--checkpoint-dir", str(directory))
    assert second.returncode == 2, second.stdout + second.stderr
    assert second.stdout == ""  # nothing started
    (line,) = second.stderr.splitlines()
    assert re.fullmatch(
        rf"polytrain: error: --checkpoint-dir {re.escape(str(directory))} is in use by another run \(host "
        rf"{re.escape(socket.gethostname())}, pid {first.proc.pid}, started \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d: "
        rf"python -m polytrain train --strategy sync .*--checkpoint-dir {re.escape(str(directory))}\); wait for it "
        r"to finish or stop it, or give another --checkpoint-dir", line), line
    assert first.proc.poll() is None and first._owner_pid() == first.proc.pid  # the first run goes on, holding it
    with pytest.raises(ConfigError, match="is in use by another run"):
        DirLock(directory).acquire()


def test_checkpoint_inspect_names_a_live_owner_without_taking_the_lock(endless, capsys):
    first = _running(endless)
    directory = first.directory
    shown = run_here(capsys, "checkpoint", "inspect", str(directory))
    assert shown.returncode == 0, shown.stderr
    head = shown.stdout.splitlines()[0]
    assert head.startswith(f"{directory}: in use by a live run (host {socket.gethostname()}, pid {first.proc.pid}, "
                           "started ")
    assert "python -m polytrain train --strategy sync" in head
    assert head.endswith("; it may write a newer checkpoint at any time")
    assert first.proc.poll() is None and first._owner_pid() == first.proc.pid


def test_a_launcher_killed_with_sigkill_leaves_the_lock_free_and_its_workers_never_held_it(endless, capsys):
    first = _running(endless)
    directory = first.directory
    lock = str(directory / LOCK_NAME)
    holders = {pid for pid in first.processes if lock in _open_files(pid)}
    assert holders == {first.proc.pid}, f"processes {sorted(first.processes)}, holding the lock: {sorted(holders)}"
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait()
    with DirLock(directory) as taken:  # at once: no worker outlives the launcher holding the lock
        assert json.loads((directory / LOCK_NAME).read_text())["pid"] == os.getpid() == taken.record["pid"]
    assert (directory / LOCK_NAME).read_text() == ""  # released: cleared, not deleted
    after = run_here(capsys, "checkpoint", "inspect", str(directory))
    assert after.returncode == 0, after.stderr
    assert "in use" not in after.stdout
    assert live_owner(directory) is None


def _open_files(pid):
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return set()
    found = set()
    for fd in fds:
        try:
            found.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return found


_DIES_HOLDING = """
import os, sys
from polytrain.train.dirlock import DirLock
DirLock(sys.argv[1]).acquire()
os._exit(0)  # without releasing: the record stays, the kernel drops the flock
"""


def _stale_lock(directory, cli_env):
    subprocess.run([sys.executable, "-c", _DIES_HOLDING, str(directory)], env=cli_env, check=True, timeout=120)
    return json.loads((directory / LOCK_NAME).read_text())


def test_a_stale_lock_is_taken_over_with_one_warning_naming_the_old_owner(cli_env, tmp_path, capsys):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    old = _stale_lock(directory, cli_env)
    done = run_here(capsys, "train", *SHORT, "--checkpoint-dir", str(directory))  # (single: no worker process)
    assert done.returncode == 0, done.stdout + done.stderr
    warnings = [line for line in done.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, done.stdout
    assert warnings[0] == (f"warning: --checkpoint-dir {directory}: taking over the lock of a run that is no longer "
                           f"running ({_described(old['pid'], old)})")
    assert old["command"] == f"-c {directory}" and old["host"] == socket.gethostname()
    assert (directory / LOCK_NAME).read_text() == ""
    assert verify(directory / "step-00000004.pt").verified


def test_what_a_killed_writer_left_is_removed_when_the_lock_is_taken(tmp_path):
    directory = tmp_path / "ckpt"
    Checkpointer(directory).save({"model": {"w": torch.ones(3)}}, 10)
    left = [".step-00000020.pt.4242.tmp", ".step-00000020.json.4242.tmp", ".latest.4242.tmp",
            ".model.pt.77.tmp", ".polytrain-probe-4242", "step-00000020.json"]  # the last: a manifest without its file
    kept = ["notes.txt", ".hidden", ".x.tmp", "step-00000030.txt"]
    for name in left + kept:
        (directory / name).write_text("x")
    with DirLock(directory):
        assert sorted(os.listdir(directory)) == sorted(kept + ["latest", "step-00000010.pt", "step-00000010.json",
                                                                LOCK_NAME])
    assert verify(directory / "step-00000010.pt").verified


def test_a_lock_file_that_cannot_be_written_is_one_line(tmp_path, capsys):
    directory = tmp_path / "ckpt"
    (directory / LOCK_NAME).mkdir(parents=True)
    done = run_here(capsys, "train", *SHORT, "--checkpoint-dir", str(directory))
    assert done.returncode == 2
    assert done.stderr == (f"polytrain: error: --checkpoint-dir {directory}: cannot write its lock file "
                           f"{directory / LOCK_NAME} (Is a directory); remove it or give another --checkpoint-dir\n")


def test_without_flock_the_record_decides(tmp_path, cli_env):
    """A file system without flock cannot be mounted here: the judgement of the record is checked on its own."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    no_flock = OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    lock = DirLock(directory)
    old = _stale_lock(directory, cli_env)  # this host, a pid that is gone: stale, taken over
    assert lock._without_flock(no_flock) == old
    (directory / LOCK_NAME).write_text(json.dumps({**old, "pid": os.getpid()}))  # this host, running
    with pytest.raises(ConfigError) as running:
        lock._without_flock(no_flock)
    assert str(running.value) == (
        f"--checkpoint-dir {directory} may be in use by another run ({_described(os.getpid(), old)}), which is "
        f"running; this file system cannot lock files (No locks available): if that run is over, delete "
        f"{directory / LOCK_NAME}, or give another --checkpoint-dir")
    (directory / LOCK_NAME).write_text(json.dumps({**old, "host": "elsewhere"}))
    with pytest.raises(ConfigError, match="which cannot be checked from this host; this file system cannot lock"):
        lock._without_flock(no_flock)
    (directory / LOCK_NAME).write_text("")
    assert lock._without_flock(no_flock) is None  # nobody named: free


def _described(pid, record):
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record["started"]))
    return f"host {record['host']}, pid {pid}, started {when}: {record['command']}"
