"""``--strategy async --tolerate-worker-loss``: the job goes on without a lost helper and ends whole.

A helper is killed with ``POLYTRAIN_INJECT_KILL`` (SIGKILL after it computed a slice of a given step, before
it pushes it): the slice it held must go to another worker. What is checked comes from the servers' records
and the saved model, not from timing: every slice of every step applied exactly once, the run's step count,
the lost worker named, a model that learnt. The heartbeat bound (4 s) holds beside the other pytest-xdist worker
and a CPU burner (tests/distributed/test_heartbeat.py), so the module need not run alone.
"""

from __future__ import annotations

import pytest
import torch

import polytrain
from polytrain.errors import ConfigError, PolytrainError

STEPS = 40
COMMON = dict(strategy="async", model="mlp:hidden=32", data="digits", batch_size=48, lr=0.1, seed=5,
              progress="off", eval_every=20, timeout=60, heartbeat_timeout=4.0, tolerate_worker_loss=True,
              steps=STEPS)


def _fit(tmp_path, monkeypatch, kill: str | None = None, **settings):
    if kill:
        monkeypatch.setenv("POLYTRAIN_INJECT_KILL", kill)
    path = tmp_path / "model.pt"
    summary = polytrain.fit(**{**COMMON, **settings}, save_model=str(path))
    return summary, torch.load(path, weights_only=True)


@pytest.mark.parametrize("workers,servers,staleness", [(3, 1, None), (3, 2, None), (3, 2, 0), (3, 1, 1)])
def test_a_killed_helper_is_left_behind_and_every_slice_is_applied_once(tmp_path, monkeypatch, workers, servers,
                                                                        staleness):
    summary, model = _fit(tmp_path, monkeypatch, kill="rank=2,steps=6", workers=workers, servers=servers,
                          staleness=staleness)
    assert summary["workers_lost"] == [2]
    assert summary["steps"] == STEPS and summary["workers"] == workers
    # every (worker, push) once, and as many as the run's slices: none lost, none applied twice
    assert summary["gradients_applied"] == STEPS * workers
    assert summary["duplicate_pushes_ignored"] == 0 and summary["slices_skipped"] == 0
    assert sum(summary["slices_per_worker"]) == STEPS * workers
    assert summary["slices_per_worker"][2] < STEPS  # it died early on
    if staleness is not None:
        assert summary["staleness_max"] <= staleness
    assert summary["eval_accuracy"] > 0.6
    assert all(torch.isfinite(v).all() for v in model.values())


@pytest.mark.parametrize("staleness", [None, 0])
def test_worker_0_computes_the_lost_slices_when_it_is_the_last_worker(tmp_path, monkeypatch, staleness):
    summary, _ = _fit(tmp_path, monkeypatch, kill="rank=1,steps=9", workers=2, servers=1, staleness=staleness)
    assert summary["workers_lost"] == [1]
    assert summary["gradients_applied"] == STEPS * 2 and summary["steps"] == STEPS
    assert summary["slices_per_worker"][0] > STEPS  # worker 0 did the rest of the run alone


def test_without_a_loss_staleness_0_ends_as_without_the_option(tmp_path, monkeypatch):
    """The helpers' own loop and worker 0's lone trainers' group change nothing in what is computed."""
    settings = dict(workers=3, servers=2, staleness=0)
    tolerant, with_option = _fit(tmp_path, monkeypatch, **settings)
    strict, without = _fit(tmp_path, monkeypatch, **settings, tolerate_worker_loss=False)
    assert tolerant["workers_lost"] == [] and "workers_lost" not in strict
    assert with_option.keys() == without.keys()
    assert all(torch.equal(with_option[k], without[k]) for k in without)
    # one rank sums the evaluation, or three: float32 sums in another order
    assert tolerant["eval_loss"] == pytest.approx(strict["eval_loss"], rel=1e-6)


def test_worker_batch_size_counts_every_worker_as_without_the_option(tmp_path, monkeypatch):
    """Each worker's trainers' group is its own with the option; a step is still N slices of --worker-batch-size
    (it was cut to one worker's batch: half the examples per step, twice the bytes per example)."""
    settings = dict(workers=3, servers=1, staleness=0, steps=6, eval_every=6)
    runs = []
    for tolerate in (True, False):
        summary = polytrain.fit(**{**COMMON, **settings, "batch_size": None, "tolerate_worker_loss": tolerate},
                                worker_batch_size=16, save_model=str(tmp_path / f"{tolerate}.pt"))
        runs.append((summary, torch.load(tmp_path / f"{tolerate}.pt", weights_only=True)))
    (tolerant, with_option), (strict, without) = runs
    assert tolerant["global_batch"] == strict["global_batch"] == 48
    assert all(torch.equal(with_option[k], without[k]) for k in without)
    # worker 0's bytes over worker 0's examples, against every worker's over all of theirs
    assert tolerant["bytes_sent_per_example"] == pytest.approx(strict["bytes_sent_per_example"], rel=0.01)


def test_a_killed_worker_0_still_stops_the_job_naming_it(tmp_path, monkeypatch):
    with pytest.raises(PolytrainError, match=r"^worker rank 0 was killed by signal SIGKILL"):
        _fit(tmp_path, monkeypatch, kill="rank=0,steps=6", workers=3, servers=1)


def test_without_the_heartbeat_it_is_one_line(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="heartbeat"):
        _fit(tmp_path, monkeypatch, workers=3, servers=1, heartbeat_timeout=0)
