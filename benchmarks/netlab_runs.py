"""One training run on the emulated network (polytrain.netlab), read back as compare reads a case: shared by
benchmarks/compress_link.py and benchmarks/advise_link.py. Needs root (network namespaces, tc)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polytrain.config import make_config, to_toml
from polytrain.netlab import NetLab, format_rate, run_job
from polytrain.train.run import check


@dataclass
class LinkRun:
    label: str
    rate: int
    records: list[dict[str, Any]]
    tx_bytes: list[int]  # per node, the whole job (start-up included), from the interface counters
    wall_s: float

    @property
    def end(self) -> dict[str, Any]:
        return next(r for r in reversed(self.records) if r["event"] == "end")

    @property
    def examples_per_s(self) -> float:
        """compare's number: every example trained on over the loop's time to the last log point."""
        last = [r for r in self.records if r["event"] == "step"][-1]
        return last["step"] * self.end["global_batch"] / last["time_s"]

    @property
    def median_examples_per_s(self) -> float:
        """Examples/s of the median log interval (an evaluation's interval, or a burst of load, left out)."""
        return self.interval_examples_per_s(0.5)

    def interval_examples_per_s(self, quantile: float) -> float:
        """Examples/s of the log interval at this quantile of their step times (0.5: the median)."""
        steps = [r for r in self.records if r["event"] == "step"]
        per_step = sorted((b["time_s"] - a["time_s"]) / (b["step"] - a["step"]) for a, b in zip(steps, steps[1:]))
        return self.end["global_batch"] / per_step[min(len(per_step) - 1, int(quantile * len(per_step)))]

    def time_to(self, accuracy: float) -> float | None:
        time_at = {r["step"]: r["time_s"] for r in self.records if r["event"] == "step"}
        for r in self.records:
            if r["event"] == "eval" and (r.get("eval_accuracy") or 0) >= accuracy:
                return time_at.get(r["step"])
        return None

    @property
    def accuracy(self) -> float | None:
        return self.end.get("eval_accuracy")

    @property
    def counted_bytes(self) -> int:
        return int(self.end["bytes_sent"])


def run_on_link(label: str, settings: dict[str, Any], rate: str | int, workdir: Path,
                timeout_s: float = 1800) -> LinkRun:
    """Train ``settings`` (``polytrain.fit``'s keywords) with one node per process on links of ``rate``."""
    workdir.mkdir(parents=True, exist_ok=True)
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)
    metrics = (workdir / f"{stem}.jsonl").resolve()
    metrics.unlink(missing_ok=True)
    config = make_config(**{**settings, "metrics_file": str(metrics), "progress": "off"})
    processes = check(config).processes
    path = workdir / f"{stem}.toml"
    path.write_text(to_toml(config, comment=label))
    with NetLab(processes, rate) as lab:
        job = run_job(lab, ["train", "--config", str(path.resolve())], workdir / f"{stem}-logs",
                      run_id=f"bench-{uuid.uuid4().hex[:8]}", timeout_s=timeout_s)
        rate_bits = lab.rate
    if not job.ok:
        raise RuntimeError(f"{label}: exit codes {job.codes}; logs in {workdir / f'{stem}-logs'}:\n"
                           + "\n".join(job.log(0).splitlines()[-5:]))
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return LinkRun(label, rate_bits or 0, records, job.tx_bytes, job.wall_s)


def read_back(label: str, rate: str, workdir: Path) -> LinkRun | None:
    """An earlier run's metrics (its summary written), or None."""
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)
    path = workdir / f"{stem}.jsonl"
    if not path.is_file():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not any(r["event"] == "end" for r in records):
        return None
    return LinkRun(label, 0, records, [], 0.0)


def describe_rate(rate: str | int) -> str:
    return rate if isinstance(rate, str) else format_rate(rate)
