"""The benchmark plan is data: cases, their order, and the checks made before anything runs."""

from collections import Counter

import pytest

from polytrain.bench.cases import BenchConfig, describe, interleaved, plan
from polytrain.errors import ConfigError


def test_plan_compares_the_same_per_worker_batch_seven_ways():
    cases = plan(BenchConfig(workers=3, worker_batch_size=16), cores=4)
    assert [c.key for c in cases] == ["single_1t", "single_all", "sync", "sync_balanced", "sync_gloo", "ddp",
                                      "no_exchange"]
    by_key = {c.key: c for c in cases}
    assert (by_key["single_1t"].workers, by_key["single_1t"].threads, by_key["single_1t"].global_batch) == (1, 1, 16)
    assert (by_key["single_all"].threads, by_key["single_all"].global_batch) == (4, 48)
    for key in ("sync", "sync_balanced", "sync_gloo", "ddp", "no_exchange"):
        assert (by_key[key].workers, by_key[key].threads, by_key[key].global_batch) == (3, 1, 48)
    assert by_key["ddp"].runner == "ddp" and by_key["sync"].runner == "polytrain"
    assert by_key["ddp"].exchange and not by_key["no_exchange"].exchange
    assert (by_key["sync"].comm, by_key["sync_gloo"].comm) == ("auto", "backend")
    # as shipped (equal slices, like the DDP script's), and balanced by measured speed
    assert [by_key[k].balance for k in ("sync", "sync_balanced", "sync_gloo")] == ["off", "auto", "off"]
    text = describe(BenchConfig(), cases)
    assert "single_all" in text and "3x1" in text


def test_interleaved_runs_every_case_once_per_repeat_starting_one_later_each_time():
    cases = plan(BenchConfig(), cores=2)
    order = interleaved(cases, 3)
    n = len(cases)
    assert len(order) == 3 * n
    assert Counter(c.key for _, c in order) == {c.key: 3 for c in cases}
    firsts = [order[i * n][1].key for i in range(3)]
    assert firsts == ["single_1t", "single_all", "sync"]
    for repeat in range(3):
        assert {c.key for r, c in order[repeat * n:(repeat + 1) * n]} == {c.key for c in cases}
        assert all(r == repeat for r, _ in order[repeat * n:(repeat + 1) * n])


@pytest.mark.parametrize("settings, message", [
    ({"workers": 0}, "--workers must be >= 1"),
    ({"steps": 0}, "--steps must be >= 1"),
    ({"host_memory": "keep"}, "--host-memory must be one of cache, release, got 'keep'"),
    ({"model": "resnet9000"}, "unknown model 'resnet9000'"),
    ({"data": "nosuchdata"}, "unknown dataset 'nosuchdata'"),
    ({"data": "synthetic:size=100", "worker_batch_size": 64}, "fewer than one global batch"),
])
def test_bad_settings_are_refused_before_running(settings, message):
    with pytest.raises(ConfigError, match=message):
        BenchConfig(**settings).check()
