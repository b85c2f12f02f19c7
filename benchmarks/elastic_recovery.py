"""--on-failure continue: how long a lost worker costs the others, and how long until its replacement trains.

4 workers on digits (mlp:hidden=16x16, global batch 48), rank 3 SIGKILLed after step 10 of 100 with
--max-restarts 1, REPEATS runs each for sync and diloco --sync-every 4. For each run: from the killed worker's
last moment (the testing hook's log) to the membership record of the survivors going on, the change's own time
(agree, new group, rebuild, state), and from the death to 4 workers again. Writes
benchmarks/results/cpu-2core-elastic-recovery.json (or the file given as the first argument).

    python benchmarks/elastic_recovery.py [OUT.json]
"""

import json
import os
import statistics
import sys
import tempfile

import polytrain
from polytrain.train.faults import KILL_ENV, KILL_LOG_ENV

REPEATS = 5
BASE = dict(data="digits", model="mlp:hidden=16x16", batch_size=48, lr=0.05, log_every=1, eval_every=0,
            progress="off", workers=4, steps=100, on_failure="continue", max_restarts=1, heartbeat_timeout=8)
CASES = {"sync": dict(strategy="sync"), "diloco": dict(strategy="diloco", sync_every=4, momentum=0.0)}


def one(settings: dict) -> dict:
    with tempfile.TemporaryDirectory() as d:
        os.environ[KILL_ENV], os.environ[KILL_LOG_ENV] = "rank=3,steps=10", f"{d}/kill.log"
        summary = polytrain.fit(metrics_file=f"{d}/m.jsonl", **BASE, **settings)
        with open(f"{d}/kill.log") as fh:
            killed_at = float(fh.read().split()[2])
        with open(f"{d}/m.jsonl") as fh:
            changes = [e for e in map(json.loads, fh) if e.get("event") == "membership"]
    lost = next(c for c in changes if c["lost"])
    joined = next((c for c in changes if c["joined"]), None)
    return {"going_on_s": round(lost["unix_time"] - killed_at, 3), "change_s": lost["seconds"],
            "from_step": lost["step"], "workers_after_loss": lost["workers"],
            "four_again_s": round(joined["unix_time"] - killed_at, 3) if joined else None,
            "joined_at_step": joined["step"] if joined else None, "final_workers": summary["workers"]}


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/cpu-2core-elastic-recovery.json"
    results = {"settings": BASE, "load_average": os.getloadavg(), "cases": {}}
    for name, settings in CASES.items():
        runs = [one(settings) for _ in range(REPEATS)]
        results["cases"][name] = {"settings": settings, "runs": runs}
        for key in ("going_on_s", "change_s", "four_again_s"):
            values = [r[key] for r in runs if r[key] is not None]
            print(f"{name}: {key} median {statistics.median(values):.3f} s, {min(values):.3f} - {max(values):.3f} s")
    with open(out, "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
