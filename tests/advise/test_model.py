"""The cost model of polytrain advise, term by term (no processes), and its command on saved profiles."""

import json

import pytest

from polytrain.advise.measure import parse, profile_of
from polytrain.advise.model import Profile, Scenario, exchange_s, predict, rank, wire_bytes
from polytrain.advise.report import reasons, table
from polytrain.compare.specs import CompareConfig, StrategySpec
from polytrain.strategies.traffic import ring_all_reduce_bytes

MB = 1e6
SYNC = Profile("sync", step_s=0.010, batch=32, payload=0.6 * MB)
DILOCO = Profile("diloco:sync_every=8", step_s=0.012, batch=32, payload=0.6 * MB, every=8)
ASYNC = Profile("async", step_s=0.015, batch=32, payload=0.6 * MB, pattern="server")


def test_wire_terms():
    for n in (2, 3, 8, 64):
        assert wire_bytes(1000, "ring", n) == pytest.approx(ring_all_reduce_bytes(1000, n))  # traffic's model
        assert wire_bytes(1000, "gather", n) == (n - 1) * 1000
    assert wire_bytes(1000, "ring", 1) == 0 and wire_bytes(1000, "server", 5) == 2000
    # 0.6 MB over a 2-worker ring at 100 Mbit/s: 0.6 MB each way, 48 ms, plus 2 messages of latency
    assert exchange_s(SYNC, Scenario(2, 100e6, latency_s=0.001)) == pytest.approx(0.048 + 0.002)


def test_lock_step_periodic_and_server():
    slow_link = Scenario(2, 100e6)
    sync = predict(SYNC, slow_link)
    assert sync.step_s == pytest.approx(0.010 + 0.048) and sync.examples_per_s == pytest.approx(64 / 0.058)
    assert sync.wire_share == pytest.approx(0.048 / 0.058)
    diloco = predict(DILOCO, slow_link)  # one exchange per 8 steps, not hidden
    assert diloco.step_s == pytest.approx(0.012 + 0.048 / 8)
    assert diloco.wire_bytes_per_step == pytest.approx(0.6 * MB / 8)
    hidden = predict(Profile("d", 0.012, 32, 0.6 * MB, every=8, overlap_s=0.040), slow_link)
    assert hidden.step_s == pytest.approx(0.012 + 0.008 / 8)  # 40 of the 48 ms behind the inner steps
    a = predict(ASYNC, slow_link)  # each slice: compute, push, pull, at half the rate while the other's cross
    c = a.step_s  # two workers: a step is one slice of each, and c = 0.015 + 0.096 (1 + 0.048 / c)
    assert c == pytest.approx(0.015 + 0.096 * (1 + 0.048 / c)) and 0.111 < c < 0.111 + 0.096
    assert a.examples_per_s == pytest.approx(2 / c * 32)
    assert predict(ASYNC, Scenario(64, 100e6)).examples_per_s == pytest.approx(100e6 / 8 / (0.6 * MB) * 32)
    assert predict(ASYNC, Scenario(64, 100e6, servers=4)).examples_per_s == pytest.approx(4 * 100e6 / 8 / 0.6e6 * 32)


def test_stragglers():
    persistent = Scenario(4, 1e12, slow={1: 2.0})
    assert predict(SYNC, persistent).step_s == pytest.approx(0.020, rel=1e-3)  # everyone waits every step
    assert predict(DILOCO, persistent).step_s == pytest.approx(0.024, rel=1e-3)  # a round ends with the slowest
    a = predict(ASYNC, persistent)  # nobody waits: three at full speed, one at half
    assert a.examples_per_s == pytest.approx((3 / 0.015 + 1 / 0.030) * 32, rel=2e-3)
    random = Scenario(4, 1e12, random=(0.1, 3.0))
    assert predict(SYNC, random).step_s == pytest.approx(0.010 * (1 + 2 * (1 - 0.9 ** 4)), rel=1e-3)
    assert predict(DILOCO, random).step_s == pytest.approx(0.012 * 1.2, rel=1e-3)


