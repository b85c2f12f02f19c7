"""--on-failure continue: 4 workers, one SIGKILLed, the survivors go on without a restart and a replacement
joins; the run trains exactly the global batches an uninterrupted run does, and its model and losses equal a
chain of runs that trained the same batches on 4 workers up to the committed step, 3 from there to the step the
replacement joined, and 4 again to the end (checkpoints between them; `--comm backend`, as the elastic run's
sync averages through the process group). The settings it cannot work with are one line before anything
starts."""

import json
import os
from pathlib import Path

import pytest
import torch

import polytrain
from polytrain.data.buckets import batch_plan
from polytrain.data.registry import build_data
from polytrain.distributed.elastic import CHANGE_KILL_ENV
from polytrain.distributed.joining import JOIN_STALL_ENV
from polytrain.errors import ConfigError
from polytrain.train.example_ids import read
from polytrain.train.elastic import JOIN_AT_ENV
from polytrain.train.faults import KILL_ENV
from tests.helpers.seed import draw

STEPS, BATCH = 40, 48  # 48 cuts into 4 and 3 slices; enough steps after the kill for the replacement to join
BASE = dict(data="digits", model="mlp:hidden=16x16", batch_size=BATCH, lr=0.05, log_every=1, eval_every=0,
            progress="off", heartbeat_timeout=3)
STRATEGIES = {
    "sync": dict(strategy="sync"),
    # plain inner SGD: a checkpoint keeps rank 0's inner optimizer state only, so the chain's resumes equal the
    # elastic run's rounds only without per-worker inner state
    "diloco": dict(strategy="diloco", sync_every=2, momentum=0.0),
}


def _records(path: Path) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh]


def _losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(path) if r.get("event") == "step"}


