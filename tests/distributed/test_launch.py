import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from polytrain.devices.host_memory import describe_host_memory
from polytrain.distributed.p2p import Channel
from polytrain.distributed.launch import launch
from polytrain.distributed.rendezvous import StoreServer
from polytrain.errors import ConfigError, DataError, WorkerError
from tests.helpers.procs import alive, cmdline, descendants, leftover_children, listening_addresses, worker_rank
from tests.helpers.spawn import spawn


def _whoami(ctx, offset):
    t = torch.tensor([float(ctx.rank + offset)])
    dist.all_reduce(t, group=ctx.topology.group)
    return {"rank": ctx.rank, "world": ctx.world_size, "device": str(ctx.device), "sum": t.item(),
            "threads": torch.get_num_threads(), "pid": os.getpid(), "host_memory": describe_host_memory()}


def test_results_come_back_in_rank_order():
    results = spawn(_whoami, 3, 10)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["world"] == 3 and r["sum"] == 33.0 and r["device"] == "cpu" and r["threads"] == 1
               for r in results)
    assert len({r["pid"] for r in results}) == 3 and os.getpid() not in {r["pid"] for r in results}
    assert all("kept for reuse" in r["host_memory"] for r in results)  # the default, in every worker


def test_one_worker_runs_in_process():
    result, = launch(_in_process, workers=1)
    assert result[:3] == (0, 1, os.getpid())


def test_in_process_the_callers_thread_count_is_restored_after_the_run():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        result, = launch(_in_process, workers=1, threads_per_worker=1)
        assert result == (0, 1, os.getpid(), 1)  # the run had the count asked for, the caller has its own back
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="boom"):
            launch(_boom, workers=1, threads_per_worker=1)
        assert torch.get_num_threads() == 2  # however the run ended
    finally:
        torch.set_num_threads(before)


def _in_process(ctx):
    return ctx.rank, ctx.world_size, os.getpid(), torch.get_num_threads()


def _boom(ctx):
    raise RuntimeError("boom")


def test_without_workers_the_device_spec_sets_the_count():
    results = launch(_whoami, 0, device="cpu:2", timeout=60, host_memory="release")
    assert [r["world"] for r in results] == [2, 2]
    assert all("returned to the system" in r["host_memory"] for r in results)
    result, = launch(_in_process)  # no count anywhere: one worker, in this process
    assert result[:3] == (0, 1, os.getpid())


def _fail_on_rank_one(ctx):
    if ctx.rank == 1:  # CLOCK_MONOTONIC is one clock for every process: the test reads when this happened
        raise RuntimeError(f"boom on purpose at {time.monotonic()!r}")
    dist.barrier(group=ctx.topology.group)  # rank 0 waits for a peer that never comes
    return "unreachable"


def test_a_failing_worker_stops_the_others_and_names_its_rank():
    with pytest.raises(WorkerError, match=r"worker rank 1 failed: RuntimeError: boom on purpose") as err:
        spawn(_fail_on_rank_one, 2, timeout=120)
    failed_at = float(re.search(r"boom on purpose at ([0-9.]+)", str(err.value)).group(1))
    # Timed from the failure, not from the start (starting workers under load takes any time): rank 0's
    # barrier would give up after 120 s; stopping it takes well under a second, so 60 s leaves load room.
    assert time.monotonic() - failed_at < 60
    assert leftover_children(os.getpid()) == []


def _user_error(ctx):
    raise DataError("no such data (on purpose)")


def _bug_on_rank_one_while_rank_zero_listens(ctx):
    channel = Channel(ctx.topology.group, timeout=60)
    if ctx.rank == 1:
        raise TypeError("a bug on purpose")
    channel.recv(torch.empty(1), 1, tag=3)  # rank 1's exit closes the connection: a CommunicationError here


def test_a_peers_bug_is_the_cause_not_the_lost_connection_it_leaves_behind():
    with pytest.raises(WorkerError, match=r"worker rank 1 failed: TypeError: a bug on purpose"):
        spawn(_bug_on_rank_one_while_rank_zero_listens, 2, timeout=60)


def test_user_errors_keep_their_class_and_message():
    with pytest.raises(DataError, match=r"^\[rank \d\] no such data \(on purpose\)$"):
        spawn(_user_error, 2)


def test_port_in_use_is_a_clear_error():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(ConfigError, match=f"port {port} on 127.0.0.1 is already in use"):
            launch(_whoami, 0, workers=2, master_port=port)
    finally:
        taken.close()


def test_unknown_backend_and_bad_worker_counts():
    with pytest.raises(ConfigError, match="unknown backend 'mpi'; accepted: auto, gloo, nccl"):
        launch(_whoami, 0, workers=2, backend="mpi")
    with pytest.raises(ConfigError, match="--workers must be >= 1"):
        launch(_whoami, 0, workers=0)
    with pytest.raises(ConfigError, match="host_memory must be one of cache, release, got 'keep'"):
        launch(_whoami, 0, workers=2, host_memory="keep")


TRAIN = [sys.executable, "-m", "polytrain", "train", "--data", "synthetic:shape=3x24x24,size=4096",
         "--model", "cifar_cnn", "--batch-size", "64", "--steps", "100000", "--progress", "lines", "--log-every", "1"]


