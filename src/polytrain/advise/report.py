"""``polytrain advise``'s output: the ranked table, the paragraph of reasons, and the plot of predicted
examples/s against link rate, one line per strategy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from polytrain.advise.model import Prediction, Profile, Scenario, predict, rank


def format_rate(bits: float) -> str:
    for unit, size in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= size:
            value = bits / size
            return f"{value:g}{unit}" if value == int(value) else f"{value:.3g}{unit}"
    return f"{bits:g}bit"


def _seconds(value: float | None) -> str:
    if value is None:
        return "never"
    return f"{value:.3g} s" if value < 100 else f"{value / 60:.3g} min" if value < 7200 else f"{value / 3600:.3g} h"


def table(profiles: list[Profile], scenario: Scenario) -> tuple[list[str], list[list[str]], list[Prediction]]:
    """Header, rows (ranked) and the ranked predictions for one scenario."""
    by_name = {p.strategy: p for p in profiles}
    ranked = rank([predict(p, scenario) for p in profiles])
    base = next((p for p in ranked if p.strategy == "sync"), None)
    header = ["rank", "strategy", "examples/s", "x sync", "on the link", "MB sent/worker/step",
              "examples to target", "time to target"]
    rows = []
    for i, p in enumerate(ranked, 1):
        profile = by_name[p.strategy]
        rows.append([str(i), p.strategy, f"{p.examples_per_s:,.0f}",
                     f"{p.examples_per_s / base.examples_per_s:.2f}" if base else "-",
                     f"{100 * p.wire_share:.0f} %", f"{p.wire_bytes_per_step / 1e6:.3g}",
                     f"{profile.examples_to_target:,.0f}" if profile.examples_to_target else "not reached",
                     _seconds(p.time_to_target_s)])
    return header, rows, ranked


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths)) for line in [header, *rows])


def reasons(profiles: list[Profile], scenario: Scenario, ranked: list[Prediction], target: str) -> str:
    """One paragraph: the pick, and the numbers that decided it."""
    by_name = {p.strategy: p for p in profiles}
    best = ranked[0]
    where = f"{scenario.workers} workers on {format_rate(scenario.link_bps)} links"
    sync = next((p for p in ranked if p.strategy == "sync"), None)
    parts = [f"With {where}, {best.strategy} is predicted fastest"
             + (f" to {target} ({_seconds(best.time_to_target_s)})" if best.time_to_target_s else
                f" ({best.examples_per_s:,.0f} examples/s; no strategy reached {target} in the measured run)")
             + "."]
    if sync is not None:
        parts.append(f"sync would spend {100 * sync.wire_share:.0f} % of each step on the link "
                     f"({sync.wire_s * 1e3:.3g} ms of {sync.step_s * 1e3:.3g} ms)" +
                     (", so saving bytes matters here." if sync.wire_share > 0.3 else
                      ", so the link is not what limits it; saving bytes buys little."))
    if best.strategy != "sync" and sync is not None:
        fewer = sync.wire_bytes_per_step / best.wire_bytes_per_step if best.wire_bytes_per_step else float("inf")
        bytes_text = (f"{fewer:.3g}x fewer bytes per step than sync" if fewer >= 1.1 else
                      f"{1 / fewer:.3g}x the bytes per step of sync" if fewer > 0 else "no bytes")
        parts.append(f"{best.strategy} sends {bytes_text} and runs at "
                     f"{best.examples_per_s / sync.examples_per_s:.2f}x its examples/s")
        p, s = by_name[best.strategy], by_name["sync"]
        if p.examples_to_target and s.examples_to_target:
            parts[-1] += (f", needing {p.examples_to_target / s.examples_to_target:.2f}x the examples to reach "
                          f"{target} in the measured run.")
        else:
            parts[-1] += "."
    slowest = [p.strategy for p in ranked if p.time_to_target_s is None and by_name[p.strategy].examples_to_target
               is None]
    if slowest:
        parts.append(f"{', '.join(slowest)} did not reach {target} in the measured run, so they rank by "
                     "examples/s after those that did.")
    if scenario.slow or scenario.random:
        parts.append("Stragglers: a lock-step strategy waits for the slowest worker every step, a periodic one "
                     "once a round, async never.")
    return " ".join(parts)


def plot(profiles: list[Profile], scenario: Scenario, path: Path, title: str) -> None:
    """Predicted examples/s against link rate, one line per strategy (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [10 ** (6 + k / 8) for k in range(0, 8 * 5 + 1)]  # 1 Mbit/s .. 100 Gbit/s
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for profile in profiles:
        values = [predict(profile, Scenario(scenario.workers, r, scenario.latency_s, scenario.slow,
                                            scenario.random, scenario.servers)).examples_per_s for r in rates]
        ax.plot([r / 1e9 for r in rates], values, label=profile.strategy)
    ax.axvline(scenario.link_bps / 1e9, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link rate per worker (Gbit/s)")
    ax.set_ylabel("predicted examples/s")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def document(profiles: list[Profile], scenarios: list[Scenario], target: str, meta: dict[str, Any]) -> dict:
    out = {"meta": meta, "target": target, "profiles": [p.__dict__ for p in profiles], "scenarios": []}
    for scenario in scenarios:
        header, rows, ranked = table(profiles, scenario)
        out["scenarios"].append({
            "workers": scenario.workers, "link_bps": scenario.link_bps, "latency_s": scenario.latency_s,
            "ranked": [p.__dict__ | {"wire_share": p.wire_share} for p in ranked],
            "header": header, "rows": rows, "reasons": reasons(profiles, scenario, ranked, target)})
    return out
