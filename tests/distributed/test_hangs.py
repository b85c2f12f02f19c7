"""The hang report on real processes: a rank frozen inside an all-reduce, and a rank that never arrives at one
while its heartbeat goes on (the hang nobody could explain). Every survivor names the rank behind and the
collective, in its error and in the run directory's report; the job ends and leaves no process."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import polytrain
from polytrain.distributed.collectives import begin, end, latest
from polytrain.distributed.hangs import REPORT_FILE, RUN_DIR_ENV, behind, report
from polytrain.errors import WorkerError
from tests.helpers.procs import leftover_children

BOUND = 4.0  # --heartbeat-timeout of these tests: held beside the other pytest-xdist worker and a CPU burner, so they
# need not run alone (tests/distributed/test_heartbeat.py says why not less)
FREEZE_AFTER = 1.5  # rank 1 waits this long inside the all-reduce (its heartbeat publishes it) before it freezes


def _freeze(mark):
    with open(mark, "w") as fh:
        fh.write(str(time.time()))
    os.kill(os.getpid(), signal.SIGSTOP)


def _frozen_inside_all_reduce(ctx, mark):
    tensor = torch.ones(3)
    dist.all_reduce(tensor)  # #1, everyone
    if ctx.rank == 1:
        threading.Timer(FREEZE_AFTER, _freeze, (mark,)).start()
    else:
        time.sleep(FREEZE_AFTER + 1.0)  # they come once rank 1 is frozen inside #2
    dist.all_reduce(tensor)  # #2


def test_a_rank_frozen_inside_an_all_reduce_is_named_with_its_collective_by_every_survivor(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    # each survivor's own heartbeat watch names rank 1; the launcher stops the ranks still running 1 s after the
    # first report, and in a fresh-clone make test rank 2's came later than that (only rank 0's table was written):
    # 2.5 s here, inside the time bound below
    monkeypatch.setattr("polytrain.distributed.supervisor._SETTLE_S", 2.5)
    mark = tmp_path / "frozen-at"
    with pytest.raises(WorkerError) as info:
        polytrain.launch(_frozen_inside_all_reduce, str(mark), workers=3, device="cpu", backend="gloo", timeout=60,
                         threads_per_worker=1, heartbeat_timeout=BOUND)
    ended = time.time()
    frozen = float(mark.read_text())
    message = str(info.value)
    assert re.search(r"rank 1 \(host .*, pid \d+\) sent no heartbeat for .*; last reported inside "
                     r"gloo:all_reduce #2 on world, started .* s ago; hang report in .*hang-report.txt", message), message
    assert ended - frozen < BOUND + 5.0, ended - frozen  # the bound, a beat, the launcher's settling time
    text = (tmp_path / REPORT_FILE).read_text()
    tables = [t for t in text.split("\n\n") if t.strip()]
    assert sorted(re.match(r"hang report \(rank (\d)", t).group(1) for t in tables) == ["0", "2"], text
    for table in tables:
        assert re.search(r"^\s*1\s+silent \d+\.\d s\s+gloo:all_reduce\s+world\s+2\s+\[3\]\s+waiting", table, re.M), table
        assert re.search(r"^behind: rank 1 \(host .*\): silent for .*, last reported inside gloo:all_reduce #2 on world", table, re.M)
        assert len(re.findall(r"^behind:", table, re.M)) == 1, table
    assert leftover_children(os.getpid()) == []


def _late_to_all_reduce(ctx):
    tensor = torch.ones(2)
    dist.all_reduce(tensor)  # #1, everyone
    if ctx.rank == 1:
        time.sleep(30)  # alive and beating, but not coming: the others' all-reduce times out
    dist.all_reduce(tensor)  # #2


def test_a_collective_that_times_out_names_the_rank_that_never_came(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    with pytest.raises(WorkerError):
        polytrain.launch(_late_to_all_reduce, workers=3, device="cpu", backend="gloo", timeout=4,
                         threads_per_worker=1, heartbeat_timeout=BOUND)
    text = (tmp_path / REPORT_FILE).read_text()
    assert re.search(r"^behind: rank 1 \(host .*\): has not reached #2 on world \(gloo:all_reduce\) that rank [02] "
                     r"waits in; its last there is #1", text, re.M), text
    assert "a collective of this rank timed out" in text
    assert leftover_children(os.getpid()) == []


def test_polytrains_own_collectives_are_recorded_and_the_oldest_unfinished_one_is_the_last_word():
    first = begin("shm:all_reduce", "shm-test", [[4]])
    second = begin("shm:all_reduce", "shm-test", [[4]])
    assert latest()["op"] == "shm:all_reduce" and latest()["seq"] == first.seq and latest()["running"]
    end(first)
    assert latest()["seq"] == second.seq
    end(second)
    record = latest()
    assert record["seqs"]["shm-test"] == [second.seq, False] and not record["running"]


def test_the_verdict_names_silent_ranks_and_those_short_of_a_group_others_wait_in():
    def rec(seq, running, group="world"):
        return {"op": "gloo:all_reduce", "group": group, "seq": seq, "sizes": [[2]], "running": running, "age_s": 1.0,
                "seqs": {group: [seq, running]}}

    records = {0: rec(7, True), 1: rec(6, False), 2: rec(7, True), 3: None}
    verdict = behind(records, silent={3: 9.0})
    assert sorted(verdict) == [1, 3]
    assert verdict[1].startswith("has not reached #7 on world (gloo:all_reduce) that rank 0 waits in; its last there is #6")
    assert verdict[3] == ("silent for 9.0 s, no collective recorded (none published before it fell silent); the others "
                          "wait in gloo:all_reduce #7 on world")
    assert behind({0: rec(7, False), 1: rec(7, False)}, silent={}) == {}
    assert behind({0: rec(7, True), 1: rec(6, False)}, silent={}, ended=[1]) == {}
    text, _ = report(0, "test", records, since={1: 0.5, 2: 0.2, 3: 9.0}, silent={3: 9.0})
    assert re.search(r"^\s*1\s+0\.5 s ago\s+gloo:all_reduce\s+world\s+6\s+\[2\]\s+done\s+1\.5 s ago$", text, re.M), text
