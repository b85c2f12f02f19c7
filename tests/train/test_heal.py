"""--on-failure continue over shards: fsdp --dp-replicate 2 --dp-shard 2 (HSDP) on 4 workers, one SIGKILLed at a
drawn step. The survivors take its shards from its peers of the same shard index, go on as one replica sharded
over 3 (no restart, no checkpoint read), and a replacement (--max-restarts 1) is healed from them and brings back
2 x 2. The run trains exactly the global batches an uninterrupted run does, and its losses and final model equal,
bit for bit, a chain of runs that trained the same batches in the same layouts (2 x 2 up to the committed step,
1 x 3 to the step the replacement joined, 2 x 2 to the end), each resuming the one before from a checkpoint.
Without replicas, or when every holder of a shard is lost, it is one line."""

import json
from pathlib import Path

import pytest
import torch

import polytrain
from polytrain.api import make_config
from polytrain.data.buckets import batch_plan
from polytrain.data.registry import build_data
from polytrain.distributed.elastic import CHANGE_KILL_ENV
from polytrain.distributed.layout import Layout
from polytrain.errors import ConfigError, StateLost
from polytrain.strategies import get_strategy
from polytrain.train.elastic import JOIN_AT_ENV
from polytrain.train.example_ids import read
from polytrain.train.faults import KILL_ENV
from polytrain.train.heal import Rows, join, sources
from polytrain.train.on_failure import check_on_failure, members_layout
from polytrain.train.session import strategy_options
from tests.helpers.seed import draw

STEPS, BATCH = 8, 48  # 48 cuts into 4 and 3 slices
# adamw: its state is made per parameter (zeros_like) at each build, over the generation's mesh; SGD has none
BASE = dict(data="digits", model="mlp:hidden=16x16", batch_size=BATCH, lr=0.01, optimizer="adamw", log_every=1,
            eval_every=0, progress="off", heartbeat_timeout=3, strategy="fsdp")
HSDP = dict(dp_replicate=2, dp_shard=2)


def _records(path: Path) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh]


def _losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(path) if r.get("event") == "step"}


@pytest.fixture(scope="module")
def healed(tmp_path_factory):
    """One elastic run (rank 3 killed after a drawn step, its replacement admitted 2 steps later) and its chain."""
    tmp = tmp_path_factory.mktemp("heal")
    killed = draw("heal[fsdp 2x2]", 2, 4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KILL_ENV, f"rank=3,steps={killed}")
        mp.setenv(JOIN_AT_ENV, str(killed + 2))  # the replacement waits until then: 1 x 3 meanwhile
        summary = polytrain.fit(workers=4, steps=STEPS, on_failure="continue", max_restarts=1,
                                metrics_file=str(tmp / "elastic.jsonl"), log_example_ids=str(tmp / "elastic-ids.jsonl"),
                                save_model=str(tmp / "elastic.pt"), **BASE, **HSDP)
    changes = [r for r in _records(tmp / "elastic.jsonl") if r.get("event") == "membership"]
    # the chain: 2 x 2 to the committed step, 1 x 3 to the step the replacement joined, 2 x 2 to the end
    chain = dict(checkpoint_dir=str(tmp / "ck"), metrics_file=str(tmp / "chain.jsonl"), **BASE)
    layouts = {4: dict(workers=4, **HSDP), 3: dict(workers=3)}
    workers, done = 4, 0
    for change in changes:
        if change["step"] > done:
            polytrain.fit(steps=change["step"], resume=done > 0, **layouts[workers], **chain)
            done = change["step"]
        workers = change["workers"]
    polytrain.fit(steps=STEPS, resume=True, save_model=str(tmp / "chain.pt"), **layouts[workers], **chain)
    return tmp, summary, changes, f"fsdp 2 x 2, rank 3 killed after step {killed}"


def test_the_survivors_go_on_without_a_restart_and_the_replacement_brings_back_2_by_2(healed):
    tmp, summary, changes, where = healed
    assert summary["steps"] == STEPS and summary["workers"] == 4 and not summary.get("restarts"), where
    assert summary["slots_lost"] == [3] and summary["slots_joined"] == [3], where
    assert not [r for r in _records(tmp / "elastic.jsonl") if r.get("event") == "restart"], where
    lost = next(c for c in changes if c["lost"])
    joined = next(c for c in changes if c["joined"])
    killed = int(where.rsplit(" ", 1)[1])
    assert (lost["step"], lost["workers"]) == (killed, 3), (where, changes)
    assert (joined["step"], joined["workers"]) == (killed + 2, 4), (where, changes)


