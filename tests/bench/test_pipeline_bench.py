"""The pipeline suite without processes: its cases and theory, the automatic split's balance, the rows."""

import random

import pytest

from polytrain.bench.measure import BenchError
from polytrain.bench.pipeline import (BALANCE_TARGET, PipelineBenchConfig, PipelineCase, Run, balance_ratio, cases,
                                      run_case, running_order, split_balance)
from polytrain.bench.pipeline_report import format_markdown, format_text, result_document
from polytrain.errors import ConfigError


def test_cases_are_single_then_every_schedule_and_m_it_accepts_with_the_theory():
    chosen, skipped = cases(PipelineBenchConfig(schedules=("gpipe", "1f1b", "interleaved-1f1b"), plain=False))
    assert [c.key for c in chosen] == ["single", "ceiling", "gpipe_m1", "gpipe_m2", "gpipe_m4", "gpipe_m8", "1f1b_m2",
                                       "1f1b_m4", "1f1b_m8", "interleaved-1f1b_m1", "interleaved-1f1b_m2",
                                       "interleaved-1f1b_m4", "interleaved-1f1b_m8"]
    assert skipped == ["1f1b M=1: --schedule 1f1b needs --microbatches >= --stages (1 < 2); pass more "
                       "micro-batches or --schedule gpipe"]
    by_key = {c.key: c for c in chosen}
    assert by_key["gpipe_m8"].theoretical_speedup() == pytest.approx(2 * 8 / 9)  # 2M/(M+P-1)
    assert by_key["gpipe_m1"].theoretical_speedup() == pytest.approx(1)
    # v = 2 chunks per rank: bubble (P-1)/(vM+P-1) = 1/17
    assert by_key["interleaved-1f1b_m8"].theoretical_bubble() == pytest.approx(1 / 17)
    assert by_key["interleaved-1f1b_m8"].theoretical_speedup() == pytest.approx(2 * 16 / 17)
    assert by_key["1f1b_m4"].settings() == {"strategy": "pipeline", "pp": 2, "microbatches": 4,
                                            "schedule": "1f1b"}
    with pytest.raises(ConfigError, match="--microbatches 3 does not divide --batch-size 32"):
        PipelineBenchConfig(microbatches=(1, 3)).check()


def test_the_automatic_cuts_of_balanced_blocks_are_within_the_bound():
    # transformer_lm's profile: a cheap embedding, equal blocks, a head a fraction of a block
    cuts, ratio = balance_ratio([0.3, 20, 21, 19, 20, 3], 2)
    assert cuts == [3] and ratio == pytest.approx(42 / 41.3)
    cuts, ratio = balance_ratio([0.3, 20, 21, 19, 20, 3], 4)
    assert cuts == [2, 3, 4] and ratio == pytest.approx(23 / 19)
    rng = random.Random(0)
    # blocks within +-5% of each other; the embedding and head up to a tenth of a block with 4 blocks (one
    # block per stage at P=4: the head's stage is a block and a tenth), up to a fifth with 8
    for blocks, extra in ((4, 2), (8, 4)):
        for _ in range(50):
            costs = [rng.uniform(0, extra)] + [rng.uniform(19, 21) for _ in range(blocks)] + [rng.uniform(0, extra)]
            for stages in (2, 4):
                assert balance_ratio(costs, stages)[1] <= BALANCE_TARGET, (costs, stages)
    # and where the bound fails: a head a fifth of a block on a stage of one block
    assert balance_ratio([1.1, 20.5, 20.2, 19.5, 20.8, 3.9], 4)[1] > BALANCE_TARGET


def test_the_balance_check_judges_the_chosen_split_on_a_second_profile():
    cfg = PipelineBenchConfig(model="transformer_lm:layers=4,dim=32,heads=2", data="text:seq_len=16", batch_size=8)
    result = split_balance(cfg, 4, repeats=2)
    assert result["units"] == ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    assert [u for stage in result["stage_units"] for u in stage] == result["units"] and len(result["cuts"]) == 3
    assert result["micro_batch"] == 1 and len(result["stage_ms"]) == 4
    assert result["ratio"] == pytest.approx(max(result["stage_ms"]) / min(result["stage_ms"]), rel=1e-2)
    assert result["met"] == (result["ratio"] <= 1.25)


