"""``--strategy async`` end to end through ``polytrain.fit`` on real gloo processes.

Parity: with ``--staleness 0`` and plain SGD the servers apply each of N gradients at lr/N on the same
parameters, which is one ``sync`` step; with one worker each push is one ``single`` step, momentum and Adam
state included, so a checkpoint's optimizer state must equal single's and resume across the two strategies.
"""

from __future__ import annotations

import json

import pytest
import torch

import polytrain

# digits with the MLP: small enough for CI, and a warmup + cosine schedule so the servers' LR is checked
COMMON = dict(model="mlp:hidden=32", data="digits", batch_size=32, seed=3, progress="off", eval_every=0,
              lr_schedule="cosine:warmup=4", timeout=60)


def _fit(tmp_path, name, **settings):
    path = tmp_path / f"{name}.pt"
    summary = polytrain.fit(**{**COMMON, **settings}, save_model=str(path),
                            metrics_file=str(tmp_path / f"{name}.jsonl"))
    return summary, torch.load(path, weights_only=True)


def _relative(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    diff = sum(((a[k] - b[k]).double() ** 2).sum() for k in a) ** 0.5
    return float(diff / sum((b[k].double() ** 2).sum() for k in b) ** 0.5)


def _events(path, kind):
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == kind]


def test_staleness_0_with_plain_sgd_equals_sync_on_the_same_global_batches(tmp_path):
    settings = dict(steps=24, workers=2, optimizer="sgd", lr=0.2, momentum=0.0, accumulate=2)
    sync, sync_model = _fit(tmp_path, "sync", strategy="sync", **settings)
    done, model = _fit(tmp_path, "async", strategy="async", staleness=0, servers=2, **settings)
    assert _relative(model, sync_model) <= 1e-5
    assert sync["eval_loss"] == pytest.approx(done["eval_loss"], rel=1e-5)
    assert done["train_loss"] == pytest.approx(sync["train_loss"], rel=1e-5)
    # bulk synchronous: every gradient computed on the values of its own step, each applied once
    assert done["staleness_max"] == 0 and done["staleness_histogram"] == {"0": 48}
    assert done["gradients_applied"] == 48 and done["duplicate_pushes_ignored"] == 0
    steps = _events(tmp_path / "async.jsonl", "step")
    assert all(max(s["rank_staleness_max"]) == 0 for s in steps)
    assert [s["lr"] for s in steps] == [s["lr"] for s in _events(tmp_path / "sync.jsonl", "step")]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_one_worker_equals_single_and_its_checkpoint_holds_singles_optimizer_state(tmp_path, optimizer):
    settings = dict(steps=12, workers=1, optimizer=optimizer, lr=0.05 if optimizer == "sgd" else 0.003,
                    momentum=0.9, checkpoint_every=12)
    single, single_model = _fit(tmp_path, "single", strategy="single",
                                checkpoint_dir=str(tmp_path / "c-single"), **settings)
    done, model = _fit(tmp_path, "async", strategy="async", servers=2,
                       checkpoint_dir=str(tmp_path / "c-async"), **settings)
    assert _relative(model, single_model) <= 1e-6
    assert done["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-6)
    ours = torch.load(tmp_path / "c-async" / "step-00000012.pt", weights_only=True)["optimizer"]
    theirs = torch.load(tmp_path / "c-single" / "step-00000012.pt", weights_only=True)["optimizer"]
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys() and len(ours["state"]) == 4
    for index, state in theirs["state"].items():
        assert state.keys() == ours["state"][index].keys()
        for key, value in state.items():
            torch.testing.assert_close(ours["state"][index][key], value, rtol=1e-6, atol=1e-7)


def test_resume_crosses_strategies_with_the_optimizer_state(tmp_path):
    """single stops at step 8; async (1 worker, 2 servers) resumes its checkpoint (Adam's moments and step
    go to the servers) and stops at 16; single resumes that one to 24: equal to single run straight to 24."""
    settings = dict(workers=1, optimizer="adam", lr=0.003, lr_schedule="constant")
    _, straight = _fit(tmp_path, "straight", strategy="single", steps=24, **settings)
    ckpt = str(tmp_path / "c")
    _fit(tmp_path, "a", strategy="single", steps=8, checkpoint_dir=ckpt, **settings)
    _fit(tmp_path, "b", strategy="async", servers=2, steps=16, checkpoint_dir=ckpt, resume=True, **settings)
    _, resumed = _fit(tmp_path, "c", strategy="single", steps=24, checkpoint_dir=ckpt, resume=True, **settings)
    assert _events(tmp_path / "b.jsonl", "start")[0]["step"] == 8
    assert _relative(resumed, straight) <= 1e-6


@pytest.mark.parametrize("workers, servers", [(2, 1), (3, 2)])
def test_async_learns_the_digits(tmp_path, workers, servers):
    summary = polytrain.fit(strategy="async", workers=workers, servers=servers, data="digits", steps=150,
                            batch_size=60, lr=0.05, momentum=0.9, eval_every=0, progress="off", timeout=60,
                            seed=1, log_dir=str(tmp_path / "tb"))
    assert summary["eval_accuracy"] >= 0.93
    assert summary["gradients_applied"] == workers * 150
    hist = summary["staleness_histogram"]
    assert sum(hist.values()) == workers * 150 and summary["staleness_max"] == max(map(int, hist))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tags = EventAccumulator(str(tmp_path / "tb")).Reload().Tags()
    assert "summary/staleness_max" in tags["scalars"] and "summary/staleness" in tags["histograms"]
    assert f"strategy/rank{workers - 1}_staleness_mean" in tags["scalars"]


def test_a_slow_worker_computes_fewer_slices_and_every_slice_is_applied_once(tmp_path):
    """Slices go to whichever worker asks: with rank 1 made 20x slower, rank 0 computes most of them, and
    the servers still apply each of the 2 x 30 slices exactly once. With --overlap (each slice's values pulled
    while the one before computes, pushes in flight) under --staleness 1: no applied gradient is staler."""
    summary = polytrain.fit(**{**COMMON, "eval_every": 0}, strategy="async", workers=2, steps=30, overlap=True,
                            staleness=1, straggler=["1:20"], log_every=10, metrics_file=str(tmp_path / "m.jsonl"))
    fast, slow = summary["slices_per_worker"]
    assert fast + slow == 60 and summary["gradients_applied"] == 60
    assert summary["duplicate_pushes_ignored"] == 0
    assert fast > slow
    assert summary["staleness_max"] <= 1 and sum(summary["staleness_histogram"].values()) == 60
    steps = _events(tmp_path / "m.jsonl", "step")
    assert all(max(s["rank_staleness_max"]) <= 1 for s in steps)
    per_rank = [sum(s["rank_batch"][r] for s in steps) for r in (0, 1)]
    assert per_rank[0] > per_rank[1]  # the step records show the same split


def _own_loop_async(ctx):
    return polytrain.strategy("async", ctx)


def test_async_in_an_own_loop_of_one_process_is_one_line():
    from polytrain.errors import ConfigError

    with pytest.raises(ConfigError, match="^--strategy async needs its parameter server processes: run it through "
                                          "polytrain train or polytrain.fit, which start --workers \\+ --servers "
                                          "processes$"):
        polytrain.launch(_own_loop_async, workers=1)


def test_the_mailboxes_and_gloo_messages_train_the_same_model_bit_for_bit(tmp_path):
    """``--ps-comm shm`` (shared-memory mailboxes, the default on one machine) against ``backend`` (gloo): bulk
    synchronous with Adam and two servers (the servers' own messages included), so the order is fixed."""
    settings = dict(steps=12, workers=2, servers=2, staleness=0, optimizer="adam", lr=0.003, checkpoint_every=12)
    runs = {}
    for comm in ("shm", "backend"):
        runs[comm] = _fit(tmp_path, comm, strategy="async", ps_comm=comm, checkpoint_dir=str(tmp_path / f"c-{comm}"),
                          **settings)
    (shm, shm_model), (gloo, gloo_model) = runs["shm"], runs["backend"]
    assert shm_model.keys() == gloo_model.keys() and all(torch.equal(shm_model[k], gloo_model[k]) for k in shm_model)
    # (the logged loss is a mean over the slices each worker happened to take: equal up to the order of its sum)
    assert shm["train_loss"] == pytest.approx(gloo["train_loss"], rel=1e-6)
    assert shm["gradients_applied"] == gloo["gradients_applied"] == 24
    states = [torch.load(next((tmp_path / f"c-{c}").glob("*.pt")), weights_only=False)["optimizer"]["state"]
              for c in ("shm", "backend")]
    assert all(torch.equal(a["exp_avg_sq"], b["exp_avg_sq"]) for a, b in zip(states[0].values(), states[1].values()))
