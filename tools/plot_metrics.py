"""A metrics file's learning curve as a Markdown table and a PNG (matplotlib: ``pip install polytrain[plot]``).

    python tools/plot_metrics.py runs/lm.jsonl docs/lm-curve.png --line 22.1="byte unigram" --line 11="half of it"

The table has one row per evaluation (step, time, last train loss, eval loss, accuracy and perplexity when
the task reports it); the figure shows the train and eval loss by step and, for a language model, the eval
perplexity on a log scale with any ``--line VALUE=LABEL`` drawn across it.
"""

from __future__ import annotations

import argparse
import json


def read(path: str) -> tuple[list[dict], list[dict]]:
    """(step records, eval records, each with the time and train loss of the step record before it)."""
    steps, evals = [], []
    for record in map(json.loads, open(path)):
        if record["event"] == "step":
            steps.append(record)
        elif record["event"] == "eval" and steps:
            evals.append({**record, "time_s": steps[-1]["time_s"], "loss": steps[-1]["loss"]})
    return steps, evals


def table(evals: list[dict]) -> str:
    ppl = all("eval_perplexity" in e for e in evals)
    lines = ["| step | time (s) | train loss | eval loss | eval accuracy |" + (" eval perplexity |" if ppl else ""),
             "|---:|---:|---:|---:|---:|" + ("---:|" if ppl else "")]
    for e in evals:
        lines.append(f"| {e['step']} | {e['time_s']:.0f} | {e['loss']:.3f} | {e['eval_loss']:.3f} | "
                     f"{e['eval_accuracy']:.3f} |" + (f" {e['eval_perplexity']:.2f} |" if ppl else ""))
    return "\n".join(lines)


def plot(steps: list[dict], evals: list[dict], out: str, lines: dict[float, str], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    ppl = all("eval_perplexity" in e for e in evals)
    fig, axes = plt.subplots(1, 2 if ppl else 1, figsize=(10 if ppl else 5, 3.6), squeeze=False)
    ax = axes[0][0]
    ax.plot([s["step"] for s in steps], [s["loss"] for s in steps], label="train loss (batch)", lw=1)
    ax.plot([e["step"] for e in evals], [e["eval_loss"] for e in evals], "o-", label="eval loss (test split)")
    ax.set_xlabel("step"), ax.set_ylabel("loss (nats per token)" if ppl else "loss"), ax.legend()
    if ppl:
        ax = axes[0][1]
        ax.plot([e["step"] for e in evals], [e["eval_perplexity"] for e in evals], "o-", color="C1",
                label="eval perplexity")
        for value, label in lines.items():
            ax.axhline(value, ls="--", lw=1, color="grey")
            ax.text(0, value * 1.04, label, color="grey", fontsize=8)
        ax.set_yscale("log"), ax.set_xlabel("step"), ax.set_ylabel("perplexity (log scale)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("metrics", help="a --metrics-file of polytrain train")
    p.add_argument("png", nargs="?", help="write the figure here (needs matplotlib)")
    p.add_argument("--line", action="append", default=[], metavar="VALUE=LABEL",
                   help="a horizontal reference line on the perplexity panel")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    steps, evals = read(args.metrics)
    print(table(evals))
    if args.png:
        lines = {float(v): label for v, _, label in (item.partition("=") for item in args.line)}
        plot(steps, evals, args.png, lines, args.title)
        print(f"\nwritten: {args.png}")


if __name__ == "__main__":
    main()