def test_single_runs_every_few_cases_and_each_run_is_compared_with_the_single_runs_around_it():
    cfg = PipelineBenchConfig(schedules=("gpipe",), microbatches=(2, 8), repeats=2, reference_every=2, plain=False)
    chosen, skipped = cases(cfg)
    order = [(r, c.key) for r, c in running_order(chosen, cfg.repeats, cfg.reference_every)]
    assert order == [(0, "single"), (0, "ceiling"), (0, "gpipe_m2"), (0, "single"), (0, "gpipe_m8"),
                     (1, "gpipe_m2"), (1, "single"), (1, "gpipe_m8"), (1, "ceiling"), (1, "single")]
    rates = {1: 100.0, 2: 90.0, 3: 120.0, 4: 140.0, 5: 240.0, 6: 70.0, 7: 60.0, 8: 80.0, 9: 50.0, 10: 40.0}
    busy = {3: [0.1, 0.1], 5: [0.1, 0.1], 6: [0.2, 0.1], 8: [0.1, 0.1]}
    idle = {3: [0.05, 0.03], 5: [0.02, 0.02], 6: [0.1, 0.05], 8: [0.02, 0.02]}
    runs = [Run(key, r, rates[i], busy.get(i, []), idle.get(i, []), 0.3, position=i)
            for i, (r, key) in enumerate(order, 1)]
    doc = result_document(cfg, chosen, skipped, runs, [])
    rows = {r["case"]: r for r in doc["rows"]}
    assert rows["single"]["runs_examples_per_sec"] == [100, 140, 60, 40]
    # gpipe M=2 ran 3rd (single 100 before, 140 after) and 6th (single 140 before, 60 after)
    assert rows["gpipe_m2"]["speedup_per_repeat"] == pytest.approx([120 / 120, 70 / 100])
    assert rows["gpipe_m2"]["speedup"] == pytest.approx(0.85)
    assert rows["gpipe_m2"]["efficiency"] == pytest.approx(0.85 / (4 / 3), abs=1e-4)
    assert rows["gpipe_m2"]["rank_busy_s"] == pytest.approx([0.15, 0.1])  # medians over repeats, per rank
    assert rows["gpipe_m2"]["rank_bubble"] == pytest.approx([0.075 / 0.225, 0.04 / 0.14], abs=1e-4)
    assert "target" not in rows["gpipe_m2"]
    # two processes at once, each against the single runs around it: 90/((100+140)/2), 50/((60+40)/2)
    assert rows["ceiling"]["per_process_vs_single_per_repeat"] == pytest.approx([0.75, 1.0])
    # against the ceiling runs around it (90 and 50, for both): 120/70, 70/70
    assert rows["gpipe_m2"]["efficiency_at_ceiling"] == pytest.approx((120 / 70 + 1) / 2 / (4 / 3), abs=1e-4)
    # the target: M=8, P=2, at least 0.85 x 16/9 = 1.511: 240/((140+60)/2), 80/((60+40)/2)
    assert rows["gpipe_m8"]["speedup_per_repeat"] == pytest.approx([2.4, 1.6], abs=1e-4)
    assert rows["gpipe_m8"]["met"] is True
    assert "met" in format_text(doc) and "| gpipe, P=2, M=8 | 160.0 | 2.000 | 1.778 |" in format_markdown(doc)


def test_one_stage_is_refused_and_a_failing_case_is_named_with_its_error(tmp_path):
    with pytest.raises(ConfigError, match="^--stages 1: a pipeline needs at least 2 stages$"):
        PipelineBenchConfig(stages=1).check()
    cfg = PipelineBenchConfig(model="transformer_lm:layers=2,dim=16,heads=2", data="text:seq_len=16", batch_size=8)
    case = PipelineCase(key="gpipe_m3", label="pipeline gpipe M=3", strategy="pipeline", schedule="gpipe",
                        microbatches=3, stages=2)  # refused by the run's own checks, before any process
    with pytest.raises(BenchError, match="^pipeline gpipe M=3: ConfigError: --microbatches 3 does not divide each "
                                         "pipeline's batch of 8 examples"):
        run_case(case, cfg, 0, tmp_path)


def test_each_pipeline_case_has_a_plain_twin_on_the_same_stages_and_their_ratio_is_paired_by_repeat():
    from polytrain.bench.pipeline_report import plain_ratios

    cfg = PipelineBenchConfig(model="transformer_lm:layers=4,dim=32,heads=2", data="text:seq_len=16",
                              schedules=("1f1b", "interleaved-1f1b"), microbatches=(4,), batch_size=8)
    chosen, skipped = cases(cfg)
    by_key = {c.key: c for c in chosen}
    assert [c.key for c in chosen] == ["single", "ceiling", "1f1b_m4", "plain_1f1b_m4", "interleaved-1f1b_m4"]
    assert skipped == ["plain interleaved-1f1b M=4: the plain loop runs one stage per rank"]
    assert by_key["1f1b_m4"].split_at == by_key["plain_1f1b_m4"].split_at == "blocks.2"  # equal parameters
    assert by_key["1f1b_m4"].settings()["split_at"] == "blocks.2"
    runs = [Run("1f1b_m4", 0, 99.0), Run("plain_1f1b_m4", 0, 100.0), Run("1f1b_m4", 1, 50.0),
            Run("plain_1f1b_m4", 1, 49.0), Run("1f1b_m4", 2, 80.0), Run("plain_1f1b_m4", 2, 80.0)]
    ratios = plain_ratios(chosen, lambda key: [r for r in runs if r.case == key])
    assert ratios == [{"case": "1f1b_m4", "schedule": "1f1b", "microbatches": 4, "split_at": "blocks.2",
                       "value": 1.0, "min": 0.99, "max": round(50 / 49, 4), "per_repeat": [0.99, round(50 / 49, 4), 1.0],
                       "target": 0.98, "met": True}]
