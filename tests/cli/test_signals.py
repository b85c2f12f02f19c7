"""`polytrain train` stopped from outside, as a scheduler or a user stops it: SIGTERM (Slurm, Kubernetes), Ctrl-C
to the process group, a second signal, SIGKILL of the main process, a signal to one worker. Each time: no
process of the job is left (waited for up to :data:`HANG_S`: a hang, not a speed), the exit code says what
happened, and a run stopped with a checkpoint directory stops at the step its ranks agreed on (read from the
run's own record) and resumes bit for bit there."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from polytrain.train.checkpoint import Checkpointer
from polytrain.train.dirlock import LEFTOVER
from tests.helpers.cli_batch import run_here
from tests.helpers.procs import alive, catches, descendants, worker_rank
from tests.helpers.seed import draw

STEPS = 120
COMMON = ["--data", "digits", "--model", "mlp:hidden=16x16", "--batch-size", "32", "--steps", str(STEPS),
          "--progress", "off", "--eval-every", "0", "--lr", "0.05", "--log-every", "1", "--seed", "4"]
STRATEGIES = {
    "sync": ["--strategy", "sync", "--workers", "2"],
    # staleness 0: the servers apply each step's slices in slice order, so a resumed run is the same bit for bit
    "async": ["--strategy", "async", "--workers", "2", "--staleness", "0"],
    "pipeline": ["--strategy", "pipeline", "--stages", "2", "--microbatches", "2"],
}
HANG_S = 600.0  # how long any wait goes on before it is a hang: the job gone after a signal (about a second here),
#                a run to its end (seconds; minutes at a load of 30 on 2 cores)


def _start(args, env):
    return subprocess.Popen([sys.executable, "-m", "polytrain", "train", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _steps_logged(metrics):
    """The last step the run's metrics file holds so far: whole lines only (the run may be writing the next one)."""
    if not metrics.exists():
        return 0
    text = metrics.read_text()
    text = text[:text.rfind("\n") + 1]
    steps = [json.loads(line).get("step", 0) for line in text.splitlines() if line.strip()]
    return max([s for s in steps if isinstance(s, int)], default=0)


def _wait_for_step(proc, metrics, step, timeout=HANG_S):
    deadline = time.monotonic() + timeout
    while _steps_logged(metrics) < step:
        assert proc.poll() is None, f"ended before step {step}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"no step {step} within {timeout} s"
        time.sleep(0.01)


def _gone_within(tree, seconds):
    """Wait until no process of ``tree`` runs; the seconds it took (fails past ``seconds``)."""
    started = time.monotonic()
    while alive(tree):
        assert time.monotonic() - started < seconds, f"still running {seconds} s after the signal: {alive(tree)}"
        time.sleep(0.02)
    return time.monotonic() - started


def _signal_and_collect(proc, signum, *, group=False, then=None):
    """Send ``signum`` to the command (or its process group), and ``then`` another one; the job's process tree
    at that moment, the seconds until it was all gone, and the command's output."""
    tree = descendants(proc.pid)
    (os.killpg if group else os.kill)(proc.pid, signum)
    if then is not None:  # (a second one of the same kind could merge with the first while pending)
        os.kill(proc.pid, then)
    took = _gone_within(tree, HANG_S)
    out, err = proc.communicate(timeout=HANG_S)
    return took, out, err


def _model(path):
    return torch.load(path, weights_only=True)


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _checkpoint_steps(directory):
    return Checkpointer(directory).steps()


