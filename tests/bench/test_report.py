"""Rows and ratios from measurements: medians over repeats, ratios as defined in the issue."""

import pytest

from polytrain.bench.cases import BenchConfig, plan
from polytrain.bench.measure import Measurement
from polytrain.bench.report import format_markdown, format_text, result_document, rows


def _measurements(rates):
    return [Measurement(key, r, rate, 1.0, 0.5) for key, runs in rates.items() for r, rate in enumerate(runs)]


def test_medians_and_ratios():
    cfg = BenchConfig(workers=2)
    cases = plan(cfg, cores=2)
    table = rows(cases, _measurements({"single_1t": [100, 90, 300], "single_all": [150, 160, 170],
                                       "sync": [190, 185, 10], "sync_balanced": [180, 170, 190],
                                       "sync_gloo": [150, 160, 170],
                                       "ddp": [190, 200, 195],
                                       "no_exchange": [190, 190, 190]}))
    doc = result_document(cfg, table)
    by_case = {r["case"]: r for r in doc["rows"]}
    assert by_case["single_1t"]["examples_per_sec"] == 100  # median, not mean: one slow or fast run does not count
    assert by_case["sync"]["runs_examples_per_sec"] == [190, 185, 10]
    assert by_case["ddp"]["sec_per_batch"] == pytest.approx(128 / 195, abs=1e-5)
    ratios = {r["key"]: r for r in doc["ratios"]}
    # ratios pair the runs of one repeat, then take the median: 190/190, 185/200, 10/195
    assert ratios["sync_vs_ddp"]["per_repeat"] == pytest.approx([1.0, 185 / 200, 10 / 195], abs=1e-4)
    assert ratios["sync_vs_ddp"]["value"] == pytest.approx(185 / 200, abs=1e-4)
    assert ratios["sync_vs_ddp"]["met"] is False and ratios["sync_vs_ddp"]["target"] == 0.98
    assert ratios["sync_weak_scaling"]["value"] == pytest.approx(190 / (2 * 100), abs=1e-4)
    assert ratios["sync_weak_scaling"]["met"] is True
    assert ratios["ddp_weak_scaling"]["met"] is None
    assert ratios["sync_gloo_vs_ddp"]["value"] == pytest.approx(160 / 200, abs=1e-4)  # median of pairs
    assert ratios["sync_gloo_weak_scaling"]["value"] == pytest.approx(150 / 200, abs=1e-4)
    # balanced against equal slices, paired per repeat: 180/190, 170/185, 190/10
    assert ratios["balanced_vs_equal"]["value"] == pytest.approx(180 / 190, abs=1e-4)
    assert ratios["sync_balanced_weak_scaling"]["value"] == pytest.approx(180 / 200, abs=1e-4)
    assert ratios["sync_vs_single_all"]["value"] == pytest.approx(185 / 160, abs=1e-4)
    assert ratios["ceiling_weak_scaling"]["value"] == pytest.approx(190 / 200, abs=1e-4)
    assert ratios["sync_vs_ceiling"]["value"] == pytest.approx(185 / 190, abs=1e-4)
    assert {"torch", "cores", "cpu", "python"} <= set(doc["env"])
    text, markdown = format_text(doc), format_markdown(doc)
    assert "NOT met" in text and "0.925" in text
    assert "| polytrain sync, 2 workers x 1 thread | 2 × 1 | 128 | 185.0 |" in markdown


def test_language_model_rows_give_tokens_per_second():
    cfg = BenchConfig(model="transformer_lm", data="text", workers=2)
    cases = plan(cfg, cores=2)
    table = rows(cases, _measurements({c.key: [100, 110, 120] for c in cases}))
    doc = result_document(cfg, table, tokens_per_example=128)
    assert doc["tokens_per_example"] == 128
    assert all(r["tokens_per_sec"] == 110 * 128 for r in doc["rows"])
    assert "tokens/s" in format_text(doc) and "14080" in format_text(doc)
    assert "| tokens/s |" in format_markdown(doc) and "| 110.0 | 14080 |" in format_markdown(doc)
    assert "tokens_per_example" not in result_document(cfg, table)  # examples only for other data