def test_its_losses_and_model_equal_the_chain_of_checkpointed_runs_bit_for_bit(healed):
    tmp, _, _, where = healed
    mine, theirs = _losses(tmp / "elastic.jsonl"), _losses(tmp / "chain.jsonl")
    assert len(mine) >= STEPS - 1 and all(mine[step] == theirs[step] for step in mine), where
    model, reference = torch.load(tmp / "elastic.pt"), torch.load(tmp / "chain.pt")
    assert model.keys() == reference.keys() and all(torch.equal(model[k], reference[k]) for k in model), where


def test_it_used_every_global_batch_of_an_uninterrupted_run_once(healed):
    tmp, _, _, where = healed
    ids = read(tmp / "elastic-ids.jsonl")
    plan = batch_plan(build_data("digits").train, BATCH, 0)
    assert sorted(ids) == list(range(1, STEPS + 1)), where
    assert all(ids[step]["ids"] == plan.global_indices(step - 1).tolist() for step in ids), where


def test_a_replacement_lost_while_the_members_rebuild_2_by_2_is_absorbed_without_waiting_out_the_timeout(
        tmp_path, monkeypatch):
    """Rank 3 SIGKILLed after a step: the survivors go on as 1 x 3. Its replacement, admitted 2 steps later,
    SIGKILLs itself after the group of 4 was made and before the strategy is built over it, whose 2 x 2 mesh
    makes groups of its own, each a rendezvous in the store that cutting connections does not release (without
    the members' wait before the build, they waited there past --timeout). The members find it dead before making
    the mesh, agree again and go on as 1 x 3, equal bit for bit to the chain of a 2 x 2 run to the step of the kill
    and a 1 x 3 run from there."""
    killed = draw("heal[replacement lost in the rebuild]", 2, 4)
    monkeypatch.setenv(KILL_ENV, f"rank=3,steps={killed}")
    monkeypatch.setenv(JOIN_AT_ENV, str(killed + 2))
    monkeypatch.setenv(CHANGE_KILL_ENV, "3:2:rebuild")  # slot 3's replacement, in the change to generation 2
    summary = polytrain.fit(workers=4, steps=STEPS, on_failure="continue", max_restarts=1, timeout=300,
                            metrics_file=str(tmp_path / "elastic.jsonl"), save_model=str(tmp_path / "elastic.pt"),
                            **BASE, **HSDP)
    where = f"rank 3 killed after step {killed}, its replacement in the rebuild"
    assert summary["steps"] == STEPS and summary["workers"] == 3 and not summary.get("restarts"), where
    changes = summary["membership_changes"]
    assert [(c["step"], c["workers"], c["lost"]) for c in changes] == [(killed, 3, [3]), (killed + 2, 3, [])], \
        (where, changes)
    assert changes[1].get("replacements_lost") == [3] and summary["slots_joined"] == [], (where, changes)
    # what this guards against is a wait of --timeout (300 s) inside the mesh's rendezvous; a change takes seconds
    assert changes[1]["seconds"] < 100, (where, changes)
    monkeypatch.delenv(KILL_ENV)
    monkeypatch.delenv(CHANGE_KILL_ENV)
    chain = dict(checkpoint_dir=str(tmp_path / "ck"), metrics_file=str(tmp_path / "chain.jsonl"), **BASE)
    polytrain.fit(steps=killed, workers=4, **HSDP, **chain)
    polytrain.fit(steps=STEPS, resume=True, workers=3, save_model=str(tmp_path / "chain.pt"), **chain)
    mine, theirs = _losses(tmp_path / "elastic.jsonl"), _losses(tmp_path / "chain.jsonl")
    assert len(mine) >= STEPS - 1 and all(mine[step] == theirs[step] for step in mine), where
    model, reference = torch.load(tmp_path / "elastic.pt"), torch.load(tmp_path / "chain.pt")
    assert model.keys() == reference.keys() and all(torch.equal(model[k], reference[k]) for k in model), where


