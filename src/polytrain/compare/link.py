"""``polytrain compare --link RATE[,RATE...]``: every case run on an emulated network (:mod:`polytrain.netlab`).

Each case gets a lab of its own with one node per process of its layout (workers and parameter servers),
every link limited to the rate each way; ``polytrain train`` runs under torchrun in every node with the
case's settings written to a config file, and the case is read back from its metrics file as without a link.
``sync`` averages its gradients and ``async`` sends its messages through the process group (``comm`` and
``ps_comm = "backend"``): their shared-memory paths would bypass the links, since the namespaces share /dev/shm.

What the link adds to a case's row, from the interface counters of the busiest node's link (the node that
sent the most) between the metrics file's ``start`` and ``end`` records (the training loop, its evaluations
included; read when each record appears, within about 0.1 s): ``link_busy_s_per_step``, the seconds that
link spent sending per step (its bytes over the rate), and ``link_utilisation``, that time over the loop's
wall time; ``link_bytes_per_example``, what all links sent in that window per example trained.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from polytrain.errors import ConfigError

#: a strategy's setting that would move its traffic off the links, and the value that keeps it on them
_ON_THE_LINK = {"comm": ("backend", ("shm",)), "ps_comm": ("backend", ("shm",))}


def parse_links(text: str | list[str] | None) -> list[int]:
    """``100mbit,1gbit`` (or several ``--link`` flags) -> rates in bits/s, in the order given."""
    from polytrain.netlab import parse_rate

    if not text:
        return []
    parts = [p for chunk in ([text] if isinstance(text, str) else text) for p in chunk.split(",") if p.strip()]
    rates = [parse_rate(p) for p in parts]
    if len(set(rates)) < len(rates):
        raise ConfigError(f"--link: a rate is given twice in '{','.join(parts)}'")
    return rates


def link_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` of a case on the link: a strategy's shared-memory shortcut switched to the process group
    (the caller names the case in an error)."""
    from polytrain.config import all_options
    from polytrain.strategies.registry import get_declared

    section = get_declared(settings["strategy"]).config_section
    keys = {info.key for info in all_options() if info.section == section}
    out = dict(settings)
    for key, (value, refused) in _ON_THE_LINK.items():
        if key not in keys:
            continue
        if str(out.get(key, "")).lower() in refused:
            raise ConfigError(f"{key}={out[key]} bypasses the emulated network (its namespaces share "
                              f"/dev/shm); drop it, or use {key}={value}")
        out[key] = value
    return out


def check_link(rates: list[int]) -> None:
    """One line, before any case runs, where the emulated network cannot be made here."""
    from polytrain.netlab import check_available

    if rates:
        check_available()


def run_on_link(settings: dict[str, Any], rate: int, processes: int, metrics: Path, workdir: Path,
                timeout_s: float = 3600.0) -> tuple[dict[str, Any], dict[str, Any]]:
    """Train one case over a lab of ``processes`` nodes at ``rate``; returns its summary (from the metrics
    file's end record) and the link's numbers."""
    from polytrain.config import make_config, to_toml
    from polytrain.netlab import NetLab, format_rate, run_job

    config = workdir / f"{metrics.stem}.toml"
    config.write_text(to_toml(make_config(**{**settings, "metrics_file": str(metrics.resolve())}),
                              comment=f"polytrain compare --link {format_rate(rate)}"))
    logs = workdir / f"{metrics.stem}-logs"
    with NetLab(processes, rate) as lab:
        window = LoopWindow(lab, metrics)
        job = run_job(lab, ["train", "--config", str(config.resolve())], logs,
                      run_id=f"compare-{uuid.uuid4().hex[:8]}", timeout_s=timeout_s, poll=window.poll)
    if not job.ok:
        failed = next(i for i, code in enumerate(job.codes) if code != 0)
        tail = " | ".join(job.log(failed).strip().splitlines()[-3:])
        raise ConfigError(f"the run on the emulated network failed (node {failed}, exit code "
                          f"{job.codes[failed]}): {tail}; its logs are in {logs}")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    summary = next((r for r in reversed(records) if r.get("event") == "end"), None)
    if summary is None:
        raise ConfigError(f"the run on the emulated network wrote no summary to {metrics}; its logs are in {logs}")
    n_steps = int(summary.get("steps") or 0) - int(next((r.get("step", 0) for r in records
                                                          if r.get("event") == "start"), 0))
    examples = n_steps * int(summary.get("global_batch") or 0)
    sent, loop_s = window.sent(), window.seconds()
    busy_s = max(sent) * 8 / rate if sent else None
    stats = {
        "link_bits_per_s": rate,
        "link": format_rate(rate),
        "link_tx_bytes": sent,  # per node, over the training loop
        "link_tx_bytes_job": job.tx_bytes,  # per node, the whole job (start-up included)
        "link_bytes_per_example": round(sum(sent) / examples, 1) if sent and examples else None,
        "link_busy_s_per_step": round(busy_s / n_steps, 5) if busy_s is not None and n_steps else None,
        "link_utilisation": round(busy_s / loop_s, 4) if busy_s is not None and loop_s else None,
        "loop_s": round(loop_s, 3) if loop_s else None,
        "job_wall_s": round(job.wall_s, 2),
    }
    return {k: v for k, v in summary.items() if k != "event"}, stats


class LoopWindow:
    """The links' counters when the metrics file's ``start`` record and its ``end`` record appear: polled by
    run_job, reading the file only when it grew and the counters only at those two records."""

    def __init__(self, lab: Any, metrics: Path):
        self.lab, self.metrics = lab, metrics
        self._offset, self._partial = 0, ""
        self.marks: dict[str, tuple[float, list[int]]] = {}

    def poll(self) -> None:
        import time

        if "end" in self.marks:
            return
        try:
            size = self.metrics.stat().st_size
        except OSError:
            return
        if size <= self._offset:
            return
        with open(self.metrics) as fh:
            fh.seek(self._offset)
            text = self._partial + fh.read()
            self._offset = fh.tell()
        lines = text.split("\n")
        self._partial = lines.pop()  # a line still being written
        for line in lines:
            event = line[line.find('"event"'):line.find('"event"') + 20] if '"event"' in line else ""
            for name in ("start", "end"):
                if f'"{name}"' in event and name not in self.marks:
                    self.marks[name] = (time.monotonic(), [self.lab.tx_bytes(i) for i in range(len(self.lab.nodes))])

    def sent(self) -> list[int] | None:
        if "start" not in self.marks or "end" not in self.marks:
            return None
        return [b - a for a, b in zip(self.marks["start"][1], self.marks["end"][1])]

    def seconds(self) -> float | None:
        if "start" not in self.marks or "end" not in self.marks:
            return None
        return self.marks["end"][0] - self.marks["start"][0]
