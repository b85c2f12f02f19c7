"""polytrain advise checked against the emulated network: its predicted examples/s for every strategy, and its
top pick, against what the same strategies measure on links of 1 Gbit/s, 100 Mbit/s and 20 Mbit/s.

1. advise's measurement: a strategy once on loopback (2 workers, compare's runner), read into a profile (or
   taken from --profiles FILE, an earlier run's profiles.json), once before each of its link runs;
2. right after it, the same strategy on the emulated network at that rate (2 workers, a node per process,
   async's server on a node of its own), the same settings, so that a shared machine's drifting load hits a
   strategy's measurement and its runs alike; measured examples/s is compare's end-to-end number, the time to
   the target the first evaluation reaching it;
3. per rate: predicted / measured examples/s for every strategy, advise's top pick against the measured
   fastest to the target. Needs root.

    python benchmarks/advise_link.py --json benchmarks/results/advise-link/advise-link.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netlab_runs import read_back, run_on_link  # noqa: E402

import polytrain.components  # noqa: E402,F401
from polytrain.advise import measure as advise_measure  # noqa: E402
from polytrain.advise.model import Profile, Scenario, predict, rank  # noqa: E402
from polytrain.compare.specs import CompareConfig  # noqa: E402
from polytrain.netlab import parse_rate  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="1gbit,100mbit,20mbit")
    parser.add_argument("--strategies", default=advise_measure.DEFAULT_STRATEGIES)
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--target-accuracy", type=float, default=0.9)
    parser.add_argument("--profiles", help="advise.json (or this script's JSON) to take the profiles from")
    parser.add_argument("--workdir", default="/tmp/advise-link")
    parser.add_argument("--reuse", action="store_true",
                        help="take link runs whose metrics are already in --workdir instead of running them again")
    parser.add_argument("--quantile", type=float, default=0.5,
                        help="with --reuse: the loopback profiles' step time and the measured interval column taken "
                             "at this quantile of the log intervals (0.25: the quieter quarter of a loaded machine)")
    parser.add_argument("--json", help="write the results here (and a .md beside it)")
    args = parser.parse_args()
    cfg = CompareConfig(workers=2, steps=args.steps, eval_every=20, log_every=10,
                        target_accuracy=args.target_accuracy)
    specs = advise_measure.parse(args.strategies)
    work = Path(args.workdir)
    rates = args.rates.split(",")
    saved = json.loads(Path(args.profiles).read_text()) if args.profiles else {}
    profiles: dict[str, list] = {rate: [] for rate in rates}
    runs = {}
    for spec in specs:
        settings = cfg.settings(advise_measure.for_measuring(spec), [])
        for rate in rates:  # a loopback measurement right before each link run: the machine's load drifts alike
            kept = [Profile(**p) for p in saved.get(rate, []) if p["strategy"] == spec.text]
            if args.reuse:  # the profile again from the loopback run's metrics, at --quantile
                kept = reprofile(cfg, spec, work, rate, args.quantile) or kept
            profiles[rate] += kept or advise_measure.measure(cfg, [spec], work / "loopback" / rate,
                                                             progress=lambda m: print(m, flush=True))
            label = f"{spec.text}-{rate}"
            runs[spec.text, rate] = (args.reuse and read_back(label, rate, work / rate)) or \
                run_on_link(label, settings, rate, work / rate)
            print(f"  {rate}: {runs[spec.text, rate].examples_per_s:.0f} examples/s", flush=True)
    (work / "profiles.json").write_text(json.dumps({r: [p.__dict__ for p in ps] for r, ps in profiles.items()},
                                                   indent=2) + "\n")
    results = {"command": " ".join(sys.argv), "quantile": args.quantile, "steps": args.steps, "target_accuracy": args.target_accuracy,
               "profiles": {r: [p.__dict__ for p in ps] for r, ps in profiles.items()}, "rates": []}
    for rate in rates:
        ranked = rank([predict(p, Scenario(2, parse_rate(rate))) for p in profiles[rate]])
        rows = []
        for spec in specs:
            run = runs[spec.text, rate]
            predicted = next(p for p in ranked if p.strategy == spec.text)
            rows.append({"strategy": spec.text, "predicted_examples_per_s": round(predicted.examples_per_s, 1),
                         "measured_examples_per_s": round(run.examples_per_s, 1),
                         "error": round(predicted.examples_per_s / run.examples_per_s - 1, 3),
                         "measured_median_examples_per_s": round(run.interval_examples_per_s(args.quantile), 1),
                         "error_median": round(predicted.examples_per_s / run.interval_examples_per_s(args.quantile)
                                               - 1, 3),
                         "predicted_time_to_target_s": predicted.time_to_target_s,
                         "measured_time_to_target_s": run.time_to(args.target_accuracy),
                         "accuracy": run.accuracy})
        reached = [r for r in rows if r["measured_time_to_target_s"] is not None]
        fastest = min(reached, key=lambda r: r["measured_time_to_target_s"])["strategy"] if reached else None
        results["rates"].append({"rate": rate, "rows": rows, "advise_pick": ranked[0].strategy,
                                 "measured_fastest": fastest,
                                 "worst_error": max(abs(r["error"]) for r in rows),
                                 "worst_error_median": max(abs(r["error_median"]) for r in rows)})
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2) + "\n")
        out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))
    return 0


def reprofile(cfg, spec, work: Path, rate: str, quantile: float) -> list:
    """A strategy's profile read again from its loopback metrics (per rate, or one for all rates)."""
    from polytrain.compare.runner import Case

    stem = Case(advise_measure.for_measuring(spec), []).file_stem
    for path in (work / "loopback" / rate / f"{stem}.jsonl", work / "loopback" / f"{stem}.jsonl"):
        if path.is_file():
            records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            return [advise_measure.profile_of(cfg, spec, records, advise_measure.examples_to_target(cfg, records),
                                              quantile)]
    return []


def markdown(results: dict) -> str:
    lines = [f"`{results['command']}`", ""]
    for block in results["rates"]:
        lines += [f"### {block['rate']}: advise picks `{block['advise_pick']}`, measured fastest to accuracy "
                  f"{results['target_accuracy']:g}: `{block['measured_fastest']}`", "",
                  "| strategy | predicted examples/s | measured (end to end) | predicted / measured | measured "
                  "(interval at --quantile) | predicted / measured | predicted time to target (s) | measured (s) | final "
                  "accuracy |", "|---|---|---|---|---|---|---|---|---|"]
        for r in block["rows"]:
            p, m = r["predicted_time_to_target_s"], r["measured_time_to_target_s"]
            lines.append(f"| {r['strategy']} | {r['predicted_examples_per_s']:,.0f} | {r['measured_examples_per_s']:,.0f} "
                         f"| {1 + r['error']:.2f} | {r['measured_median_examples_per_s']:,.0f} | "
                         f"{1 + r['error_median']:.2f} | {'-' if p is None else f'{p:.2f}'} | "
                         f"{'-' if m is None else f'{m:.2f}'} | {r['accuracy']:.4f} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
