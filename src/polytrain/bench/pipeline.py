"""``polytrain bench --suite pipeline``: how close a real pipeline comes to its theoretical speed-up.

The same training steps (model, data, global batch) run as ``single`` with 1 thread and as ``pipeline`` with
P stage processes x 1 thread each, for every micro-batch count M and every schedule the installed torch
provides that applies to P. Cases run in interleaved repeats (each repeat starting one case later) and
each speed-up is the median of per-repeat ratios, so the slow phases of a shared machine fall on no case
in particular. Beside each measured speed-up stand the theoretical one, ``P * vM / (vM + P - 1)`` (the
idle share of equal stages is ``(P-1) / (vM + P - 1)`` with v chunks per rank), the efficiency
measured / theoretical, and each stage's busy and idle seconds per step as the strategy measured them.

The automatic split's balance is checked here too (:func:`split_balance`): ``--split-at auto``'s choice
for 2 and 4 stages, its stages' costs measured again in a second, independent profile.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from polytrain.bench.cases import interleaved
from polytrain.bench.measure import BenchError
from polytrain.errors import ConfigError
from polytrain.parallel.pp import plan, split


@dataclass(frozen=True)
class PipelineBenchConfig:
    # 8 equal blocks of width 128 over 64 tokens: a micro-batch of 4 sequences costs tens of ms per stage
    # on one core, so compute outweighs the 128 KiB activation each hop sends; with 8 blocks even 4
    # stages get 2 each, so the head (a tenth of a block) cannot unbalance them
    model: str = "transformer_lm:layers=8,dim=128,heads=4"
    data: str = "text:seq_len=64"
    batch_size: int = 32
    stages: int = 2
    microbatches: tuple[int, ...] = (1, 2, 4, 8)
    schedules: tuple[str, ...] = ()  # empty: every schedule the installed torch provides
    warmup: int = 3
    steps: int = 10
    repeats: int = 3
    lr: float = 0.01
    momentum: float = 0.9
    seed: int = 0
    timeout: float = 300.0
    balance_stages: tuple[int, ...] = (2, 4)  # stage counts whose automatic split is checked
    reference_every: int = 4  # single runs again after this many other runs (see running_order)
    #: each pipeline case also as a plain torch.distributed.pipelining loop on the same stages and batches
    #: (bench/pipeline_reference.py); the pipeline cases then cut where ``split_at`` says (empty: stages of
    #: equal parameters), so that both run the same stages
    plain: bool = True
    split_at: str = ""

    def check(self) -> None:
        """Raise ConfigError naming the bad setting before anything starts."""
        for name in ("batch_size", "warmup", "steps", "repeats", "reference_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.stages < 2:
            raise ConfigError(f"--stages {self.stages}: a pipeline needs at least 2 stages")
        for m in self.microbatches:
            if m < 1 or self.batch_size % m:
                raise ConfigError(f"--microbatches {m} does not divide --batch-size {self.batch_size}; pass "
                                  f"divisors of {self.batch_size}")
        for name in self.schedules:
            plan.torch_schedule_class(name)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PipelineCase:
    key: str
    label: str
    strategy: str
    schedule: str | None = None
    microbatches: int = 1
    stages: int = 1
    chunks: int = 1
    split_at: str | None = None  # the stages' first units (a pipeline case beside a plain one)

    def settings(self) -> dict[str, Any]:
        if self.strategy == "single":
            return {"strategy": "single"}
        named = {"split_at": self.split_at} if self.split_at else {}
        return {"strategy": "pipeline", "pp": self.stages, "microbatches": self.microbatches,
                "schedule": self.schedule, **named}

    def theoretical_bubble(self) -> float:
        return float(plan.theoretical_bubble(self.stages, self.microbatches, self.chunks))

    def theoretical_speedup(self) -> float:
        return self.stages * (1 - self.theoretical_bubble())


def installed_schedules() -> list[str]:
    out = []
    for name in plan.SCHEDULES:
        try:
            plan.torch_schedule_class(name)
        except ConfigError:
            continue
        out.append(name)
    return out


def cases(cfg: PipelineBenchConfig) -> tuple[list[PipelineCase], list[str]]:
    """The cases (single first) and, for every (schedule, M) left out, why: the schedule's own limits."""
    out = [PipelineCase("single", "single, 1 thread", "single"),
           PipelineCase("ceiling", f"{cfg.stages} independent processes x 1 thread", "ceiling", stages=cfg.stages)]
    skipped = []
    named = (cfg.split_at or equal_split(cfg)) if cfg.plain else None
    for name in cfg.schedules or installed_schedules():
        for m in cfg.microbatches:
            try:
                info = plan.check_schedule(name, cfg.stages, m)
            except ConfigError as exc:
                skipped.append(f"{name} M={m}: {exc}")
                continue
            out.append(PipelineCase(f"{name}_m{m}", f"{name}, P={cfg.stages}, M={m}", "pipeline", name, m,
                                    cfg.stages, info.chunks, named))
            if not cfg.plain:
                continue
            if info.chunks != 1:
                skipped.append(f"plain {name} M={m}: the plain loop runs one stage per rank")
                continue
            out.append(PipelineCase(f"plain_{name}_m{m}", f"plain torch pipelining {name}, P={cfg.stages}, M={m}",
                                    "plain", name, m, cfg.stages, 1, named))
    return out, skipped


