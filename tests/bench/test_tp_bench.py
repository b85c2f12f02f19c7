"""``polytrain bench --suite tp``'s settings, refused before anything runs (the suite itself is measured, not
tested: benchmarks/results/cpu-2core-tp-*.json)."""

import pytest

from polytrain.bench.tp import TpBenchConfig, cases, describe
from polytrain.errors import ConfigError


def test_the_cases_and_what_the_suite_refuses():
    cfg = TpBenchConfig(workers=4)
    assert [c.key for c in cases(cfg)] == ["tp", "plain"]
    assert "polytrain --strategy tp --tp 4, 4 workers x 1 thread" in describe(cfg)
    both = TpBenchConfig(workers=2, dp_shard=2)  # fsdp x tp against parallelize_module + fully_shard
    assert [c.label for c in cases(both)] == [
        "polytrain --strategy fsdp --tp 2 (--dp-shard 2), 4 workers x 1 thread",
        "plain parallelize_module + fully_shard loop, 4 workers x 1 thread"]
    for settings, message in ((dict(workers=1), "--workers must be >= 2 for --suite tp"),
                              (dict(model="mlp"), "--suite tp measures transformer_lm"),
                              (dict(optimizer="lamb"), "--optimizer must be adam or sgd for --suite tp"),
                              (dict(steps=0), "--steps must be >= 1, got 0"),
                              (dict(dp_shard=3), "--dp-shard 3 does not divide --batch-size 8")):
        with pytest.raises(ConfigError, match=message):
            TpBenchConfig(**settings).check()


def test_the_plain_loops_step_times_are_taken_by_polytrains_log_intervals():
    from polytrain.bench.tp_reference import interval_steps

    ends = [float(i * i) for i in range(26)]  # the warm-up's end (step 10), then 25 timed steps
    # polytrain logs at steps 20, 30 and the last (35): intervals of 10, 10 and 5 steps
    assert interval_steps(ends, 10, 10) == [100 / 10, 300 / 10, 225 / 5]
    assert interval_steps(ends[:3], 10, 1) == [1.0, 3.0]  # every step its own