def _start_training(env, extra=()):
    return subprocess.Popen(TRAIN + ["--workers", "2", *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for_steps(proc):
    for line in proc.stdout:  # training has started once a step line appears
        if line.startswith("step "):
            return
    pytest.fail(f"training never started: {proc.stderr.read()}")


@pytest.fixture(scope="module")
def training(module_cli_env):
    """One training job of 2 workers, running: asserted on loopback first, then its rank 1 is killed."""
    proc = _start_training(module_cli_env)
    try:
        _wait_for_steps(proc)
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_local_run_listens_only_on_loopback(training):
    proc = training
    assert proc.poll() is None
    job = descendants(proc.pid)
    sockets = listening_addresses(job)
    assert len(job) >= 3  # the launcher and its two workers
    assert sockets, "expected the store and gloo to listen somewhere"
    assert all(addr in ("127.0.0.1", "::1") for addr, _ in sockets), sockets


def test_sigkill_of_a_worker_ends_the_job_naming_the_rank(training):
    proc = training  # (the job test_local_run_listens_only_on_loopback looked at)
    assert proc.poll() is None
    job = descendants(proc.pid)
    ranks = {worker_rank(p): p for p in job if worker_rank(p) is not None}
    assert sorted(ranks) == [0, 1]
    victim = ranks[1]
    os.kill(victim, signal.SIGKILL)
    # the job's collectives would time out after --timeout 300 s; the supervisor ends it at once
    _, err = proc.communicate(timeout=150)
    assert proc.returncode != 0
    assert "worker rank 1 was killed by signal SIGKILL" in err, err
    assert "Traceback" not in err
    deadline = time.monotonic() + 60  # the launcher's resource tracker exits just after the launcher
    while alive(job) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert alive(job) == [], [cmdline(p) for p in alive(job)]


def test_joins_a_torchrun_style_group(cli_env, tmp_path):
    """Workers started the way torchrun starts them (env vars + an agent-hosted store) join that group."""
    server = StoreServer(timedelta(seconds=60))  # stands in for torchrun's agent store, on loopback
    procs = []
    try:
        for rank in range(2):
            env = dict(cli_env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(server.port), TORCHELASTIC_RUN_ID="test",
                       TORCHELASTIC_USE_AGENT_STORE="True")
            cmd = [sys.executable, "-m", "polytrain", "train", "--strategy", "sync", "--model", "mlp",
                   "--steps", "5", "--progress", "lines", "--save-model", str(tmp_path / f"m{rank}.pt")]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        server.close()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "2 processes" in outs[0][0] and "done: 5 steps" in outs[0][0]
    assert outs[1][0] == ""  # only rank 0 speaks
    assert (tmp_path / "m0.pt").exists() and not (tmp_path / "m1.pt").exists()  # only rank 0 writes


def test_an_unguarded_script_works_when_workers_need_nothing_from_it(cli_env, tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("import polytrain\n"
                      "s = polytrain.fit(model='mlp', data='digits', workers=2, steps=3, progress='off')\n"
                      "print('finished', s['steps'])\n")
    proc = subprocess.run([sys.executable, str(script)], env=cli_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("finished 3") == 1  # the workers did not re-run the script


def test_an_unguarded_script_that_workers_need_is_told_to_add_the_guard(cli_env, tmp_path):
    script = tmp_path / "needs_guard.py"
    script.write_text("import torch, polytrain\n"
                      "class Net(torch.nn.Module):\n"
                      "    def __init__(self):\n"
                      "        super().__init__(); self.fc = torch.nn.Linear(64, 10)\n"
                      "    def forward(self, x): return self.fc(x.flatten(1))\n"
                      "polytrain.fit(model=Net(), data='digits', workers=2, steps=3, progress='off')\n")
    proc = subprocess.run([sys.executable, str(script)], env=cli_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert 'put that call under `if __name__ == "__main__":`' in proc.stderr


def test_an_unknown_start_method_is_one_line_before_any_worker(monkeypatch):
    monkeypatch.setenv("POLYTRAIN_START_METHOD", "threads")
    with pytest.raises(ConfigError, match="^POLYTRAIN_START_METHOD=threads: must be one of forkserver, spawn, fork$"):
        launch(_whoami, 0, workers=2)
    assert leftover_children(os.getpid()) == []


def test_expendable_ranks_are_refused_under_torchrun_before_joining_its_group(monkeypatch):
    # no MASTER_PORT: joining the group would fail with another error, or wait for peers that never come
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=r"^--tolerate-worker-loss needs polytrain's own launcher: torchrun's agent "
                                          r"stops every worker of a machine when one fails; start the job with "
                                          r"polytrain train, without torchrun$"):
        launch(_whoami, 0, workers=2, expendable=[1])
    assert not dist.is_initialized()


def test_expendable_ranks_need_the_heartbeat_and_a_rank_of_the_job_other_than_0():
    with pytest.raises(ConfigError, match=r"^--tolerate-worker-loss needs the heartbeat: the parameter servers learn "
                                          r"that a worker died from it; give --heartbeat-timeout > 0$"):
        launch(_whoami, 0, workers=3, expendable=[1, 2], heartbeat_timeout=0)
    for ranks, bad in (([0, 1], "0"), ([2, 3, 5], "3, 5")):
        with pytest.raises(ConfigError, match=rf"^expendable rank\(s\) {bad}: must be in 1\.\.2 \(a job of 3 "
                                              r"processes; rank 0, which logs, evaluates and checkpoints, never is "
                                              r"expendable\)$"):
            launch(_whoami, 0, workers=3, expendable=ranks)
    assert leftover_children(os.getpid()) == []


def test_one_worker_has_nothing_to_tolerate():
    result, = launch(_in_process, workers=1, expendable=[1, 2], heartbeat_timeout=0)
    assert result[:3] == (0, 1, os.getpid())