def equal_split(cfg: PipelineBenchConfig) -> str:
    """The units that start stages 1.. of ``cfg.stages`` stages of equal parameters (the model on meta)."""
    from polytrain.data.registry import build_data
    from polytrain.models.registry import build_model

    data = build_data(cfg.data, seed=cfg.seed)
    with torch.device("meta"):
        model = build_model(cfg.model, input_shape=data.input_shape, num_classes=data.num_outputs)
    parts = split.units(model)
    cuts = split.balanced_cuts([float(sum(p.numel() for p in unit.parameters())) for _, unit in parts],
                               cfg.stages)
    return ",".join(parts[c][0] for c in cuts)


# -- measuring ---------------------------------------------------------------------------------------

@dataclass
class Run:
    """One case's timed window: the rate and, for a pipeline, each rank's seconds per step."""

    case: str
    repeat: int
    examples_per_sec: float
    busy: list[float] = field(default_factory=list)  # per rank, seconds per step inside forward/backward
    idle: list[float] = field(default_factory=list)  # per rank, the rest of the schedule's step
    step_s: float = 0.0
    split: list[list[str]] | None = None
    position: int = 0  # in the running order


def run_case(case: PipelineCase, cfg: PipelineBenchConfig, repeat: int, workdir: Path) -> Run:
    if case.strategy == "ceiling":
        return run_ceiling(case, cfg, repeat, workdir)
    if case.strategy == "plain":
        return run_plain(case, cfg, repeat, workdir)
    from polytrain.api import fit

    metrics = workdir / f"{case.key}-{repeat}.jsonl"
    end = cfg.warmup + cfg.steps
    try:
        summary = fit(model=cfg.model, data=cfg.data, batch_size=cfg.batch_size, steps=end, optimizer="sgd",
                      lr=cfg.lr, momentum=cfg.momentum, seed=cfg.seed, device="cpu", threads_per_worker=1,
                      timeout=cfg.timeout, log_every=cfg.warmup, eval_every=0, histogram_every=0, progress="off",
                      metrics_file=str(metrics), **case.settings())
    except Exception as exc:  # noqa: BLE001 - a case that fails is reported by name, the rest still run
        raise BenchError(f"{case.label}: {type(exc).__name__}: {exc}") from exc
    return window(case, repeat, metrics, cfg, summary.get("pipeline_split"))


def run_plain(case: PipelineCase, cfg: PipelineBenchConfig, repeat: int, workdir: Path) -> Run:
    """The plain torch.distributed.pipelining loop (bench/pipeline_reference.py) on the case's stages."""
    import sys

    from polytrain.bench.measure import run_reference

    result = workdir / f"{case.key}-{repeat}.json"
    command = [sys.executable, "-m", "polytrain.bench.pipeline_reference", "--stages", str(case.stages),
               "--schedule", str(case.schedule), "--microbatches", str(case.microbatches), "--split-at",
               str(case.split_at), "--model", cfg.model, "--data", cfg.data, "--batch-size", str(cfg.batch_size),
               "--warmup", str(cfg.warmup), "--steps", str(cfg.steps), "--lr", str(cfg.lr), "--momentum",
               str(cfg.momentum), "--seed", str(cfg.seed), "--timeout", str(cfg.timeout), "--result", str(result)]
    out = run_reference(case.label, command, result, cfg)
    return Run(case.key, repeat, out["examples_per_sec"], step_s=out["window_s"] / cfg.steps,
               split=[[n] for n in str(case.split_at).split(",")])


def run_ceiling(case: PipelineCase, cfg: PipelineBenchConfig, repeat: int, workdir: Path) -> Run:
    """P processes each training its own copy on the whole batch, nothing exchanged (the throughput suite's
    DDP script without gradient exchange): what P cores give at this moment, whatever else runs on them.
    Its rate per process over single's is the most any P-process method could reach against single."""
    from polytrain.bench.cases import BenchConfig, Case
    from polytrain.bench.measure import run_ddp

    bench = BenchConfig(model=cfg.model, data=cfg.data, worker_batch_size=cfg.batch_size, workers=case.stages,
                        warmup=cfg.warmup, steps=cfg.steps, lr=cfg.lr, momentum=cfg.momentum, seed=cfg.seed,
                        timeout=cfg.timeout)
    ddp_case = Case(case.key, case.label, "ddp", "sync", case.stages, 1, case.stages * cfg.batch_size,
                    exchange=False)
    m = run_ddp(ddp_case, bench, repeat, workdir)
    # examples/s per process: the rate single would have on each of the P cores at once
    return Run(case.key, repeat, m.examples_per_sec / case.stages, step_s=m.window_s / cfg.steps)


