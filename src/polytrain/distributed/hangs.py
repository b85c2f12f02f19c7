"""The hang report: when a rank's heartbeat stops or a collective times out, one table of every rank's last
collective and how long ago it started, and the rank(s) behind and where.

Every rank's heartbeat thread publishes its record (:func:`polytrain.distributed.collectives.latest`) with each
beat, under ``PREFIX/last/RANK`` in the rendezvous store; a frozen or dead rank's last word stays there. A
survivor that sees a rank fall silent (or whose collective times out) reads them all and prints::

    hang report (rank 0, 23:40:01 UTC): rank 1 (host vm, pid 123) sent no heartbeat for 2.7 s
    rank  heartbeat     last collective    group   seq  sizes  state    started
       0  this rank     gloo:all_reduce    world     2  [4]    waiting  2.1 s ago
       1  silent 2.7 s  gloo:all_reduce    world     2  [4]    waiting  4.3 s ago
       2  0.3 s ago     gloo:all_reduce    world     2  [4]    waiting  2.0 s ago
    behind: rank 1 (host vm, pid 123): silent for 2.7 s, last reported inside gloo:all_reduce #2 on world, st...

A rank is *behind* when its heartbeat stopped, or when others wait in an operation of a group that it has not
reached (a lower sequence number there). Ages add the time since that rank's record was published (on the
reader's clock) to its age then (on the rank's own clock): the machines' clocks need not agree.

The report goes to the log (every survivor prints its own) and is appended to ``hang-report.txt`` in the run's
directory (``POLYTRAIN_RUN_DIR``, set by ``polytrain train``: its ``--checkpoint-dir``, else ``--log-dir``, else
the directory of ``--metrics-file``).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Mapping, Sequence

RUN_DIR_ENV = "POLYTRAIN_RUN_DIR"
REPORT_FILE = "hang-report.txt"


def _sizes(sizes: Any) -> str:
    text = ",".join(str(s).replace(" ", "") for s in (sizes or [])) or "-"
    return text if len(text) <= 24 else text[:21] + "..."


def behind(records: Mapping[int, dict[str, Any] | None], silent: Mapping[int, float],
           ended: Sequence[int] = ()) -> dict[int, str]:
    """rank -> why it is behind: its heartbeat is silent, or others wait in a group's operation it has not
    reached."""
    waiting: dict[str, tuple[int, int, str]] = {}  # group -> (highest seq someone waits in, that rank, op)
    for rank, record in records.items():
        if not record or rank in ended or rank in silent:
            continue
        for group, (seq, running) in record.get("seqs", {}).items():
            if running and seq > waiting.get(group, (0, -1, ""))[0]:
                waiting[group] = (seq, rank, record["op"] if record["group"] == group else "an operation")

    def short_of(record: dict[str, Any] | None) -> tuple[str, int, int, str] | None:
        """The first group where others wait in an operation this record has not reached."""
        for group, (seq, waiter, op) in sorted(waiting.items()):
            mine = (record or {}).get("seqs", {}).get(group)
            if mine is None and record is not None and record.get("seqs"):
                continue  # not a member of that group (or its record of it has rolled over)
            if mine is None or mine[0] < seq:
                return group, seq, waiter, op
        return None

    out: dict[int, str] = {}
    for rank, seconds in sorted(silent.items()):
        record = records.get(rank)
        where = "no collective recorded (none published before it fell silent)" if not record else (
            f"last reported {'inside' if record['running'] else 'after'} {record['op']} #{record['seq']} on {record['group']}, "
            f"started {record['age_s']:.1f} s ago")
        short = short_of(record)
        tail = f"; the others wait in {short[3]} #{short[1]} on {short[0]}" if short else ""
        out[rank] = f"silent for {seconds:.1f} s, {where}{tail}"
    for rank, record in sorted(records.items()):
        if rank in out or rank in ended:
            continue
        short = short_of(record)
        if short:
            group, seq, waiter, op = short
            mine = (record or {}).get("seqs", {}).get(group)
            last = f"its last there is #{mine[0]}" if mine else "it recorded no collective"
            out[rank] = (f"has not reached #{seq} on {group} ({op}) that rank {waiter} waits in; {last}"
                         + (f", {record['op']} started {record['age_s']:.1f} s ago" if record else ""))
    return out


def report(me: int, headline: str, records: Mapping[int, dict[str, Any] | None], since: Mapping[int, float],
           silent: Mapping[int, float], names: Sequence[str] | None = None,
           ended: Sequence[int] = ()) -> tuple[str, dict[int, str]]:
    """The table, and the verdict (:func:`behind`). ``records``: each rank's published record (None: none); ``since``: seconds since each rank's
    record was published, on this reader's clock (its age is added); ``silent``: ranks whose heartbeat stopped
    and for how long; ``names[r]``: how to name rank r in the verdict; ``ended``: ranks that ended normally."""
    aged = {rank: (dict(r, age_s=r["age_s"] + since.get(rank, 0.0)) if r else None) for rank, r in records.items()}
    rows = [("rank", "heartbeat", "last collective", "group", "seq", "sizes", "state", "started")]
    for rank in sorted(aged):
        r = aged[rank]
        beat = ("this rank" if rank == me else "ended" if rank in ended else
                f"silent {silent[rank]:.1f} s" if rank in silent else f"{since.get(rank, 0.0):.1f} s ago")
        if r is None:
            rows.append((str(rank), beat, "(none recorded)", "", "", "", "", ""))
        else:
            rows.append((str(rank), beat, r["op"], r["group"], str(r["seq"]), _sizes(r["sizes"]),
                         "waiting" if r["running"] else "done", f"{r['age_s']:.1f} s ago"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"hang report (rank {me}, {time.strftime('%H:%M:%S', time.gmtime())} UTC): {headline}"]
    lines += ["  ".join(cell.rjust(w) if i == 0 else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
              for row in rows]
    verdict = behind(aged, silent, ended)
    name = (lambda r: names[r] if names and r < len(names) else f"rank {r}")
    lines += [f"behind: {name(rank)}: {why}" for rank, why in verdict.items()] or ["behind: no rank is behind "
                                                                                  "another in these records"]
    return "\n".join(lines), verdict


def use_run_directory(config: Any) -> str | None:
    """Where this run's hang reports go (its workers inherit it): ``--checkpoint-dir``, else ``--log-dir``, else
    the directory of ``--metrics-file``; none of them: nowhere (the reports are still logged)."""
    metrics = config.log.metrics_file
    directory = (config.checkpoint.checkpoint_dir or config.log.log_dir
                 or (os.path.dirname(os.path.abspath(metrics)) if metrics else None))
    if directory:
        os.environ[RUN_DIR_ENV] = str(directory)
    else:
        os.environ.pop(RUN_DIR_ENV, None)
    return directory


def write(text: str) -> str | None:
    """Append ``text`` to the run directory's report file in one write (several ranks may append at once);
    its path, or None where there is no run directory or it cannot be written."""
    directory = os.environ.get(RUN_DIR_ENV)
    if not directory:
        return None
    path = os.path.join(directory, REPORT_FILE)
    with contextlib.suppress(OSError):
        os.makedirs(directory, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (text + "\n\n").encode())
        finally:
            os.close(fd)
        return path
    return None


def is_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that gave up waiting (gloo's 'Timed out waiting', NCCL's watchdog, the
    shared-memory all-reduce's barrier)."""
    from polytrain.errors import ConfigError

    if isinstance(exc, ConfigError):  # a setting's message may name --timeout: no collective waited
        return False
    text = f"{type(exc).__name__}: {exc}".lower()
    return "timed out" in text or "timeout" in text or ("did not reach" in text and "within" in text)
