"""``--profile STEPS``: a ``torch.profiler`` trace of a few steps on every trainer rank, and where their time went.

For steps ``A-B`` (counted from 1, as the step log counts them; ``N`` alone is one step) each trainer rank runs
``torch.profiler`` (CPU, and CUDA on a GPU) and writes a Chrome trace, ``DIR/rank-R.pt.trace.json`` (open it in
Perfetto, ui.perfetto.dev, or chrome://tracing). The step's parts appear there as ``polytrain.step N`` ranges
holding ``polytrain.data``, ``forward``, ``backward``, ``exchange``, ``wait`` and ``update`` ranges
(:mod:`polytrain.phases`: the trainer and the strategies label them) over the operators they ran.

The profiler starts one step before the first (a warm-up step in the trace, outside the summary). Each rank
also times its labelled phases; after the last profiled step the trainers' rank 0 prints one table
(and writes ``DIR/summary.txt`` and ``summary.json``): per rank, each phase's own milliseconds per step (a
phase's time less the labelled phases inside it), their sum and the step as the trainer measured it; what
no label covers is ``other``. ``DIR`` is ``--profile-dir``, by default ``profile`` under ``--log-dir`` or
``polytrain-profile`` in the working directory.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polytrain import phases
from polytrain.errors import ConfigError
from polytrain.options import option, register_section

_WINDOW = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def parse_window(text: str) -> tuple[int, int]:
    """``(first, last)`` steps of ``A-B`` or ``N`` (counted from 1); ValueError with the reason otherwise."""
    match = _WINDOW.match(text)
    if match is None:
        raise ValueError(f"'{text}': expected steps A-B (e.g. 20-25) or one step N, counted from 1")
    first = int(match.group(1))
    last = int(match.group(2)) if match.group(2) is not None else first
    if first < 1 or last < first:
        raise ValueError(f"'{text}': expected 1 <= A <= B, got A={first}, B={last}")
    return first, last


def _check_window(text: str | None) -> None:
    if text is not None:
        parse_window(text)


@register_section("profile", "profiling a few steps", order=92)
@dataclass
class ProfileConfig:
    profile: str | None = option(None, "trace steps A-B (e.g. 20-25, counted from 1) with torch.profiler on "
                                       "every trainer rank (Chrome traces for Perfetto) and print where each "
                                       "rank's step time goes: data, forward, backward, exchange, wait, update",
                                 metavar="A-B", check=_check_window)
    profile_dir: str | None = option(None, "where --profile writes its traces and summary (default: profile "
                                           "under --log-dir, else ./polytrain-profile)", metavar="DIR")


def profile_dir(config: Any) -> Path:
    chosen = config.profile.profile_dir
    if chosen:
        return Path(chosen)
    return Path(config.log.log_dir, "profile") if config.log.log_dir else Path("polytrain-profile")


class StepProfiler:
    """Profiles steps ``first``..``last`` of this trainer rank; the trainer calls :meth:`step` around each step
    and :meth:`measured` with the step's time."""

    def __init__(self, config: Any, topology: Any, start_step: int, total_steps: int):
        text = config.profile.profile
        self.first, self.last = parse_window(text)
        if self.first > total_steps or self.last <= start_step:
            raise ConfigError(f"--profile {text}: this run trains steps {start_step + 1}-{total_steps}; give "
                              "steps within them")
        self.first, self.last = max(self.first, start_step + 1), min(self.last, total_steps)
        # the profiler starts a step early where there is one (its start-up cost stays out of the window)
        self.start_at = self.first - 1 if self.first - 1 > start_step else self.first
        self.topology, self.dir = topology, profile_dir(config)
        self.trace = self.dir / f"rank-{topology.rank}.pt.trace.json"
        self.steps: list[dict[str, Any]] = []  # per profiled step: its own seconds by phase and its measured time
        self._torch: Any = None
        self._current: phases.StepPhases | None = None
        self._anchor: tuple[str, float] | None = None  # (a step range's name, its start): the trace's clock

    def step(self, number: int) -> Any:
        """A context for step ``number`` (counted from 1): recorded when it is in the window."""
        if self._torch is None and number == self.start_at:
            self._start()
        if not self.first <= number <= self.last:
            return _NULL
        self._current = phases.StepPhases()
        return _ProfiledStep(self, number)

    def measured(self, number: int, seconds: float) -> None:
        """The trainer's own time for step ``number``; after the window's last step, the trace and summary."""
        if self._current is None:
            return
        self.steps.append({"step": number, "step_s": seconds, "phases": self._current.own_seconds(),
                           "moved": self._current.moved})
        self._current = None
        if number == self.last:
            self._finish()

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.topology.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._torch = profile(activities=activities)
        self._torch.__enter__()

    def _finish(self) -> None:
        self._torch.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._torch.export_chrome_trace(str(self.trace))
        _add_moved(self.trace, self._anchor, [m for s in self.steps for m in s["moved"]])
        mine = {"rank": self.topology.rank, "trace": str(self.trace),
                "steps": [{k: v for k, v in s.items() if k != "moved"} for s in self.steps]}
        everyone = self.topology.all_gather_object(mine)  # every trainer rank reaches its window's end
        if self.topology.is_main:
            from polytrain.log import get_logger

            text = summary_table(everyone)
            (self.dir / "summary.txt").write_text(text + "\n")
            (self.dir / "summary.json").write_text(json.dumps(everyone, indent=1))
            get_logger().info(f"profile of steps {self.first}-{self.last} (traces and summary in {self.dir}):\n{text}")


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_NULL = _Null()


