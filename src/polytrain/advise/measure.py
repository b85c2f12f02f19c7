"""What ``polytrain advise`` measures on this machine: each strategy trained once on loopback (``--measure-workers``
workers, the same budget for every one, through ``polytrain compare``'s runner), read back into a
:class:`~polytrain.advise.model.Profile`: one worker's step time with nothing on the wire, the bytes one
exchange hands to the transport, how they cross the links, and the examples it took to reach the target.

``sync`` is measured with ``--comm backend`` (gloo over loopback), as it runs between machines; on loopback its
bytes cost well under a millisecond a step, which is left in ``step_s``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Callable

from polytrain.advise.model import Profile, wire_bytes
from polytrain.compare.specs import CompareConfig, StrategySpec, parse_specs

#: the strategies advise compares unless told otherwise
DEFAULT_STRATEGIES = ("sync,sync:compress=powersgd:rank=4,async,local-sgd:sync_every=8,diloco:sync_every=8,"
                      "diloco:sync_every=8:outer_quantize=int8")


def parse(text: str) -> list[StrategySpec]:
    """``compare``'s specs, where a setting's value may itself hold ``:`` (``sync:compress=powersgd:rank=4``):
    a piece that is no setting's key continues the previous value."""
    from polytrain.config import all_options

    keys = {info.key for info in all_options()}
    specs = []
    for spec in parse_specs(text):
        settings: dict[str, str] = {}
        last = None
        for key, value in spec.settings.items():
            if key not in keys and last is not None:
                settings[last] += f":{key}={value}"
            else:
                settings[key] = value
                last = key
        specs.append(StrategySpec(spec.text, spec.name, settings))
    return specs


def for_measuring(spec: StrategySpec) -> StrategySpec:
    """sync over the process group (as between machines), not shared memory."""
    if spec.name == "sync" and "comm" not in spec.settings:
        return StrategySpec(spec.text, spec.name, {**spec.settings, "comm": "backend"})
    return spec


def measure(cfg: CompareConfig, specs: list[StrategySpec], workdir: Path,
            progress: Callable[[str], None] = lambda message: None) -> list[Profile]:
    from polytrain.compare.runner import Case, run_cases

    cases = [Case(for_measuring(spec), []) for spec in specs]
    run_cases(cfg, cases, workdir, progress)  # one round: each case's metrics file is <stem>.jsonl
    profiles = []
    for case in cases:
        records = _records(workdir / f"{case.file_stem}.jsonl")
        profiles.append(profile_of(cfg, case.spec, records, _examples_to_target(cfg, records)))
    return profiles


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def examples_to_target(cfg: CompareConfig, records: list[dict[str, Any]]) -> float | None:
    return _examples_to_target(cfg, records)


def _examples_to_target(cfg: CompareConfig, records: list[dict[str, Any]]) -> float | None:
    global_batch = cfg.workers * cfg.worker_batch_size
    for r in records:
        if r["event"] != "eval":
            continue
        accuracy, loss = r.get("eval_accuracy"), r.get("eval_loss")
        if (cfg.target_accuracy is not None and accuracy is not None and accuracy >= cfg.target_accuracy) or \
                (cfg.target_loss is not None and loss is not None and loss <= cfg.target_loss):
            return float(r["step"] * global_batch)
    return None


def shape_of(spec: StrategySpec, config: Any) -> tuple[str, int, int]:
    """(pattern, steps per exchange, overlap steps) of a strategy with its resolved settings."""
    if spec.name in ("local-sgd", "diloco"):
        periodic = config.periodic
        quantized = spec.name == "diloco" and periodic.outer_quantize != "off"
        overlap = periodic.overlap_steps if spec.name == "diloco" else 0
        return ("gather" if quantized else "ring"), periodic.sync_every, overlap
    if spec.name == "async":
        return "server", 1, 0
    if spec.name == "single":
        return "none", 1, 0
    return "ring", 1, 0


def profile_of(cfg: CompareConfig, spec: StrategySpec, records: list[dict[str, Any]],
               examples_to_target: float | None, quantile: float = 0.5) -> Profile:
    """One strategy's profile from its run's metrics records (``step`` records at every log point, ``end``);
    its step time is the ``quantile`` of the log intervals' (the median by default)."""
    from polytrain.config import make_config

    config = make_config(**cfg.settings(spec, []))
    pattern, every, overlap = shape_of(spec, config)
    steps = [r for r in records if r["event"] == "step"]
    # one step of the job: the median over log intervals (an evaluation's interval is an outlier)
    per_step = [(b["time_s"] - a["time_s"]) / (b["step"] - a["step"]) for a, b in zip(steps, steps[1:])
                if b["step"] > a["step"]]
    step_s = _quantile(per_step, quantile) if per_step else 0.0
    # bytes a trainer sent per step over the second half of the run (PowerSGD's whole first steps left out)
    half = [r for r in steps if r["step"] > steps[-1]["step"] / 2] if steps else []
    start = max((r["step"] for r in steps if r["step"] <= steps[-1]["step"] / 2), default=0) if steps else 0
    sent = [sum(r.get("rank_bytes_sent") or [0]) / max(len(r.get("rank_bytes_sent") or [0]), 1) for r in half]
    span = (half[-1]["step"] - start) if half else 0
    per_step_bytes = sum(sent) / span if span else 0.0
    if pattern == "server":
        payload = per_step_bytes  # one push per slice (a pull of the same size comes back)
    else:
        factor = wire_bytes(1.0, pattern, cfg.workers)
        payload = per_step_bytes * every / factor if factor else 0.0
    return Profile(spec.text, step_s, cfg.worker_batch_size, payload, every, pattern, overlap * step_s,
                   examples_to_target)


def _quantile(values: list[float], q: float) -> float:
    if q == 0.5:
        return statistics.median(values)
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def save(profiles: list[Profile], path: Path, meta: dict[str, Any]) -> None:
    path.write_text(json.dumps({"meta": meta, "profiles": [p.__dict__ for p in profiles]}, indent=2) + "\n")


def load(path: Path) -> tuple[list[Profile], dict[str, Any]]:
    doc = json.loads(path.read_text())
    return [Profile(**p) for p in doc["profiles"]], doc.get("meta", {})