def test_ranking_and_reasons():
    profiles = [Profile("sync", 0.010, 32, 0.6 * MB, examples_to_target=6400),
                Profile("diloco:sync_every=8", 0.010, 32, 0.6 * MB, every=8, examples_to_target=9600),
                Profile("async", 0.010, 32, 0.6 * MB, pattern="server")]
    fast, slow = Scenario(8, 100e9), Scenario(8, 100e6)
    assert [p.strategy for p in rank([predict(p, fast) for p in profiles])] == \
        ["sync", "diloco:sync_every=8", "async"]  # async never reached the target: last
    header, rows, ranked = table(profiles, slow)
    assert ranked[0].strategy == "diloco:sync_every=8" and rows[0][1] == "diloco:sync_every=8"
    text = reasons(profiles, slow, ranked, "accuracy 0.95")
    assert text.startswith("With 8 workers on 100mbit links, diloco:sync_every=8 is predicted fastest to accuracy 0.95")
    assert "so saving bytes matters here" in text and "8x fewer bytes per step than sync" in text
    assert "needing 1.50x the examples" in text and "async did not reach accuracy 0.95" in text


def test_specs_with_colons_in_values_and_a_profile_from_records():
    spec, = parse("sync:compress=powersgd:rank=4:start=10")
    assert spec.settings == {"compress": "powersgd:rank=4:start=10"}
    cfg = CompareConfig(workers=2, worker_batch_size=32, steps=40, log_every=10)
    records = [{"event": "step", "step": s, "time_s": 0.05 * s + (0.5 if s > 20 else 0),  # an eval after 20
                "rank_bytes_sent": [120_000 * 10, 120_000 * 10] if s > 10 else [1, 1]} for s in (10, 20, 30, 40)]
    profile = profile_of(cfg, StrategySpec("diloco:sync_every=8", "diloco", {"sync_every": "8"}), records, 5000)
    assert profile.step_s == pytest.approx(0.05) and profile.every == 8 and profile.pattern == "ring"
    assert profile.payload == pytest.approx(120_000 * 8)  # per step x H / (2 (N-1)/N = 1 for two workers)
    quantized = profile_of(cfg, StrategySpec("q", "diloco", {"outer_quantize": "int8"}), records, None)
    assert quantized.pattern == "gather"


def test_compare_takes_a_compress_value_with_colons(tmp_path, capsys):
    from polytrain.cli.main import main

    # every case is checked before any trains: the PowerSGD case passes, the bad one is named
    code = main(["compare", "--strategies", "sync:compress=powersgd:rank=4,sync:compress=gzip", "--no-plot",
                 "--out", str(tmp_path)])
    assert code == 2
    assert "case sync:compress=gzip: --compress: unknown value 'gzip'" in capsys.readouterr().err


def test_advise_predicts_from_saved_profiles(tmp_path, capsys):
    from polytrain.advise.measure import save
    from polytrain.cli.main import main

    path = tmp_path / "advise.json"
    save([Profile("sync", 0.01, 32, 0.6 * MB, examples_to_target=6400),
          Profile("local-sgd:sync_every=8", 0.01, 32, 0.6 * MB, every=8, examples_to_target=7000)], path,
         {"model": "digits_cnn", "data": "digits", "worker_batch_size": 32, "target": "accuracy 0.95"})
    code = main(["advise", "--profiles", str(path), "--workers", "64", "--link", "10gbit", "--link", "100mbit",
                 "--no-plot", "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code == 0 and "64 workers, 10gbit links" in out and "64 workers, 100mbit links" in out
    doc = json.loads((tmp_path / "out" / "advise.json").read_text())
    assert [s["ranked"][0]["strategy"] for s in doc["scenarios"]] == ["sync", "local-sgd:sync_every=8"]
    for argv, message in ((["--straggler", "70:2"], "rank 70 is not among --workers 64"),
                          (["--link", "fast"], "--link: 'fast' is not a link rate"),
                          (["--profiles", str(tmp_path / "none.json")], "--profiles: "),
                          (["--workers", "0"], "--workers must be >= 1"), (["--servers", "0"], "--servers must be"),
                          (["--latency", "-1"], "--latency must be >= 0 seconds")):
        assert main(["advise", "--workers", "64", "--no-plot", *argv]) == 2
        assert message in capsys.readouterr().err