def _workers_left() -> list[int]:
    """Worker processes (named polytrain-rN) descending from this one."""
    parents = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/comm") as fh:
                parents[int(pid)] = (int(fields[1]), fh.read().strip())
        except OSError:
            continue

    def mine(pid: int) -> bool:
        while pid in parents and pid > 1:
            pid = parents[pid][0]
            if pid == os.getpid():
                return True
        return False

    return [pid for pid, (_, name) in parents.items() if name.startswith("polytrain-r") and mine(pid)]


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_killed_worker_is_left_behind_then_replaced_and_the_run_equals_4_then_3_then_4_workers(tmp_path, monkeypatch,
                                                                                                  name):
    settings = {**BASE, **STRATEGIES[name]}
    killed = draw(f"elastic[{name}]", 3, 8)  # a chosen step: inside a round or at a meeting for diloco
    monkeypatch.setenv(KILL_ENV, f"rank=3,steps={killed}")
    monkeypatch.setenv(JOIN_AT_ENV, str(killed + 5))  # the replacement waits until then: 3 workers meanwhile
    # admitted, the replacement's main thread stalls past --heartbeat-timeout before its heartbeat starts (a
    # loaded machine): its slot beats meanwhile, and it is not taken for lost
    monkeypatch.setenv(JOIN_STALL_ENV, str(BASE["heartbeat_timeout"] + 1))
    summary = polytrain.fit(workers=4, steps=STEPS, on_failure="continue", max_restarts=1,
                            metrics_file=str(tmp_path / "elastic.jsonl"),
                            log_example_ids=str(tmp_path / "elastic-ids.jsonl"),
                            save_model=str(tmp_path / "elastic.pt"), **settings)
    monkeypatch.delenv(KILL_ENV)
    monkeypatch.delenv(JOIN_AT_ENV)
    monkeypatch.delenv(JOIN_STALL_ENV)
    where = f"{name}, rank 3 killed after step {killed}"
    assert not _workers_left(), where
    assert summary["steps"] == STEPS and summary["workers"] == 4, where
    assert not summary.get("restarts") and summary["slots_lost"] == [3] and summary["slots_joined"] == [3], where
    records = _records(tmp_path / "elastic.jsonl")
    assert not [r for r in records if r.get("event") == "restart"], where
    changes = [r for r in records if r.get("event") == "membership"]
    lost = next(c for c in changes if c["lost"])
    joined = next(c for c in changes if c["joined"])
    assert lost["lost"] == [3] and joined["joined"] == [3] and changes[-1]["workers"] == 4, (where, changes)
    # the step the survivors went on from: the kill's (sync commits every step; the dead rank finished it), or
    # for diloco the round's start, where the replicas last met
    committed = killed if name == "sync" else killed // 2 * 2
    assert lost["step"] == committed and lost["workers"] == 3, (where, changes)
    assert joined["step"] == (killed + 5 if name == "sync" else (killed + 6) // 2 * 2), (where, changes)
    print(f"{where}: the change to 3 workers took {lost['seconds']} s")  # (a speed: not asserted)

    # the chain: the same workers over the same steps as the elastic run (4 to the committed step, 3 to the step
    # the replacement joined at, 4 to the end), each part resuming the one before from its last checkpoint
    chain = dict(checkpoint_dir=str(tmp_path / "ck"), metrics_file=str(tmp_path / "chain.jsonl"),
                 log_example_ids=str(tmp_path / "chain-ids.jsonl"), **settings)
    if name == "sync":
        chain["comm"] = "backend"
    workers, done = 4, 0
    for change in changes:
        if change["step"] > done:
            polytrain.fit(workers=workers, steps=change["step"], resume=done > 0, **chain)
            done = change["step"]
        workers = change["workers"]
    polytrain.fit(workers=workers, steps=STEPS, resume=True, save_model=str(tmp_path / "chain.pt"), **chain)

    mine, theirs = _losses(tmp_path / "elastic.jsonl"), _losses(tmp_path / "chain.jsonl")
    assert len(mine) >= STEPS - 1, where  # the step the failure struck at may have no record
    assert all(abs(mine[step] - theirs[step]) <= 1e-6 for step in mine), where
    model, reference = torch.load(tmp_path / "elastic.pt"), torch.load(tmp_path / "chain.pt")
    assert all((model[k] - reference[k]).abs().max().item() <= 1e-6 for k in reference), where

    # every global batch of an uninterrupted run, each exactly once (a redone step's later line wins)
    ids = read(tmp_path / "elastic-ids.jsonl")
    plan = batch_plan(build_data("digits").train, BATCH, 0)
    assert sorted(ids) == list(range(1, STEPS + 1)), where
    assert all(ids[step]["ids"] == plan.global_indices(step - 1).tolist() for step in ids), where
    assert {s: r["ids"] for s, r in ids.items()} == {s: r["ids"] for s, r in read(tmp_path / "chain-ids.jsonl").items()}


@pytest.mark.parametrize("settings, message", [
    (dict(strategy="fsdp"), "--strategy fsdp keeps each parameter and optimizer shard on one worker only without "
                            "--dp-replicate, so a dead worker.s shards are gone; add --dp-replicate 2"),
    (dict(strategy="pipeline"), "--strategy pipeline does not keep a whole replica of the model and optimizer"),
    (dict(strategy="sync", comm="shm"), "--comm shm cannot be rebuilt over the survivors"),
    (dict(strategy="sync", balance="on"), "--balance on is not supported"),
    (dict(strategy="sync", heartbeat_timeout=0), "needs the heartbeat"),
    (dict(strategy="sync", workers=1), "needs at least 2 workers"),
    (dict(strategy="sync", backend="nccl"), "needs the gloo backend"),
])
def test_settings_continue_cannot_work_with_are_one_line_before_anything_starts(settings, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        polytrain.fit(data="digits", model="mlp:hidden=8", steps=1, on_failure="continue",
                      **{"workers": 2, **settings})


@pytest.mark.parametrize("scheduler, says", [(None, "under torchrun the agent restarts every worker"),
                                              ("slurm", "under srun rank 0 hosts the rendezvous store")])
def test_continue_under_torchrun_or_a_scheduler_is_one_line(monkeypatch, scheduler, says):
    from polytrain.api import make_config
    from polytrain.distributed.cluster import SCHEDULER_ENV
    from polytrain.distributed.layout import Layout
    from polytrain.train.on_failure import check_on_failure

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    if scheduler:  # (what adopt() writes for a task of srun)
        monkeypatch.setenv(SCHEDULER_ENV, scheduler)
    with pytest.raises(ConfigError, match=f"needs polytrain's own launcher .*: {says}"):
        check_on_failure(make_config(strategy="sync", on_failure="continue"), Layout.data_parallel("sync", 2))


def test_rank_0_killed_the_lowest_survivor_reports_and_the_run_equals_4_then_3_workers(tmp_path, monkeypatch):
    """Rank 0 (which logs, evaluates and writes checkpoints) SIGKILLed: the launcher holds the store and watches
    the workers, so the other three go on without a restart, the lowest of them reporting from then on."""
    steps, settings = 16, {**BASE, **STRATEGIES["sync"]}
    killed = draw("elastic[rank 0]", 3, 8)
    monkeypatch.setenv(KILL_ENV, f"rank=0,steps={killed}")
    summary = polytrain.fit(workers=4, steps=steps, on_failure="continue", checkpoint_dir=str(tmp_path / "eck"),
                            checkpoint_every=4, metrics_file=str(tmp_path / "elastic.jsonl"),
                            log_example_ids=str(tmp_path / "elastic-ids.jsonl"),
                            save_model=str(tmp_path / "elastic.pt"), **settings)
    monkeypatch.delenv(KILL_ENV)
    where = f"rank 0 killed after step {killed}"
    assert not _workers_left(), where
    assert summary["steps"] == steps and summary["workers"] == 3 and not summary.get("restarts"), where
    assert summary["slots_lost"] == [0] and summary["slots_joined"] == [], where
    assert [(c["step"], c["workers"], c["lost"]) for c in summary["membership_changes"]] == [(killed, 3, [0])], where
    records = _records(tmp_path / "elastic.jsonl")
    assert not [r for r in records if r.get("event") == "restart"], where
    # the survivor that reports now wrote the change, the steps after it, the final evaluation and the end
    assert [r["lost"] for r in records if r.get("event") == "membership"] == [[0]], where
    assert [r["step"] for r in records if r.get("event") == "eval"] == [steps], where
    assert records[-1]["event"] == "end" and records[-1]["workers"] == 3 and summary["eval_loss"] is not None, where
    # and the checkpoints after the kill, the last one holding the saved model
    written = sorted(p.name for p in (tmp_path / "eck").glob("step-*.pt"))
    assert written[-1] == f"step-{steps:08d}.pt" and len(written) >= 2, (where, written)
    model = torch.load(tmp_path / "elastic.pt")
    final = torch.load(tmp_path / "eck" / written[-1], weights_only=True)["model"]
    assert all(torch.equal(final[k], model[k]) for k in model), where

    # the chain: 4 workers to the kill's step, 3 from there (a checkpoint between them)
    chain = dict(checkpoint_dir=str(tmp_path / "ck"), metrics_file=str(tmp_path / "chain.jsonl"),
                 log_example_ids=str(tmp_path / "chain-ids.jsonl"), comm="backend", **settings)
    polytrain.fit(workers=4, steps=killed, **chain)
    polytrain.fit(workers=3, steps=steps, resume=True, save_model=str(tmp_path / "chain.pt"), **chain)
    mine, theirs = _losses(tmp_path / "elastic.jsonl"), _losses(tmp_path / "chain.jsonl")
    assert len(mine) >= steps - 1 and all(abs(mine[s] - theirs[s]) <= 1e-6 for s in mine), where
    reference = torch.load(tmp_path / "chain.pt")
    assert all((model[k] - reference[k]).abs().max().item() <= 1e-6 for k in reference), where

    ids = read(tmp_path / "elastic-ids.jsonl")  # every global batch of an uninterrupted run, exactly once
    plan = batch_plan(build_data("digits").train, BATCH, 0)
    assert sorted(ids) == list(range(1, steps + 1)), where
    assert all(ids[step]["ids"] == plan.global_indices(step - 1).tolist() for step in ids), where


def test_a_second_death_during_the_change_is_absorbed_without_waiting_out_the_timeout(tmp_path, monkeypatch):
    """Rank 3 SIGKILLed after a step; slot 2 SIGKILLs itself inside the change that follows, after the survivors
    had agreed on a membership counting it in and before its group was made: the others find it dead before
    making the group (not after --timeout inside its rendezvous, 300 s here) and agree again, going on as 2."""
    steps, settings = 8, {**BASE, **STRATEGIES["sync"]}
    killed = draw("elastic[second death]", 2, 5)
    monkeypatch.setenv(KILL_ENV, f"rank=3,steps={killed}")
    monkeypatch.setenv(CHANGE_KILL_ENV, "2:1")
    summary = polytrain.fit(workers=4, steps=steps, on_failure="continue", timeout=300,
                            metrics_file=str(tmp_path / "elastic.jsonl"),
                            log_example_ids=str(tmp_path / "elastic-ids.jsonl"), **settings)
    where = f"rank 3 killed after step {killed}, slot 2 in the change"
    assert not _workers_left(), where
    assert summary["steps"] == steps and summary["workers"] == 2 and not summary.get("restarts"), where
    assert [(c["step"], c["workers"], c["lost"]) for c in summary["membership_changes"]] == [(killed, 2, [2, 3])], \
        where
    assert summary["slots_lost"] == [2, 3] and summary["slots_joined"] == [], where
    ids = read(tmp_path / "elastic-ids.jsonl")  # every global batch of an uninterrupted run, exactly once
    plan = batch_plan(build_data("digits").train, BATCH, 0)
    assert sorted(ids) == list(range(1, steps + 1)), where
    assert all(ids[step]["ids"] == plan.global_indices(step - 1).tolist() for step in ids), where


def test_a_death_during_start_up_leaves_the_others_going_from_the_start_as_a_run_of_3(tmp_path, monkeypatch):
    """Slot 3 SIGKILLs itself during start-up, before the first step (while the members are about to build the
    strategy: the others would wait for it in sync's start-up collectives). The others agree without it and build
    again over 3: the run is a 3-worker run from step 0, bit for bit, and says so in its summary and metrics."""
    monkeypatch.setenv(CHANGE_KILL_ENV, "3:0:rebuild")  # generation 0's build: the start-up, first attempt only
    settings = dict(steps=8, on_failure="continue", timeout=300, **BASE, **STRATEGIES["sync"])
    summary = polytrain.fit(workers=4, metrics_file=str(tmp_path / "m.jsonl"), save_model=str(tmp_path / "s.pt"),
                            **settings)
    assert summary["steps"] == 8 and summary["workers"] == 3, summary
    assert [(c["step"], c["lost"], c["workers"]) for c in summary["membership_changes"]] == [(0, [3], 3)]
    events = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [(e["step"], e["lost"]) for e in events if e["event"] == "membership"] == [(0, [3])]
    monkeypatch.delenv(CHANGE_KILL_ENV)
    polytrain.fit(workers=3, save_model=str(tmp_path / "three.pt"), **settings)
    model, three = torch.load(tmp_path / "s.pt"), torch.load(tmp_path / "three.pt")
    assert all(torch.equal(model[k], three[k]) for k in three)
    assert not _workers_left()


def test_a_death_during_start_up_is_replaced_without_a_restart(tmp_path, monkeypatch):
    """The same death with --max-restarts 1: the others go on as 3 at once, and the replacement the launcher starts
    joins them (no restart of the job, and no replacement left waiting out --timeout: 300 s here)."""
    monkeypatch.setenv(CHANGE_KILL_ENV, "3:0:rebuild")
    summary = polytrain.fit(workers=4, steps=8, on_failure="continue", max_restarts=1, timeout=300,
                            checkpoint_dir=str(tmp_path / "ck"), **BASE, **STRATEGIES["sync"])
    assert summary["steps"] == 8 and summary["workers"] == 4 and summary["restarts"] == 0, summary
    assert summary["slots_lost"] == [3] and summary["slots_joined"] == [3], summary["membership_changes"]
    assert summary["total_wall_s"] < 150, summary
    assert not _workers_left()