def test_a_death_during_start_up_leaves_a_1_by_3_run_from_the_start(tmp_path, monkeypatch):
    """Slot 1 SIGKILLs itself before the 2 x 2 mesh is made at start-up (whose groups' rendezvous would wait for it):
    the others find it dead before making the mesh, agree without it and build as 1 x 3 from step 0, equal bit
    for bit to a 3-worker fsdp run."""
    monkeypatch.setenv(CHANGE_KILL_ENV, "1:0:rebuild")  # generation 0's build: the start-up, first attempt only
    summary = polytrain.fit(workers=4, steps=STEPS, on_failure="continue", timeout=300,
                            save_model=str(tmp_path / "elastic.pt"), **BASE, **HSDP)
    assert summary["steps"] == STEPS and summary["workers"] == 3, summary
    assert [(c["step"], c["lost"], c["workers"]) for c in summary["membership_changes"]] == [(0, [1], 3)]
    assert summary["membership_changes"][0]["seconds"] < 100  # not a wait of --timeout in the mesh's rendezvous
    monkeypatch.delenv(CHANGE_KILL_ENV)
    polytrain.fit(workers=3, steps=STEPS, save_model=str(tmp_path / "three.pt"), **BASE)
    model, reference = torch.load(tmp_path / "elastic.pt"), torch.load(tmp_path / "three.pt")
    assert model.keys() == reference.keys() and all(torch.equal(model[k], reference[k]) for k in model)


def test_each_shard_comes_from_a_holder_at_the_step_and_a_shard_no_survivor_holds_is_one_line():
    # (committed step, shard index, shard count) of each rank of the new group; None: a replacement
    assert sources([(5, 0, 2), (5, 1, 2), (5, 0, 2), None], 5) == [0, 1]
    assert sources([(5, 0, 2), (4, 1, 2), (5, 1, 2)], 5) == [0, 2]  # a rank behind: another holder's
    with pytest.raises(StateLost, match="every worker holding shard 1 of 3 .* was lost .*its last checkpoint"):
        sources([(5, 0, 3), (5, 2, 3)], 5)
    with pytest.raises(StateLost, match="step 5 was completed by some workers, but shard 1 of 2 survives only"):
        sources([(5, 0, 2), (4, 1, 2)], 5)
    rows = [{"w": Rows(torch.arange(4.0).view(2, 2), (3, 2)), "n": 7}, {"w": Rows(torch.ones(1, 2), (3, 2)), "n": 7}]
    assert torch.equal(join([{"state": r} for r in rows])["w"], torch.tensor([[0.0, 1], [2, 3], [1, 1]]))


def test_fsdp_without_replicas_or_with_tp_is_one_line_before_anything_starts():
    with pytest.raises(ConfigError, match="--strategy fsdp keeps each parameter .* without --dp-replicate, .*; add "
                                          "--dp-replicate 2"):
        polytrain.fit(data="digits", model="mlp:hidden=8", steps=1, on_failure="continue", strategy="fsdp", workers=2)
    axes = (("dp_replicate", 2), ("dp_shard", 2), ("tp", 2))  # (a model with a tp plan is checked before this)
    with pytest.raises(ConfigError, match="--strategy fsdp with --tp 2: a lost rank's tensor-parallel pieces"):
        check_on_failure(make_config(strategy="fsdp", on_failure="continue", dp_replicate=2, tp=2),
                         Layout("fsdp", ("trainer",) * 8, axes, 4))


def test_the_survivors_keep_dp_shard_where_it_divides_else_one_replica_and_the_launch_layout_comes_back():
    fsdp = get_strategy("fsdp")
    options = strategy_options(make_config(strategy="fsdp", dp_replicate=2, dp_shard=2), fsdp)
    shapes = {n: dict(members_layout(fsdp, n, 4, options).axes) for n in (4, 3, 2)}
    assert shapes == {4: {"dp_replicate": 2, "dp_shard": 2}, 3: {"dp_replicate": 1, "dp_shard": 3},
                      2: {"dp_replicate": 1, "dp_shard": 2}}
    assert members_layout(fsdp, 3, 4, options).expendable == (0, 1, 2)