def _end_record(metrics):
    """The run's own record of how it ended: the metrics file's ``end`` event (its summary)."""
    ends = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("event") == "end"]
    assert len(ends) == 1, ends
    return ends[0]


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_sigterm_mid_run_stops_at_the_next_step_with_a_checkpoint_and_resumes_bit_for_bit(cli_env, capsys, tmp_path,
                                                                                          name, warm_forkserver):
    """The agreed-step protocol, whatever the timing: each trainer rank proposes the first step after it knew of
    the request that ends with a collective (with --log-every 1: the next one), the stop is the largest
    proposal, no rank passes it, the checkpoint is at it, and the resumed run ends bit for bit like one that was
    never stopped."""
    args = [*COMMON, *STRATEGIES[name]]
    # the run never stopped, and below the resumed one, through the command's main in this process (this process's
    # forkserver, warm_forkserver's, serves them both): only the stopped run is about the command's own process
    whole = run_here(capsys, "train", *args, "--save-model", str(tmp_path / "w.pt"))
    assert whole.returncode == 0, whole.stderr
    ckpt, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = _start([*args, "--checkpoint-dir", str(ckpt), "--metrics-file", str(metrics)], cli_env)
    at = draw(f"sigterm[{name}]", 3, STEPS // 4)  # (the run has 90 steps left to be stopped in)
    _wait_for_step(proc, metrics, at)
    took, _, err = _signal_and_collect(proc, signal.SIGTERM)
    print(f"{name}: signal after step {at} was logged; every process gone {took:.2f} s later")
    try:  # (a failure shows the stopped run's own output too)
        assert proc.returncode == 75, err
        stopped = _end_record(metrics)["stopped"]
        stop, seen, proposed = stopped["step"], stopped["seen"], stopped["proposed"]
        print(f"{name}: request seen at steps {seen}, proposed {proposed}, stopped after {stop}")
        assert len(seen) == len(proposed) >= 2 and min(seen) >= at, stopped  # no rank knew before the signal
        assert proposed == [min(step + 1, STEPS) for step in seen] and stop == max(proposed) < STEPS, stopped
        assert _steps_logged(metrics) == stop, stopped  # (a log point is a collective of every trainer rank)
        assert _checkpoint_steps(ckpt)[-1] == stop
        assert f"stopped by SIGTERM after step {stop}" in err and err.count("\n") <= 3, err
        good = Checkpointer(ckpt).choose().good
        assert good is not None and good.step == stop and Checkpointer(ckpt).latest().name == f"step-{stop:08d}.pt"
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- the stopped run's stderr:\n{err[-4000:]}") from None
    resumed = run_here(capsys, "train", *args, "--checkpoint-dir", str(ckpt), "--resume", "--save-model",
                       str(tmp_path / "r.pt"))
    assert resumed.returncode == 0, resumed.stderr
    assert _same(_model(tmp_path / "w.pt"), _model(tmp_path / "r.pt")), f"{name}: stopped after step {stop}"


@pytest.mark.parametrize("delay", [0.2, 1.5, 3.0])
def test_sigterm_in_the_first_seconds_leaves_nothing_running_and_loses_nothing(cli_env, tmp_path, delay):
    """``delay`` seconds after the command answers stop signals (before that, the Python interpreter itself
    is starting: a signal then ends it as any program, with nothing started): while it imports, while its
    workers start, or as they begin, depending on the machine; the outcome is the same in every case."""
    ckpt = tmp_path / "ck"
    proc = _start([*COMMON, *STRATEGIES["sync"], "--checkpoint-dir", str(ckpt)], cli_env)
    deadline = time.monotonic() + 60
    while not catches(proc.pid, signal.SIGTERM):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.005)
    time.sleep(delay)
    _, _, err = _signal_and_collect(proc, signal.SIGTERM)
    assert proc.returncode == 75, err
    assert "Traceback" not in err and "stopped by SIGTERM" in err, err
    for step in _checkpoint_steps(ckpt):  # a checkpoint, if any, is whole (a stop after the first steps)
        assert Checkpointer(ckpt).choose().good.step == step == _checkpoint_steps(ckpt)[-1]


def test_sigkill_of_the_main_process_ends_every_worker_and_nothing_is_written_after(cli_env, tmp_path):
    ckpt, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = _start([*COMMON, *STRATEGIES["sync"], "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1",
                   "--metrics-file", str(metrics)], cli_env)
    _wait_for_step(proc, metrics, draw("sigkill", 5, 40))
    tree = descendants(proc.pid)
    proc.kill()
    proc.wait(timeout=HANG_S)
    gone_at = time.time()  # the main process is gone (reaped)
    _gone_within(tree, HANG_S)
    proc.communicate(timeout=HANG_S)
    late = [p.name for p in ckpt.iterdir() if p.stat().st_mtime > gone_at]
    # A write in flight when the main process dies can touch its temporary file (.NAME.PID.tmp) in the
    # milliseconds before the kernel ends the worker (the parent-death signal, through the forkserver): seen once
    # in a fresh-clone make test, with a checkpoint every step. A temporary is never a checkpoint, and the next
    # run's directory lock removes it; nothing else may change after.
    assert all(LEFTOVER.match(name) for name in late), \
        f"written after the main process was gone: {late}"
    good = Checkpointer(ckpt).choose().good
    assert good is not None and good.path == Checkpointer(ckpt).latest()


def test_ctrl_c_to_the_process_group_stops_in_order_without_a_traceback(cli_env, tmp_path):
    ckpt, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = _start([*COMMON, *STRATEGIES["pipeline"], "--checkpoint-dir", str(ckpt), "--metrics-file",
                   str(metrics)], cli_env)
    _wait_for_step(proc, metrics, 5)
    _, out, err = _signal_and_collect(proc, signal.SIGINT, group=True)
    assert proc.returncode == 75, err
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err
    assert f"stopped by SIGINT after step {_checkpoint_steps(ckpt)[-1]}" in err


