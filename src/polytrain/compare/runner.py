"""Run every case of a comparison through ``polytrain.fit`` and read back what its metrics file recorded.

Every case gets the same model, data, seed, steps and examples per worker per step (``--worker-batch-size``):
one step of every strategy is one gradient computation on that many examples on every worker, so every
case trains on the same number of examples, whatever an update means to its strategy. The cases run one
after another in this process's children (each a full ``fit``: workers spawned and torn down), so none
competes with another for the cores; every case is checked before the first one trains.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from polytrain.compare.specs import CompareConfig, StrategySpec
from polytrain.errors import ConfigError


@dataclass
class Case:
    spec: StrategySpec
    stragglers: list[str]
    link: int | None = None  # --link: bits/s of every link of the emulated network (None: no emulated network)

    @property
    def label(self) -> str:
        return self.spec.text + (f" +straggler {','.join(self.stragglers)}" if self.stragglers else "") \
            + (f" @{_rate(self.link)}" if self.link else "")

    @property
    def file_stem(self) -> str:
        text = self.spec.text + ("-straggler-" + "-".join(self.stragglers) if self.stragglers else "") \
            + (f"-link-{_rate(self.link)}" if self.link else "")
        return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def _rate(bits: int) -> str:
    from polytrain.netlab import format_rate
    return format_rate(bits)


@dataclass
class Outcome:
    """One case's numbers, from its summary and metrics file."""

    label: str
    strategy: str
    stragglers: list[str]
    summary: dict[str, Any]
    #: (wall seconds since the loop began, examples seen, training loss) at every log point
    curve: list[tuple[float, int, float]] = field(default_factory=list)
    #: (step, wall seconds, eval loss, eval accuracy) at every evaluation
    evals: list[tuple[int, float | None, float, float | None]] = field(default_factory=list)
    round: int = 0  # which of the --repeats rounds
    link: int | None = None  # --link: the link rate in bits/s
    link_stats: dict[str, Any] = field(default_factory=dict)  # compare.link.run_on_link's numbers

    @property
    def examples_per_sec(self) -> float | None:
        """End to end: every example trained on over the loop's wall clock to the last log point, waits and
        evaluations included (every case evaluates alike). Not the summary's rank-0 step rate: under
        local-sgd, diloco or async rank 0 may run ahead of a slow rank, and the job ends with the slowest."""
        if not self.curve or self.curve[-1][0] <= 0:
            return None
        return round(self.curve[-1][1] / self.curve[-1][0], 2)

    def time_to(self, accuracy: float | None = None, loss: float | None = None) -> float | None:
        """Wall seconds of training until the first evaluation reaching the target (None: never)."""
        for _, seconds, eval_loss, eval_accuracy in self.evals:
            if accuracy is not None and eval_accuracy is not None and eval_accuracy >= accuracy:
                return seconds
            if loss is not None and eval_loss <= loss:
                return seconds
        return None


def plan_cases(cfg: CompareConfig, specs: list[StrategySpec]) -> list[Case]:
    """Every strategy without stragglers, then (with ``--straggler``) every strategy with them; with
    ``--link``, all of that at each link rate in turn."""
    cases = [Case(spec, []) for spec in specs]
    if cfg.stragglers:
        cases += [Case(spec, list(cfg.stragglers)) for spec in specs]
    if cfg.links:
        cases = [Case(c.spec, c.stragglers, rate) for rate in cfg.links for c in cases]
    return cases


def available(specs: list[StrategySpec], named_by_user: bool) -> tuple[list[StrategySpec], list[str]]:
    """The specs whose strategy exists here; a missing one is an error if the user named it, else a note."""
    from polytrain.strategies import get_strategy

    kept, notes = [], []
    for spec in specs:
        try:
            get_strategy(spec.name)  # (imported here: the forkserver preloads every compared strategy)
            kept.append(spec)
        except ConfigError:
            if named_by_user:
                raise
            notes.append(f"{spec.text}: strategy '{spec.name}' is not available in this install; skipped")
    return kept, notes


def check_cases(cfg: CompareConfig, cases: list[Case]) -> None:
    """Every case's settings checked as ``polytrain train`` would, before any trains; errors name the case."""
    from polytrain.config import make_config
    from polytrain.train.run import check

    for case in cases:
        try:
            check(make_config(**case_settings(cfg, case)))
        except ConfigError as exc:
            raise ConfigError(f"case {case.label}: {exc}") from None


def case_settings(cfg: CompareConfig, case: Case) -> dict[str, Any]:
    """The ``polytrain.fit`` settings of ``case`` (on the emulated network: what keeps traffic on the links)."""
    settings = cfg.settings(case.spec, case.stragglers)
    if case.link:
        from polytrain.compare.link import link_settings
        settings = link_settings(settings)
    return settings


def run_cases(cfg: CompareConfig, cases: list[Case], workdir: Path,
              progress: Callable[[str], None] = lambda message: None) -> list[Outcome]:
    import polytrain

    workdir.mkdir(parents=True, exist_ok=True)
    outcomes = []
    runs = [(r, case) for r in range(cfg.repeats) for case in cases]  # interleaved: drift hits every case alike
    for i, (r, case) in enumerate(runs, 1):
        metrics = workdir / f"{case.file_stem}{f'-round{r + 1}' if cfg.repeats > 1 else ''}.jsonl"
        metrics.unlink(missing_ok=True)  # the metrics file appends: start each case afresh
        progress(f"[{i}/{len(runs)}] {case.label}" + (f" (round {r + 1})" if cfg.repeats > 1 else ""))
        if case.link:
            from polytrain.compare.link import run_on_link
            from polytrain.config import make_config
            from polytrain.train.run import check

            settings = case_settings(cfg, case)
            processes = check(make_config(**settings)).processes  # one node per process, servers included
            summary, link_stats = run_on_link(settings, case.link, processes, metrics, workdir)
            outcome = read_outcome(case, summary, metrics, r)
            outcome.link, outcome.link_stats = case.link, link_stats
        else:
            summary = polytrain.fit(**cfg.settings(case.spec, case.stragglers), metrics_file=str(metrics))
            outcome = read_outcome(case, summary, metrics, r)
        progress(f"    {outcome.examples_per_sec} examples/sec, eval accuracy "
                 f"{_shown(outcome.summary.get('eval_accuracy'), '.4f')}, {_shown(outcome.summary.get('wall_s'), '.1f')} s"
                 + (f", link busy {outcome.link_stats.get('link_utilisation', 0) * 100:.0f} % of the time"
                    if outcome.link_stats.get("link_utilisation") is not None else ""))
        outcomes.append(outcome)
    return outcomes


def read_outcome(case: Case, summary: dict[str, Any], metrics: Path, round: int = 0) -> Outcome:
    """The curve and evaluations of one run from its metrics file; an evaluation's time is that of the step
    record logged at its step (--eval-every is a multiple of --log-every)."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in records if r["event"] == "step"]
    global_batch = int(summary.get("global_batch") or 0)
    time_at = {r["step"]: r["time_s"] for r in steps}
    curve = [(r["time_s"], r["step"] * global_batch, r["loss"]) for r in steps if r.get("loss") is not None]
    evals = [(r["step"], time_at.get(r["step"]), r["eval_loss"], r.get("eval_accuracy"))
             for r in records if r["event"] == "eval"]
    return Outcome(case.label, case.spec.name, case.stragglers, summary, curve, evals, round)


def _shown(value: Any, spec: str) -> str:
    """A summary's number as a progress line shows it (an accuracy to 4 places, not 16); None as is."""
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)
