"""``polytrain bench --suite goodput``: useful steps per second of a real job that loses a worker on a schedule,
against the same job undisturbed, each run for the same wall time.

Up to three jobs, one after the other, each ``polytrain train`` run as a user runs it (``--workers N`` CPU
processes, ``--strategy sync``, an unbounded ``--steps``, ``--log-every 1``) for ``--duration`` seconds of wall
time from its start, then stopped by SIGTERM (an orderly stop):

* **undisturbed**: no checkpoint, no failure;
* **max-restarts**: ``--max-restarts`` with ``--checkpoint-dir``, ``--checkpoint-every-seconds C`` and
  ``--snapshot-every K`` (a snapshot in memory every K steps, with the bench's `--snapshot-every K`); every ``--failure-every`` seconds a random worker
  process is SIGKILLed; the launcher stops the others and starts the job again from the latest snapshot (or
  checkpoint), redoing the steps since;
* **continue**: ``--on-failure continue`` (when the installed polytrain has it): the survivors go on without
  the killed worker; no checkpoint.

A job's *useful steps* are its progress when the duration is up: the step of the last step record in its metrics
file at that moment (a restarted job's steps redone after a restart count once: the record is the step the
model has reached). Goodput = useful steps / the undisturbed job's useful steps. Every job pays its start-up
(processes, data, model) inside the duration, the undisturbed one too.

A kill is due every ``--failure-every`` seconds from the job's start; it falls on a worker process chosen at
random (``--seed``) among those running then; while none runs (a restart starting them), it waits for one.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from polytrain.bench.measure import BenchError
from polytrain.errors import ConfigError
from polytrain.train.recovery import cost_summary

SIDES = ("undisturbed", "max-restarts", "continue")
#: what the suite prints beside the measured goodput
TARGETS = {"max-restarts": 0.85, "continue": 0.95}


def parse_seconds(text: str | float) -> float:
    """``60``, ``60s``, ``2m`` -> seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    value = text.strip().lower()
    scale = 1.0
    if value.endswith("m"):
        value, scale = value[:-1], 60.0
    elif value.endswith("s"):
        value = value[:-1]
    try:
        return float(value) * scale
    except ValueError:
        raise ConfigError(f"expected seconds such as 60, 60s or 2m, got '{text}'") from None


@dataclass(frozen=True)
class GoodputBenchConfig:
    model: str = "digits_cnn"
    data: str = "digits"
    batch_size: int = 128
    workers: int = 4
    lr: float = 0.05
    seed: int = 0
    duration: float = 600.0  # seconds of wall time per job
    failure_every: float = 60.0  # seconds between kills
    checkpoint_every_seconds: float = 30.0  # the max-restarts job's checkpoints
    snapshot_every: int = 0  # the max-restarts job's snapshots in memory, every this many steps (0: none)
    heartbeat_timeout: float = 8.0
    timeout: float = 300.0
    sides: tuple[str, ...] = SIDES

    def check(self) -> None:
        from polytrain.data.registry import check_data
        from polytrain.models.registry import resolve_model_factory

        if self.workers < 2:
            raise ConfigError(f"--workers must be >= 2 for --suite goodput (a job that loses its only worker has "
                              f"nothing to go on with), got {self.workers}")
        if self.duration <= 0 or self.failure_every <= 0 or self.checkpoint_every_seconds <= 0:
            raise ConfigError("--duration, --failure-every and --checkpoint-every-seconds must be > 0 seconds")
        if self.failure_every >= self.duration:
            raise ConfigError(f"--failure-every {self.failure_every:g}s: no failure would fall within --duration "
                              f"{self.duration:g}s; give a shorter interval or a longer duration")
        unknown = [s for s in self.sides if s not in SIDES]
        if unknown:
            raise ConfigError(f"unknown side(s) {', '.join(unknown)}; known: {', '.join(SIDES)}")
        resolve_model_factory(self.model)
        check_data(self.data)

    @property
    def kills(self) -> int:
        """Kills due within the duration (none exactly at its end)."""
        count = int(self.duration // self.failure_every)
        return count - 1 if count * self.failure_every >= self.duration else count


def continue_available() -> bool:
    """Whether the installed polytrain has ``--on-failure continue``."""
    help_text = subprocess.run([sys.executable, "-m", "polytrain", "train", "--help-all"], capture_output=True,
                               text=True, timeout=120).stdout
    return "--on-failure" in help_text and "continue" in help_text.split("--on-failure", 1)[1][:400]


def command(cfg: GoodputBenchConfig, side: str, workdir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "polytrain", "train", "--strategy", "sync", "--workers", str(cfg.workers),
           "--model", cfg.model, "--data", cfg.data, "--batch-size", str(cfg.batch_size), "--lr", str(cfg.lr),
           "--seed", str(cfg.seed), "--steps", "1000000000", "--progress", "off", "--eval-every", "0",
           "--log-every", "1", "--histogram-every", "0", "--heartbeat-timeout", f"{cfg.heartbeat_timeout:g}",
           "--timeout", f"{cfg.timeout:g}", "--metrics-file", str(workdir / f"{side}.jsonl"),
           "--comm", "backend"]  # every job alike: --on-failure continue averages through the process group
    if side == "max-restarts":
        cmd += ["--checkpoint-dir", str(workdir / "checkpoints"), "--checkpoint-every-seconds",
                f"{cfg.checkpoint_every_seconds:g}", "--max-restarts", str(cfg.kills + 10)]
        if cfg.snapshot_every:
            cmd += ["--snapshot-every", str(cfg.snapshot_every)]
    elif side == "continue":  # --max-restarts: a replacement joins for each lost worker (no checkpoint needed)
        cmd += ["--on-failure", "continue", "--max-restarts", str(cfg.kills + 10)]
    return cmd


# -- the job's processes -------------------------------------------------------------------------------


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z":
                out.setdefault(int(fields[1]), []).append(int(entry))
    return out


def workers_of(pid: int) -> dict[int, int]:
    """rank -> pid of the live polytrain workers below ``pid`` (their process name is ``polytrain-rN``)."""
    children, todo, found = _children(), [pid], {}
    while todo:
        current = todo.pop()
        todo += children.get(current, [])
        try:
            with open(f"/proc/{current}/comm") as fh:
                name = fh.read().strip()
        except OSError:
            continue
        if name.startswith("polytrain-r") and name[len("polytrain-r"):].isdigit():
            found[int(name[len("polytrain-r"):])] = current
    return found


def last_step(metrics: Path) -> int:
    """The step of the last step record in ``metrics`` (0: none yet)."""
    try:
        with open(metrics, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 65536))
            lines = fh.read().decode(errors="replace").splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        if '"event": "step"' in line:
            try:
                return int(json.loads(line)["step"])
            except (ValueError, KeyError):
                continue
    return 0


