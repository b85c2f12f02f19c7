"""Parameter servers on real gloo processes over loopback: parity with in-process references, the staleness
bound and exactly-once updates from the servers' records."""

import pytest
import torch

from tests.helpers.spawn import spawn
from tests.strategies.ps.jobs import gather, make_model, plan_for, ps_job, reference

STEPS = 5


def assert_close(got, want, rtol):
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=rtol, msg=name)


def test_one_worker_one_server_equals_single_process_sgd_and_ignores_a_retried_push():
    cfg = {"workers": 1, "servers": 1, "steps": STEPS, "duplicate": 1}
    results = spawn(ps_job, 2, cfg, timeout=60)
    want = reference(1, STEPS)
    assert_close(gather(results, cfg), want, 1e-6)
    assert_close(results[0]["read"], want, 1e-6)  # what a worker reads back is the servers' state
    server = results[1]
    assert server["duplicates"] == [(0, 1)]
    assert [(r[0], r[1]) for r in server["records"]] == [(0, c) for c in range(STEPS)]


def test_staleness_zero_two_workers_equals_synchronous_average():
    cfg = {"workers": 2, "servers": 1, "steps": STEPS, "bound": 0, "scale": 0.5, "sleep": 0.01}
    results = spawn(ps_job, 3, cfg, timeout=60)
    assert_close(gather(results, cfg), reference(2, STEPS), 1e-5)
    assert [v for v in results[0]["versions"]] == [[c] for c in range(STEPS)]  # every step read at its clock


def test_two_servers_with_a_split_tensor_give_the_same_result_as_one():
    assert plan_for(make_model(), 2).split_tensors() == ["0.weight"]
    cfg = {"workers": 2, "servers": 2, "steps": STEPS, "bound": 0, "scale": 0.5}
    results = spawn(ps_job, 4, cfg, timeout=60)
    one = spawn(ps_job, 3, {**cfg, "servers": 1}, timeout=60)
    assert_close(gather(results, cfg), gather(one, {**cfg, "servers": 1}), 1e-6)
    assert_close(gather(results, cfg), reference(2, STEPS), 1e-5)


@pytest.mark.parametrize("bound", [0, 1, 3, None])
def test_random_delays_never_exceed_the_staleness_bound_and_apply_every_step_once(bound):
    workers, steps = 3, 6
    cfg = {"workers": workers, "servers": 1, "steps": steps, "bound": bound, "sleep": 0.03}
    server = spawn(ps_job, workers + 1, cfg, timeout=60)[workers]
    if bound is not None:
        assert server["max_staleness"] <= bound
        assert all(r[4] - r[3] <= bound for r in server["records"])
    applied = sorted((r[0], r[1]) for r in server["records"])
    assert applied == [(w, c) for w in range(workers) for c in range(steps)]
    assert sorted(r[2] for r in server["records"]) == list(range(workers * steps))  # every slice, once
    assert server["duplicates"] == []


@pytest.mark.gpu
def test_workers_on_a_gpu_equal_the_cpu_reference():
    cfg = {"workers": 2, "servers": 2, "steps": STEPS, "bound": 0, "scale": 0.5, "device": "cuda"}
    results = spawn(ps_job, 4, cfg, timeout=120)
    assert_close(gather(results, cfg), reference(2, STEPS), 1e-4)