def window(case: PipelineCase, repeat: int, metrics: Path, cfg: PipelineBenchConfig,
           chosen: list[list[str]] | None = None) -> Run:
    """The steps after the warm-up: the step records at ``warmup`` and ``warmup + steps`` bound the wall
    time; the records in between (and the last) sum each rank's busy and idle seconds over exactly them."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = {r["step"]: r for r in records if r.get("event") == "step"}
    start, end = cfg.warmup, cfg.warmup + cfg.steps
    if start not in steps or end not in steps:
        raise BenchError(f"{case.label}: the metrics file {metrics} has no step record {start} or {end}; "
                         f"it has {sorted(steps)}")
    seconds = steps[end]["time_s"] - steps[start]["time_s"]
    inside = [r for s, r in steps.items() if start < s <= end]
    busy = _per_rank(inside, "rank_pp_busy_s", cfg.steps)
    idle = _per_rank(inside, "rank_pp_idle_s", cfg.steps)
    return Run(case.key, repeat, cfg.steps * cfg.batch_size / seconds, busy, idle, seconds / cfg.steps, chosen)


def _per_rank(records: list[dict[str, Any]], key: str, steps: int) -> list[float]:
    columns = [r[key] for r in records if key in r]
    return [sum(values) / steps for values in zip(*columns)] if columns else []


def running_order(chosen: list[PipelineCase], repeats: int, every: int) -> list[tuple[int, PipelineCase]]:
    """(repeat, case) in running order: the cases after ``single`` interleaved over the repeats (each repeat
    starting one case later), with ``single`` run first, after every ``every`` of them, and last. Each run
    is then compared with the single runs just before and after it: on a shared machine whose load swings
    within minutes, a single run one repeat (twenty runs) away says little about the moment a case ran."""
    single, others = chosen[0], chosen[1:]
    order = []
    for i, (repeat, case) in enumerate(interleaved(others, repeats)):
        if i % every == 0:
            order.append((repeat, single))
        order.append((repeat, case))
    order.append((repeats - 1, single))
    return order


# -- the automatic split's balance ---------------------------------------------------------------------

#: the target for ``--split-at auto``: slowest / fastest stage, measured
BALANCE_TARGET = 1.25


def stage_costs(costs: list[float], cuts: list[int]) -> list[float]:
    return [sum(costs[i] for i in g) for g in split.groups(cuts, len(costs))]


def balance_ratio(costs: list[float], stages: int) -> tuple[list[int], float]:
    """The cuts ``--split-at auto`` chooses from ``costs`` and the slowest/fastest stage ratio they give."""
    cuts = split.balanced_cuts(costs, stages)
    per_stage = stage_costs(costs, cuts)
    return cuts, max(per_stage) / max(min(per_stage), 1e-12)


def split_balance(cfg: PipelineBenchConfig, stages: int, repeats: int = 11) -> dict[str, Any]:
    """Choose the split as ``--split-at auto`` does (each unit's forward+backward on one micro-batch of the
    largest M, 1 thread), then time the units again and judge the chosen stages on the second profile:
    a ratio judged on the numbers that chose it would flatter the split by their noise."""
    from polytrain.data.registry import build_data
    from polytrain.models.registry import build_model

    data = build_data(cfg.data, seed=cfg.seed)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, input_shape=data.input_shape, num_classes=data.num_outputs, seed=cfg.seed)
    micro = cfg.batch_size // max(cfg.microbatches)
    sample = data.train.get_batch(torch.arange(micro), 0)[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each stage process runs
    try:
        names = [name for name, _ in split.units(model)]
        split.check_splittable(names, stages, f"balance check of {stages} stages")
        chosen_on, _ = split.measure(model, sample, repeats)
        checked_on, _ = split.measure(model, sample, repeats)
    finally:
        torch.set_num_threads(threads)
    cuts, _ = balance_ratio(chosen_on, stages)
    per_stage = stage_costs(checked_on, cuts)
    ratio = max(per_stage) / max(min(per_stage), 1e-12)
    return {"stages": stages, "micro_batch": micro, "units": names,
            "cuts": [names[c] for c in cuts], "stage_units": [[names[i] for i in g]
                                                             for g in split.groups(cuts, len(names))],
            "unit_ms": [round(v, 3) for v in checked_on], "stage_ms": [round(v, 3) for v in per_stage],
            "ratio": round(ratio, 4), "target": BALANCE_TARGET, "met": ratio <= BALANCE_TARGET}


def median(values: list[float]) -> float:
    return statistics.median(values)