def run_side(cfg: GoodputBenchConfig, side: str, workdir: Path,
             progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Run one job for ``cfg.duration`` seconds (killing workers on the schedule unless undisturbed)."""
    metrics = workdir / f"{side}.jsonl"
    log = open(workdir / f"{side}.log", "w")
    rng = random.Random(f"{cfg.seed}/{side}")
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    proc = subprocess.Popen(command(cfg, side, workdir), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    kills: list[dict[str, Any]] = []
    due = [started + (k + 1) * cfg.failure_every for k in range(cfg.kills)] if side != "undisturbed" else []
    end = started + cfg.duration
    ended_early = None
    samples: list[tuple[float, int]] = []  # (seconds since the start, progress) twice a second
    try:
        while time.monotonic() < end:
            if not samples or time.monotonic() - started - samples[-1][0] >= 0.5:
                samples.append((round(time.monotonic() - started, 2), last_step(metrics)))
            if proc.poll() is not None:
                ended_early = proc.returncode
                break
            if due and time.monotonic() >= due[0]:
                victims = workers_of(proc.pid)  # (continue: rank 0 too; the lowest survivor writes the metrics)
                if victims:
                    rank = rng.choice(sorted(victims))
                    with _suppress():
                        os.kill(victims[rank], signal.SIGKILL)
                    at = time.monotonic() - started
                    kills.append({"at_s": round(at, 2), "rank": rank, "late_s": round(at - (due[0] - started), 2),
                                  "step": last_step(metrics)})
                    progress(f"  {side}: killed worker rank {rank} at {at:.1f} s (step {kills[-1]['step']})")
                    due.pop(0)
            time.sleep(0.05)
        useful = last_step(metrics)
        wall = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
    if ended_early is not None:
        tail = "\n".join((workdir / f"{side}.log").read_text().strip().splitlines()[-15:])
        raise BenchError(f"the {side} job ended by itself after {wall:.0f} s (exit code {ended_early}):\n{tail}")
    lines = metrics.read_text().splitlines() if metrics.exists() else []  # (none: it never reached a step)
    events = [json.loads(line) for line in lines if '"event": "step"' not in line]
    for kill in kills:  # what the failure cost: from the kill until the job is back at the step it had reached
        back = next((t for t, step in samples if t > kill["at_s"] and step > kill["step"]), None)
        kill["back_after_s"] = None if back is None else round(back - kill["at_s"], 2)
    return {"side": side, "wall_s": round(wall, 2), "useful_steps": useful,
            "useful_steps_per_s": round(useful / wall, 3), "kills": kills,
            "restarts": sum(1 for e in events if e.get("event") == "restart"),
            # each restart's own reading (train/recovery.py): the death to the next completed step, and back to
            # the step reached (the steps redone included)
            "recoveries": [e for e in events if e.get("event") == "recovery"],
            "exit_code": proc.returncode, "load_1min_before": round(load_before, 2),
            "load_1min_after": round(os.getloadavg()[0], 2), "progress": samples[::10]}


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return exc[0] is not None and issubclass(exc[0], ProcessLookupError)


def run_suite(cfg: GoodputBenchConfig, progress: Callable[[str], None] = lambda _: None,
              workdir: Path | None = None) -> dict[str, Any]:
    sides = list(cfg.sides)
    skipped = {}
    if "continue" in sides and not continue_available():
        sides.remove("continue")
        skipped["continue"] = "this polytrain has no --on-failure continue"
    results = []
    with tempfile.TemporaryDirectory(prefix="polytrain-goodput-") as tmp:
        for side in sides:
            progress(f"{side}: {cfg.duration:g} s" + (f", a worker killed every {cfg.failure_every:g} s"
                                                        if side != "undisturbed" else ""))
            try:
                results.append(run_side(cfg, side, workdir or Path(tmp), progress))
            except BenchError as exc:  # the other jobs' results are still worth having
                skipped[side] = f"failed: {exc}"
                progress(f"  {side}: {exc}")
                continue
            progress(f"  {side}: {results[-1]['useful_steps']} useful steps in {results[-1]['wall_s']:.0f} s")
    base = next((r for r in results if r["side"] == "undisturbed"), None)
    for r in results:
        r["goodput"] = round(r["useful_steps"] / base["useful_steps"], 4) if base and base["useful_steps"] else None
        r["target"] = TARGETS.get(r["side"])
        lost_time(r)
    return {"suite": "goodput", "config": {**asdict(cfg), "sides": list(cfg.sides)}, "results": results,
            "skipped": skipped, "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def lost_time(r: dict[str, Any]) -> None:
    """A second reading, from within the job alone (so not moved by a load that changed between jobs): the
    seconds its failures cost (each kill until the job was back at the step it had reached) and the share of
    its training time (from its first step) they leave. A kill the job never came back from costs the time until
    the next kill, or the job's end."""
    ends = [k["at_s"] for k in r["kills"][1:]] + [r["wall_s"]]
    costs = [k["back_after_s"] if k.get("back_after_s") is not None else end - k["at_s"]
             for k, end in zip(r["kills"], ends) if "at_s" in k]
    first = next((t for t, step in r.get("progress", []) if step > 0), None)
    r["lost_s"] = round(sum(costs), 1) if r["kills"] else 0.0
    training = r["wall_s"] - first if first is not None else None
    r["goodput_by_lost_time"] = round(1 - r["lost_s"] / training, 4) if training else None


def _spread(costs: dict[str, dict[str, float]], key: str, form: str = ".1f") -> str:
    if key not in costs:
        return "-"
    c = costs[key]
    return f"{c['median']:{form}} ({c['min']:{form}}-{c['max']:{form}})"


def describe(cfg: GoodputBenchConfig) -> str:
    return (f"goodput: polytrain train --strategy sync --workers {cfg.workers} --model {cfg.model} --data {cfg.data} "
            f"--batch-size {cfg.batch_size}, each job {cfg.duration:g} s of wall time; a random worker SIGKILLed "
            f"every {cfg.failure_every:g} s ({cfg.kills} kills); --max-restarts with a checkpoint every "
            f"{cfg.checkpoint_every_seconds:g} s" + (f" and a snapshot every {cfg.snapshot_every} steps"
                                                    if cfg.snapshot_every else "") + f"; jobs: {', '.join(cfg.sides)}")


def format_text(doc: dict[str, Any]) -> str:
    cfg = doc["config"]
    lines = [f"goodput over {cfg['duration']:g} s per job, a worker killed every {cfg['failure_every']:g} s, "
             f"{cfg['workers']} workers ({doc['machine']['cpus']} CPUs), {doc['date']}", "",
             "| job | useful steps | steps/s | goodput | kills | restarts | s lost to failures | 1 - lost / training s "
             "| s per failure: death to back at the step reached | death to the next step | steps redone "
             "| load before -> after |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        good = "1 (reference)" if r["side"] == "undisturbed" else "- (no undisturbed job)" \
            if r["goodput"] is None else f"{r['goodput']:.3f}" + (f" (target {r['target']})" if r["target"] else "")
        if "lost_s" not in r:
            lost_time(r)
        by_lost = "-" if r["goodput_by_lost_time"] is None or not r["kills"] else f"{r['goodput_by_lost_time']:.3f}"
        costs = cost_summary(r.get("recoveries", [])) or {}  # median (min-max) over the job's restarts
        lines.append(f"| {r['side']} | {r['useful_steps']} | {r['useful_steps_per_s']:.2f} | {good} | "
                     f"{len(r['kills'])} | {r['restarts']} | {r['lost_s']:.0f} | {by_lost} | "
                     f"{_spread(costs, 'back_s')} | {_spread(costs, 'first_step_s')} | "
                     f"{_spread(costs, 'redone_steps', '.0f')} | {r['load_1min_before']} -> {r['load_1min_after']} |")
    for side, why in doc["skipped"].items():
        lines.append(f"\nnot run: {side} ({why})")
    return "\n".join(lines)


def format_markdown(doc: dict[str, Any]) -> str:
    kills = "\n".join(f"- {r['side']}: " + ", ".join(
        f"rank {k['rank']} at {k['at_s']:.0f} s (step {k['step']}, back there after "
        + ("-" if k.get("back_after_s") is None else f"{k['back_after_s']:.1f} s") + ")" for k in r["kills"])
        for r in doc["results"] if r["kills"])
    return f"{format_text(doc)}\n\nkills (and how long until the job was back at the step it had reached):\n\n{kills}\n"
