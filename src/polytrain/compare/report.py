"""The comparison's table (text, Markdown, JSON) and its plot of loss against time and examples seen.

Ratios are taken against ``sync`` run under the same stragglers in the same invocation: absolute numbers
drift on a shared machine, ratios of runs taken minutes apart much less.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from polytrain.compare.runner import Outcome
from polytrain.compare.specs import CompareConfig

REFERENCE = "sync"


def rows(cfg: CompareConfig, outcomes: list[Outcome]) -> list[dict[str, Any]]:
    """One row per case, with its ratios to sync under the same stragglers (when sync ran). With several
    rounds (``--repeats``) a row gives the rounds' medians, and each ratio is the median of the ratios taken
    within one round (cases of a round ran minutes apart), with their spread (``*_range``: min, max)."""
    by_case: dict[str, list[Outcome]] = {}
    for o in outcomes:
        by_case.setdefault(o.label, []).append(o)
    # the reference is plain "sync" (not "sync:comm=backend"), one per set of stragglers and round
    reference = {(tuple(o.stragglers), o.round, o.link): o for o in outcomes if o.label.split(" ")[0] == REFERENCE}
    out = []
    for label, runs in by_case.items():
        first, s = runs[0], runs[0].summary
        row = {
            "case": label,
            "strategy": first.strategy,
            "stragglers": first.stragglers,
            "rounds": len(runs),
            "examples_per_sec": _median([o.examples_per_sec for o in runs]),
            "time_to_target_s": _median([o.time_to(cfg.target_accuracy, cfg.target_loss) for o in runs]),
            "eval_accuracy": _median([o.summary.get("eval_accuracy") for o in runs]),
            "eval_loss": _median([o.summary.get("eval_loss") for o in runs]),
            "bytes_sent_per_example": s.get("bytes_sent_per_example"),
            # either naming: the parameter servers' summary says staleness_max
            "max_staleness": s.get("max_staleness", s.get("staleness_max")),
            "mean_staleness": s.get("mean_staleness", s.get("staleness_mean")),
            "wall_s": _median([o.summary.get("wall_s") for o in runs]),
            "rank_examples_per_sec": s.get("rank_examples_per_sec"),
            "rank_straggler_s": s.get("rank_straggler_s"),
            "slices_per_worker": s.get("slices_per_worker"),
        }
        if first.link:  # --link: the emulated network's rate and what the busiest link did (rounds' medians)
            row["link"] = first.link_stats.get("link")
            row["link_bits_per_s"] = first.link
            for key in ("link_busy_s_per_step", "link_utilisation", "link_bytes_per_example"):
                row[key] = _median([o.link_stats.get(key) for o in runs])
            row["link_job_bytes"] = _median([sum(o.link_stats.get("link_tx_bytes_job") or [0]) for o in runs])
        if len(runs) > 1:
            row["examples_per_sec_range"] = _spread([o.examples_per_sec for o in runs])
        refs = [(o, reference.get((tuple(o.stragglers), o.round, o.link))) for o in runs]
        refs = [(o, ref) for o, ref in refs if ref is not None and ref is not o]
        if refs:
            speed = [_ratio(o.examples_per_sec, ref.examples_per_sec) for o, ref in refs]
            row["speed_vs_sync"] = _median(speed)
            if len(speed) > 1:
                row["speed_vs_sync_range"] = _spread(speed)
            r = refs[0][1].summary
            # how many times fewer bytes than sync moves per example
            row["fewer_bytes_than_sync"] = _ratio(r.get("bytes_sent_per_example"), s.get("bytes_sent_per_example"))
            points = [100 * (o.summary["eval_accuracy"] - ref.summary["eval_accuracy"]) for o, ref in refs
                      if o.summary.get("eval_accuracy") is not None and ref.summary.get("eval_accuracy") is not None]
            if points:
                row["accuracy_vs_sync_points"] = round(_median(points), 2)
        out.append(row)
    return out


def _median(values: list[float | None]) -> float | None:
    known = sorted(v for v in values if v is not None)
    if not known:
        return None
    mid = len(known) // 2
    return known[mid] if len(known) % 2 else round((known[mid - 1] + known[mid]) / 2, 4)


def _spread(values: list[float | None]) -> list[float] | None:
    known = [v for v in values if v is not None]
    return [min(known), max(known)] if known else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def document(cfg: CompareConfig, table: list[dict[str, Any]], outcomes: list[Outcome],
             notes: list[str]) -> dict[str, Any]:
    from polytrain.bench.report import environment

    config = dataclasses.asdict(cfg)
    if not cfg.links:
        config.pop("links")  # without --link the document is as it was
    return {
        "config": config,
        # on a shared machine the load says how much the absolute numbers mean
        "environment": {**environment(), "load_average": [round(v, 2) for v in os.getloadavg()]},
        "notes": notes,
        "rows": table,
        "curves": {o.label: {"time_s": [c[0] for c in o.curve], "examples": [c[1] for c in o.curve],
                             "loss": [c[2] for c in o.curve], "evals": o.evals} for o in outcomes},
    }


COLUMNS = [  # (key, heading, format)
    ("case", "case", "{}"),
    ("examples_per_sec", "examples/s", "{:.0f}"),
    ("speed_vs_sync", "x sync", "{:.2f}"),
    ("speed_vs_sync_range", "x sync min-max", "{}"),
    ("time_to_target_s", "time to target (s)", "{:.2f}"),
    ("eval_accuracy", "final acc", "{:.4f}"),
    ("eval_loss", "final loss", "{:.4f}"),
    ("bytes_sent_per_example", "bytes sent/example", "{:,.0f}"),
    ("fewer_bytes_than_sync", "sync bytes / these", "{:.1f}"),
    ("staleness", "staleness max/mean", "{}"),
]


#: with --link: after the case, the rate; after the bytes, what the busiest link did
LINK_COLUMNS = [
    ("link", "link", "{}"),
    ("link_busy_s_per_step", "link busy s/step", "{:.4f}"),
    ("link_utilisation", "link use", "{:.0%}"),
]


def _columns(rows: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    if not any(r.get("link") for r in rows):
        return COLUMNS
    at = [key for key, _, _ in COLUMNS].index("fewer_bytes_than_sync") + 1
    return COLUMNS[:1] + LINK_COLUMNS[:1] + COLUMNS[1:at] + LINK_COLUMNS[1:] + COLUMNS[at:]


def _cells(row: dict[str, Any], columns: list[tuple[str, str, str]] = COLUMNS) -> list[str]:
    cells = []
    for key, _, fmt in columns:
        if key == "speed_vs_sync_range":
            spread = row.get(key)
            cells.append("-" if spread is None else f"{spread[0]:.2f}-{spread[1]:.2f}")
            continue
        if key == "staleness":
            top, mean = row.get("max_staleness"), row.get("mean_staleness")
            cells.append("-" if top is None else f"{top}/{mean:.2f}" if mean is not None else f"{top}")
            continue
        value = row.get(key)
        cells.append("-" if value is None else fmt.format(value))
    return cells


def _target(cfg: CompareConfig) -> str:
    parts = ([f"eval accuracy >= {cfg.target_accuracy:g}"] if cfg.target_accuracy is not None else []) + \
            ([f"eval loss <= {cfg.target_loss:g}"] if cfg.target_loss is not None else [])
    return " or ".join(parts) or "none"


def _heading(doc: dict[str, Any]) -> list[str]:
    cfg, env = doc["config"], doc["environment"]
    return [f"{cfg['model']} on {cfg['data']}, {cfg['workers']} workers x {cfg['worker_batch_size']} examples per "
            f"step, {cfg['steps']} steps, {cfg['optimizer']} lr {cfg['lr']:g} momentum {cfg['momentum']:g}, "
            f"evaluated every {cfg['eval_every']} steps"
            + (f", {cfg['repeats']} interleaved rounds (medians)" if cfg.get("repeats", 1) > 1 else "")
            + "; target: "
            f"{_target(CompareConfig(**{k: v for k, v in cfg.items()}))}"
            + (f"; on an emulated network, each process in a namespace of its own with links of "
               f"{', '.join(_rate(r) for r in cfg['links'])} each way" if cfg.get("links") else ""),
            f"{env['cpu']}, {env['cores']} cores (load average {env.get('load_average')}), torch {env['torch']}, "
            f"polytrain {env['polytrain']}, {env['date']}"]


def format_text(doc: dict[str, Any]) -> str:
    columns = _columns(doc["rows"])
    table = [[h for _, h, _ in columns]] + [_cells(r, columns) for r in doc["rows"]]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
             for line in table]
    return "\n".join(_heading(doc) + [""] + lines + [f"note: {n}" for n in doc["notes"]])


def format_markdown(doc: dict[str, Any]) -> str:
    columns = _columns(doc["rows"])
    head = [h for _, h, _ in columns]
    lines = ["# polytrain compare", "", *(f"{line}  " for line in _heading(doc)), "",
             "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(_cells(r, columns)) + " |" for r in doc["rows"]]
    lines += [""] + [f"- {n}" for n in doc["notes"]]
    return "\n".join(lines) + "\n"


def _rate(bits: int) -> str:
    from polytrain.netlab import format_rate
    return format_rate(bits)


def plot(outcomes: list[Outcome], path: Path, title: str = "", table: list[dict[str, Any]] | None = None) -> None:
    """Training loss against wall-clock seconds and against examples seen, one line per case (dashed: with
    stragglers). With ``--link`` (``table``'s rows have a link) a second row of panels: examples/sec and the
    busiest link's busy seconds per step against the link rate, one line per strategy (labels: link use).
    Needs matplotlib (``pip install polytrain[plot]``)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    linked = [r for r in table or [] if r.get("link_bits_per_s")]
    if linked:
        fig, axes = plt.subplots(2, 2, figsize=(13, 10))
        (by_time, by_examples), (speed, busy) = axes
        by_examples.sharey(by_time)
        _plot_links(linked, speed, busy)
    else:
        fig, (by_time, by_examples) = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    colours = {}
    for o in outcomes:
        if o.round:
            continue  # the first round's curves (later rounds repeat them, at other speeds)
        colour = colours.setdefault(o.label.split(" ")[0], f"C{len(colours)}")
        style = "--" if o.stragglers else "-"
        times, examples, losses = zip(*o.curve) if o.curve else ((), (), ())
        by_time.plot(times, losses, style, color=colour, label=o.label)
        by_examples.plot(examples, losses, style, color=colour, label=o.label)
    by_time.set(xlabel="wall-clock seconds of training", ylabel="training loss", yscale="log")
    by_examples.set(xlabel="examples seen (all workers)")
    by_examples.legend(fontsize=8)
    for ax in (by_time, by_examples):
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_links(rows: list[dict[str, Any]], speed: Any, busy: Any) -> None:
    lines: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        lines.setdefault(row["case"].rsplit(" @", 1)[0], []).append(row)
    for i, (name, points) in enumerate(lines.items()):
        points.sort(key=lambda r: r["link_bits_per_s"])
        rates = [r["link_bits_per_s"] / 1e6 for r in points]
        style = "--" if "+straggler" in name else "-"
        speed.plot(rates, [r.get("examples_per_sec") or 0 for r in points], style + "o", color=f"C{i}", label=name)
        busy.plot(rates, [r.get("link_busy_s_per_step") or 0 for r in points], style + "o", color=f"C{i}", label=name)
        for r, x in zip(points, rates):
            if r.get("link_utilisation") is not None:
                busy.annotate(f"{r['link_utilisation']:.0%}", (x, r.get("link_busy_s_per_step") or 0), fontsize=7,
                              textcoords="offset points", xytext=(3, 3))
    speed.set(xscale="log", xlabel="link rate (Mbit/s, each way)", ylabel="examples/sec (all workers)")
    busy.set(xscale="log", yscale="log", xlabel="link rate (Mbit/s, each way)",
             ylabel="busiest link's seconds sending per step (labels: link use)")
    speed.legend(fontsize=8)
    for ax in (speed, busy):
        ax.grid(alpha=0.3)
