"""polytrain compare --link: every case on an emulated network (real namespaces, rate-limited links, torchrun in
each), the link's columns in the table, and nothing of the network left afterwards."""

from __future__ import annotations

import json
import os

import pytest

from polytrain.cli.main import main
from polytrain.compare.link import link_settings
from polytrain.netlab import lab_namespaces, unavailable

REASON = unavailable()


def test_a_link_rate_that_is_not_one_is_one_line_before_anything_runs(tmp_path, capsys):
    assert main(["compare", "--link", "100mbit,fast", "--out", str(tmp_path), "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("polytrain: error: --link: 'fast' is not a link rate; write a number and a unit")
    assert err.count("\n") == 1
    assert not (tmp_path / "runs").exists()


def test_a_rate_given_twice_and_sync_through_shared_memory_are_refused_before_anything_runs(tmp_path, capsys):
    assert main(["compare", "--link", "1gbit", "--link", "1000mbit", "--out", str(tmp_path), "--no-plot"]) == 2
    assert capsys.readouterr().err == "polytrain: error: --link: a rate is given twice in '1gbit,1000mbit'\n"
    assert main(["compare", "--strategies", "sync:comm=shm", "--link", "1gbit", "--out", str(tmp_path),
                 "--no-plot"]) == 2
    assert capsys.readouterr().err == ("polytrain: error: case sync:comm=shm @1gbit: comm=shm bypasses the emulated "
                                       "network (its namespaces share /dev/shm); drop it, or use comm=backend\n")
    assert main(["compare", "--strategies", "async:ps_comm=shm", "--link", "1gbit", "--out", str(tmp_path),
                 "--no-plot"]) == 2
    assert capsys.readouterr().err == ("polytrain: error: case async:ps_comm=shm @1gbit: ps_comm=shm bypasses the "
                                       "emulated network (its namespaces share /dev/shm); drop it, or use "
                                       "ps_comm=backend\n")
    assert not (tmp_path / "runs").exists()
    # on the link, async's messages go through gloo, as sync's gradients do
    assert link_settings({"strategy": "async"})["ps_comm"] == "backend"
    assert link_settings({"strategy": "sync"})["comm"] == "backend"


@pytest.mark.slow  # a torchrun job of 2 nodes
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_compare_on_the_link_adds_its_rate_busy_time_and_use_and_leaves_no_namespace(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    mine = f"ptlab-{os.getpid()}-"  # labs of other processes may come and go meanwhile
    out = tmp_path / "out"
    code = main(["compare", "--strategies", "sync", "--link", "200mbit", "--steps", "10",
                 "--eval-every", "10", "--log-every", "5", "--model", "mlp", "--out", str(out)])
    assert code == 0, capsys.readouterr()
    doc = json.loads((out / "compare.json").read_text())
    rows = {row["case"]: row for row in doc["rows"]}
    assert list(rows) == ["sync @200mbit"]
    assert doc["config"]["links"] == [200_000_000]
    row = rows["sync @200mbit"]
    assert row["link"] == "200mbit" and 0 <= row["link_utilisation"] <= 1.1, row
    # over the job, the interfaces' counters saw at least what polytrain counts as sent (plus headers and
    # start-up); the loop's own window is read within ~0.1 s of its start and end: too coarse for 10 steps
    assert row["link_job_bytes"] >= row["bytes_sent_per_example"] * 10 * 64, row
    # sync went through the process group (its shared-memory path would have bypassed the links)
    assert 'comm = "backend"' in (out / "runs" / "sync-link-200mbit.toml").read_text()
    text = capsys.readouterr().out
    assert "link busy s/step" in text and "link use" in text and "links of 200mbit each way" in text
    assert "| link |" in (out / "compare.md").read_text()
    assert (out / "compare.png").stat().st_size > 0
    assert [ns for ns in lab_namespaces() if ns.startswith(mine)] == []  # its lab is gone