def test_a_second_signal_stops_at_once(cli_env, tmp_path):
    ckpt, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = _start([*COMMON, *STRATEGIES["sync"], "--checkpoint-dir", str(ckpt), "--metrics-file", str(metrics)],
                  cli_env)
    _wait_for_step(proc, metrics, 5)
    # (pending together, Linux hands signals over lowest number first: SIGINT, then SIGTERM)
    _, _, err = _signal_and_collect(proc, signal.SIGINT, then=signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped at once by a second SIGTERM" in err and "Traceback" not in err


def test_without_a_checkpoint_directory_the_stop_says_what_is_lost(cli_env, tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = _start([*COMMON, *STRATEGIES["sync"], "--metrics-file", str(metrics)], cli_env)
    _wait_for_step(proc, metrics, 5)
    _, out, err = _signal_and_collect(proc, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "were not saved (no --checkpoint-dir)" in err
    assert "without --checkpoint-dir: the" in out + err  # the rank-0 warning, before the end


def test_a_signal_to_one_worker_stops_the_whole_job_in_order(cli_env, tmp_path):
    """A scheduler may signal one process of the job (one preempted pod): every rank learns of it."""
    ckpt, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = _start([*COMMON, *STRATEGIES["sync"], "--checkpoint-dir", str(ckpt), "--metrics-file", str(metrics)],
                  cli_env)
    _wait_for_step(proc, metrics, 5)
    tree = descendants(proc.pid)
    (worker,) = [pid for pid in tree if worker_rank(pid) == 1]
    os.kill(worker, signal.SIGTERM)
    out, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 75, err
    _gone_within(tree, HANG_S)
    assert f"stopped by SIGTERM after step {_checkpoint_steps(ckpt)[-1]}" in err


def test_a_second_signal_to_one_worker_ends_it_at_once_and_the_job_with_it(cli_env, tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = _start([*COMMON, *STRATEGIES["sync"], "--metrics-file", str(metrics)], cli_env)
    _wait_for_step(proc, metrics, 5)
    tree = descendants(proc.pid)
    (worker,) = [pid for pid in tree if worker_rank(pid) == 1]
    os.kill(worker, signal.SIGINT)  # (pending together, SIGINT is handed over first)
    os.kill(worker, signal.SIGTERM)
    out, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 1, err
    assert "SIGTERM again: stopping this process at once" in err
    assert "worker rank 1 exited with code 143" in err
    _gone_within(tree, HANG_S)


def _job_tree_until_it_ends(proc):
    """Every process of the job seen from the command's start to its end (polled every 10 ms while a thread reads
    its output), and the command's output: a worker counts however soon its run ends."""
    import threading

    output = {}
    reader = threading.Thread(target=lambda: output.update(zip(("out", "err"), proc.communicate(timeout=HANG_S))),
                              daemon=True)
    reader.start()
    seen = []
    while reader.is_alive():
        seen += [pid for pid in descendants(proc.pid) if pid not in seen]
        time.sleep(0.01)
    reader.join()
    return seen, output["out"], output["err"]


@pytest.mark.parametrize("fail", [False, True])
def test_the_command_leaves_no_process_behind_when_it_ends_or_fails(cli_env, tmp_path, fail):
    env = dict(cli_env, POLYTRAIN_INJECT_KILL="rank=1,steps=5") if fail else cli_env
    metrics = tmp_path / "m.jsonl"
    proc = _start([*COMMON, *STRATEGIES["sync"], "--steps", "20", "--metrics-file", str(metrics)], env)
    tree, out, err = _job_tree_until_it_ends(proc)
    assert len(tree) >= 5, tree  # the command, its forkserver and resource tracker, and the two workers
    assert proc.returncode == (1 if fail else 0), err
    assert alive(tree) == [], f"left after the command ended: {alive(tree)}"


def test_a_frozen_worker_ends_the_command_with_a_hang_report_and_no_process_left(cli_env, tmp_path):
    """A worker frozen after step 5 (SIGSTOP: a machine that stopped answering): the others name it and where it
    was, the report lands in the run directory (here the metrics file's), and when the command returns nothing
    of the job runs, its forkserver and resource tracker included."""
    env = dict(cli_env, POLYTRAIN_INJECT_KILL="rank=1,steps=5,signal=SIGSTOP")
    metrics = tmp_path / "run" / "m.jsonl"
    proc = _start([*COMMON, *STRATEGIES["sync"], "--steps", "40", "--heartbeat-timeout", "4",
                   "--metrics-file", str(metrics)], env)
    _wait_for_step(proc, metrics, 1)
    tree = descendants(proc.pid)
    out, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 1, err
    assert alive(tree) == [], f"left after the command ended: {alive(tree)}"
    assert f"hang report in {tmp_path / 'run' / 'hang-report.txt'}" in err, err
    report = (tmp_path / "run" / "hang-report.txt").read_text()
    assert "hang report (rank 0" in report and "behind: rank 1 (host " in report, report