class _ProfiledStep:
    def __init__(self, owner: StepProfiler, number: int):
        self.owner, self.number = owner, number
        self._stack: list[Any] = []

    def __enter__(self) -> None:
        from torch.profiler import record_function

        owner = self.owner
        name = f"polytrain.step {self.number}"
        rec = phases.recording(owner._current)
        rec.__enter__()
        span = record_function(name)
        if owner._anchor is None:
            owner._anchor = (name, time.perf_counter())
        span.__enter__()
        self._stack = [rec, span]

    def __exit__(self, *exc: Any) -> None:
        rec, span = self._stack
        span.__exit__(*exc)
        rec.__exit__(*exc)


def _add_moved(path: Path, anchor: tuple[str, float] | None, moved: list[tuple[str, float, float]]) -> None:
    """Put the intervals a strategy measured inside another phase into the trace, as ranges of their own on
    the thread of the step that held them (the trace's clock found from the first step's range)."""
    if not moved or anchor is None:
        return
    trace = json.loads(path.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    name, started = anchor
    first = next((e for e in events if e.get("name") == name and e.get("ph") == "X"), None)
    if first is None:
        return
    offset_us = float(first["ts"]) - started * 1e6
    for label, start, end in moved:
        events.append({"ph": "X", "cat": "user_annotation", "name": f"polytrain.{label}", "pid": first["pid"],
                       "tid": first["tid"], "ts": offset_us + start * 1e6, "dur": (end - start) * 1e6,
                       "args": {"measured by": "the strategy, inside the enclosing phase"}})
    path.write_text(json.dumps(trace))


def summary_table(ranks: list[dict[str, Any]]) -> str:
    """Per rank: the measured step and each phase's own time, mean milliseconds per profiled step, with its
    share of the step; ``labelled`` is the phases' sum, ``other`` the rest of the step."""
    head = ["rank", "step ms"] + list(phases.PHASES) + ["other", "labelled"]
    rows = [head]
    for entry in sorted(ranks, key=lambda e: e["rank"]):
        steps = entry["steps"]
        count = max(len(steps), 1)
        step_ms = 1000 * sum(s["step_s"] for s in steps) / count
        own = {name: 1000 * sum(s["phases"].get(name, 0.0) for s in steps) / count for name in phases.PHASES}
        labelled = sum(own.values())
        share = (lambda ms: f"{ms:.2f} ({100 * ms / step_ms:.0f}%)") if step_ms > 0 else (lambda ms: f"{ms:.2f}")
        rows.append([str(entry["rank"]), f"{step_ms:.2f}"] + [share(own[name]) for name in phases.PHASES]
                    + [share(step_ms - labelled), share(labelled)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    return "\n".join(["mean milliseconds per step (share of the step each rank measured)"] + lines)
