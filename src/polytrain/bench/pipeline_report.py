"""The pipeline suite: its runs in order (:func:`run_suite`), then its rows, verdicts and outputs: a text table,
Markdown and a PNG plot.

Speed-ups are medians over repeats of each pipeline run's rate over that of the ``single`` runs just
before and after it (``single`` runs every few cases); each stage's busy and idle seconds per step are
medians over repeats.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable

from polytrain.bench.pipeline import (PipelineBenchConfig, PipelineCase, Run, cases, run_case, running_order,
                                      split_balance)
from polytrain.bench.report import environment
from polytrain.parallel.pp import plan

#: the target: at M=8, P=2 the measured speed-up reaches this share of the theoretical one
EFFICIENCY_TARGET = 0.85
TARGET_MICROBATCHES = 8


def _median_columns(lists: list[list[float]]) -> list[float]:
    return [statistics.median(column) for column in zip(*lists)] if lists and lists[0] else []


def reference_rate(run: Run, references: list[Run]) -> float:
    """The mean rate of the reference runs (single's, the ceiling's) just before and just after ``run``
    (the one on its side alone at an end)."""
    before = [r for r in references if r.position < run.position]
    after = [r for r in references if r.position > run.position]
    near = ([before[-1]] if before else []) + ([after[0]] if after else [])
    return statistics.mean(r.examples_per_sec for r in near)


def case_row(case: PipelineCase, mine: list[Run], single: list[Run], ceiling: list[Run]) -> dict[str, Any]:
    rates = [r.examples_per_sec for r in mine]
    row: dict[str, Any] = {"case": case.key, "label": case.label, "strategy": case.strategy,
                           "schedule": case.schedule, "stages": case.stages, "microbatches": case.microbatches,
                           "chunks": case.chunks, "examples_per_sec": round(statistics.median(rates), 2),
                           "runs_examples_per_sec": [round(r, 2) for r in rates],
                           "step_s": round(statistics.median(r.step_s for r in mine), 5)}
    if case.strategy == "single":
        return row
    paired = [r.examples_per_sec / reference_rate(r, single) for r in mine]
    if case.strategy == "ceiling":  # each process's rate against single's: 1 when P cores are P x one core
        row.update({"per_process_vs_single": round(statistics.median(paired), 4),
                    "per_process_vs_single_per_repeat": [round(v, 4) for v in paired]})
        return row
    speedup = statistics.median(paired)
    theory = case.theoretical_speedup()
    busy, idle = _median_columns([r.busy for r in mine]), _median_columns([r.idle for r in mine])
    measured_bubble = [i / (b + i) if b + i else None for b, i in zip(busy, idle)]
    simulated = plan.simulate(case.schedule, case.stages, case.microbatches).bubble
    row.update({
        "speedup": round(speedup, 4), "speedup_per_repeat": [round(v, 4) for v in paired],
        "speedup_theoretical": round(theory, 4), "efficiency": round(speedup / theory, 4),
        "bubble_theoretical": round(case.theoretical_bubble(), 4), "bubble_simulated": round(float(simulated), 4),
        "rank_busy_s": [round(v, 5) for v in busy], "rank_idle_s": [round(v, 5) for v in idle],
        "rank_bubble": [None if v is None else round(v, 4) for v in measured_bubble],
        "busy_slowest_fastest": round(max(busy) / min(busy), 4) if busy and min(busy) > 0 else None,
        "split": mine[-1].split,
    })
    if ceiling:  # against one process as fast as each of P busy ones: the pipeline's own losses only
        at_ceiling = statistics.median(r.examples_per_sec / reference_rate(r, ceiling) for r in mine)
        row["efficiency_at_ceiling"] = round(at_ceiling / theory, 4)
    if case.microbatches == TARGET_MICROBATCHES and case.stages == 2:
        row.update({"target": EFFICIENCY_TARGET, "met": speedup >= EFFICIENCY_TARGET * theory})
    return row


def result_document(cfg: PipelineBenchConfig, chosen: list[PipelineCase], skipped: list[str], runs: list[Run],
                    balance: list[dict[str, Any]]) -> dict[str, Any]:
    def of(key: str) -> list[Run]:
        return sorted((r for r in runs if r.case == key), key=lambda r: r.position)

    rows = [case_row(c, of(c.key), of("single"), of("ceiling")) for c in chosen]
    return {"suite": "pipeline", "config": cfg.to_dict(), "env": environment(), "rows": rows, "skipped": skipped,
            "balance": balance, "plain_ratios": plain_ratios(chosen, of)}


#: the speed polytrain's pipeline should keep of the plain torch.distributed.pipelining loop's
PLAIN_TARGET = 0.98


def plain_ratios(chosen: list[PipelineCase], of: Callable[[str], list[Run]]) -> list[dict[str, Any]]:
    """Each pipeline case against its plain twin (same schedule, M and stages): the median of the per-repeat
    ratios of their rates, with min and max."""
    out = []
    for case in chosen:
        if case.strategy != "plain":
            continue
        ours = {r.repeat: r for r in of(case.key[len("plain_"):])}
        paired = [ours[r.repeat].examples_per_sec / r.examples_per_sec for r in of(case.key) if r.repeat in ours]
        if not paired:
            continue
        value = statistics.median(paired)
        out.append({"case": case.key[len("plain_"):], "schedule": case.schedule, "microbatches": case.microbatches,
                    "split_at": case.split_at, "value": round(value, 4), "min": round(min(paired), 4),
                    "max": round(max(paired), 4), "per_repeat": [round(v, 4) for v in paired],
                    "target": PLAIN_TARGET, "met": value >= PLAIN_TARGET})
    return out


def _plain_lines(doc: dict[str, Any]) -> list[str]:
    return [f"speed pipeline / plain torch pipelining, {r['schedule']} M={r['microbatches']} (stages at "
            f"{r['split_at']}): {r['value']:.3f} ({r['min']:.3f}-{r['max']:.3f}), target >= {r['target']:.2f}: "
            f"{'met' if r['met'] else 'NOT met'}" for r in doc.get("plain_ratios", [])]


def _fmt_list(values: list[Any], spec: str) -> str:
    return "/".join("-" if v is None else format(v, spec) for v in values)


def _verdict(row: dict[str, Any]) -> str:
    if "target" not in row:
        return ""
    return f">= {row['target']:.2f} x theoretical: {'met' if row['met'] else 'NOT met'}"


def _balance_lines(doc: dict[str, Any]) -> list[str]:
    lines = []
    for b in doc["balance"]:
        stages = " | ".join(f"{u[0]}..{u[-1]}" if len(u) > 1 else u[0] for u in b["stage_units"])
        lines.append(f"--split-at auto, {b['stages']} stages: {stages}; stage ms (second profile) "
                     f"{_fmt_list(b['stage_ms'], '.1f')}; slowest/fastest {b['ratio']:.3f} "
                     f"(target <= {b['target']}: {'met' if b['met'] else 'NOT met'})")
    return lines


def _header(doc: dict[str, Any]) -> str:
    cfg, env = doc["config"], doc["env"]
    return (f"{cfg['model']} on {cfg['data']}, global batch {cfg['batch_size']}; single 1 thread against "
            f"pipeline P={cfg['stages']} x 1 thread; median of {cfg['repeats']} interleaved repeat(s) of "
            f"{cfg['steps']} steps after {cfg['warmup']} warm-up; {env['cores']} cores ({env['cpu']}), "
            f"torch {env['torch']}, {env['date']}")


def format_text(doc: dict[str, Any]) -> str:
    lines = [_header(doc), "",
             f"{'case':<30} {'ex/s':>7} {'speed-up':>8} {'theory':>6} {'effic.':>6} {'at ceil.':>8} "
             f"{'bubble th/sim/meas':>22} {'busy s/step':>13} {'idle s/step':>13}  speed-up per repeat"]
    for row in doc["rows"]:
        if row["strategy"] == "single":
            lines.append(f"{row['label']:<30} {row['examples_per_sec']:>7.1f} {'1':>8}")
            continue
        if row["strategy"] == "ceiling":
            per_repeat = _fmt_list(row["per_process_vs_single_per_repeat"], ".3f")
            lines.append(f"{row['label']:<30} {row['examples_per_sec']:>7.1f}   (per process; its rate / single's "
                         f"{row['per_process_vs_single']:.3f}: {per_repeat})")
            continue
        measured = _fmt_list(row["rank_bubble"], ".2f")
        bubble = f"{row['bubble_theoretical']:.2f}/{row['bubble_simulated']:.2f}/{measured}"
        lines.append(f"{row['label']:<30} {row['examples_per_sec']:>7.1f} {row['speedup']:>8.3f} "
                     f"{row['speedup_theoretical']:>6.3f} {row['efficiency']:>6.3f} "
                     f"{row.get('efficiency_at_ceiling', float('nan')):>8.3f} {bubble:>22} "
                     f"{_fmt_list(row['rank_busy_s'], '.3f'):>13} {_fmt_list(row['rank_idle_s'], '.3f'):>13}  "
                     f"{_fmt_list(row['speedup_per_repeat'], '.3f')}  {_verdict(row)}".rstrip())
    if doc["skipped"]:
        lines += ["", "not run (the schedule's limits):"] + [f"  {s}" for s in doc["skipped"]]
    lines += [""] + _balance_lines(doc) + _plain_lines(doc)
    return "\n".join(lines)


def format_markdown(doc: dict[str, Any]) -> str:
    lines = [_header(doc) + ".", "",
             "Speed-up: pipeline examples/s over that of the single runs just before and after it (median of "
             "repeats). Theoretical: "
             "P·vM/(vM+P−1). Efficiency: measured/theoretical. Bubble: theoretical (P−1)/(vM+P−1), simulated "
             "with unit costs (`polytrain plan`), measured per stage as idle/(busy+idle) inside the schedule. "
             "Ceiling: P processes training independently at once, each one's rate over single's; efficiency at "
             "ceiling: the speed-up over that per-process rate (same repeat), over the theoretical one — the "
             "pipeline's own losses, without the machine's.",
             "", "| case | examples/s | speed-up | theoretical | efficiency | efficiency at ceiling | bubble theor. | "
                 "bubble sim. | bubble measured (per stage) | busy s/step (per stage) | idle s/step (per stage) | "
                 "speed-up per repeat | target |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|---|"]
    for row in doc["rows"]:
        if row["strategy"] == "single":
            lines.append(f"| {row['label']} | {row['examples_per_sec']:.1f} | 1 | | | | | | | | | "
                         f"{', '.join(f'{r:.1f}' for r in row['runs_examples_per_sec'])} ex/s | |")
            continue
        if row["strategy"] == "ceiling":
            lines.append(f"| {row['label']} | {row['examples_per_sec']:.1f} per process | "
                         f"{row['per_process_vs_single']:.3f} per process | | | | | | | | | "
                         f"{', '.join(f'{v:.3f}' for v in row['per_process_vs_single_per_repeat'])} | |")
            continue
        lines.append(f"| {row['label']} | {row['examples_per_sec']:.1f} | {row['speedup']:.3f} | "
                     f"{row['speedup_theoretical']:.3f} | {row['efficiency']:.3f} | "
                     f"{_fmt_list([row.get('efficiency_at_ceiling')], '.3f')} | {row['bubble_theoretical']:.3f} | "
                     f"{row['bubble_simulated']:.3f} | {_fmt_list(row['rank_bubble'], '.3f')} | "
                     f"{_fmt_list(row['rank_busy_s'], '.3f')} | {_fmt_list(row['rank_idle_s'], '.3f')} | "
                     f"{', '.join(f'{v:.3f}' for v in row['speedup_per_repeat'])} | {_verdict(row) or '—'} |")
    if doc["skipped"]:
        lines += ["", "Not run (the schedule's limits): " + "; ".join(doc["skipped"]) + "."]
    lines += [""] + [f"* {line}" for line in _balance_lines(doc) + _plain_lines(doc)]
    return "\n".join(lines) + "\n"


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def plot(doc: dict[str, Any], path: str) -> None:
    """Measured and theoretical speed-up against M per schedule, and each schedule's measured bubble."""
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'polytrain[plot]'") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    rows = [r for r in doc["rows"] if r["strategy"] == "pipeline"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r["schedule"] for r in rows):
        mine = sorted((r for r in rows if r["schedule"] == name), key=lambda r: r["microbatches"])
        ms = [r["microbatches"] for r in mine]
        left.plot(ms, [r["speedup"] for r in mine], "o-", label=name)
        right.plot(ms, [statistics.mean(r["rank_bubble"]) for r in mine], "o-", label=name)
    for chunks, style in ((1, "k--"), (2, "k:")):  # the theory depends on the chunks per rank only
        mine = sorted({r["microbatches"]: r for r in rows if r["chunks"] == chunks}.values(),
                      key=lambda r: r["microbatches"])
        if mine:
            ms = [r["microbatches"] for r in mine]
            left.plot(ms, [r["speedup_theoretical"] for r in mine], style, label=f"theoretical, v={chunks}")
            right.plot(ms, [r["bubble_theoretical"] for r in mine], style, label=f"theoretical, v={chunks}")
    stages = doc["config"]["stages"]
    left.axhline(stages, color="grey", lw=0.8)
    left.set(xscale="log", xlabel="micro-batches M", ylabel="speed-up over single (1 thread)",
             title=f"pipeline P={stages} vs single, 1 thread per process")
    right.set(xscale="log", xlabel="micro-batches M", ylabel="bubble: idle / (busy + idle), mean of stages",
              title="bubble: measured per schedule, theoretical")
    for ax in (left, right):
        ax.set_xticks(sorted({r["microbatches"] for r in rows}))
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_suite(cfg: PipelineBenchConfig, progress: Callable[[str], None] = lambda message: None) -> dict[str, Any]:
    """Run every case in its interleaved order, then the split's balance; the result document."""
    cfg.check()
    chosen, skipped = cases(cfg)
    order = running_order(chosen, cfg.repeats, cfg.reference_every)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="polytrain-bench-pipeline-") as tmp:
        for i, (repeat, case) in enumerate(order, 1):
            run = run_case(case, cfg, repeat, Path(tmp))
            run.position = i
            runs.append(run)
            progress(f"[{i}/{len(order)}] repeat {repeat + 1}: {case.label}: {run.examples_per_sec:.1f} examples/s")
    progress("profiling the automatic split ...")
    balance = [split_balance(cfg, p) for p in cfg.balance_stages]
    return result_document(cfg, chosen, skipped, runs, balance)
