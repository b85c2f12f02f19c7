"""What the hang report's record of collectives costs (docs/fault-tolerance.md, "Hang diagnosis").

    python benchmarks/collective_record.py --repeats 5 --json benchmarks/results/cpu-2core-collective-record.json

Three parts:

* **per collective**: torch's flight recorder, which gloo fills for every operation. The same loop of small
  all-reduces on a one-process gloo group (gloo's own path, no peer to wait for: what is left is the per-call
  overhead, where a recorder's cost would show) in fresh processes with ``TORCH_FR_BUFFER_SIZE`` 0 (off),
  16 (polytrain's setting) and unset (torch 2.13's default of 2000 entries), interleaved, median per setting;
* **per beat**: what the heartbeat thread adds once a second: reading this rank's record (``latest()``: the
  recorder's 16 entries and polytrain's own) and one store ``set`` on loopback;
* **per shared-memory all-reduce**: polytrain's own record of it (``begin`` and ``end``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import timedelta

SETTINGS = {"off (0)": "0", "polytrain (16)": "16", "torch default (unset)": None}


def _loop(calls: int) -> float:
    """Seconds per all-reduce of 16 floats on a one-process gloo group (run in a fresh process)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    tensor = torch.ones(16)
    for _ in range(500):
        dist.all_reduce(tensor)
    started = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(tensor)
    took = (time.perf_counter() - started) / calls
    dist.destroy_process_group()
    return took


def per_collective(repeats: int, calls: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for repeat in range(repeats):
        names = list(SETTINGS)
        names = names[repeat % len(names):] + names[:repeat % len(names)]
        for name in names:
            env = {k: v for k, v in os.environ.items() if k != "TORCH_FR_BUFFER_SIZE"}
            if SETTINGS[name] is not None:
                env["TORCH_FR_BUFFER_SIZE"] = SETTINGS[name]
            done = subprocess.run([sys.executable, __file__, "--child", str(calls)], env=env, capture_output=True,
                                  text=True, timeout=600, check=True)
            out[name].append(float(done.stdout.strip()) * 1e6)
    return out


def per_beat(calls: int = 200) -> dict[str, float]:
    os.environ["TORCH_FR_BUFFER_SIZE"] = "16"
    import torch
    import torch.distributed as dist

    from polytrain.distributed import collectives
    from polytrain.distributed.rendezvous import StoreServer, connect_store

    server = StoreServer(timedelta(seconds=30))
    store = connect_store("127.0.0.1", server.port, timedelta(seconds=30))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=0, world_size=1)
    tensor = torch.ones(16)
    for _ in range(32):  # the recorder full
        dist.all_reduce(tensor)
    started = time.perf_counter()
    for _ in range(calls):
        record = json.dumps(collectives.latest())
    read = (time.perf_counter() - started) / calls
    started = time.perf_counter()
    for _ in range(calls):
        store.set("polytrain/heartbeat/last/0", record)
    publish = (time.perf_counter() - started) / calls
    started = time.perf_counter()
    for _ in range(calls * 50):
        collectives.end(collectives.begin("shm:all_reduce", "shm", [[16]]))
    own = (time.perf_counter() - started) / (calls * 50)
    dist.destroy_process_group()
    server.close()
    return {"read_record_us": round(read * 1e6, 1), "store_set_us": round(publish * 1e6, 1),
            "own_record_us": round(own * 1e6, 2), "record_bytes": len(record)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--json")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(_loop(args.child))
        return 0
    load = os.getloadavg()[0]
    runs = per_collective(args.repeats, args.calls)
    beat = per_beat()
    medians = {name: statistics.median(v) for name, v in runs.items()}
    doc = {"per_collective_us": {name: [round(x, 2) for x in v] for name, v in runs.items()},
           "median_us": {name: round(m, 2) for name, m in medians.items()},
           "per_beat": beat, "calls": args.calls, "repeats": args.repeats,
           "machine": {"cpus": os.cpu_count(), "load_1min_before": round(load, 2),
                       "load_1min_after": round(os.getloadavg()[0], 2), "python": platform.python_version()}}
    import torch
    doc["torch"] = torch.__version__
    for name, runs_us in doc["per_collective_us"].items():
        print(f"{name:24s} median {doc['median_us'][name]:8.2f} us per all-reduce  (runs: {runs_us})")
    print(f"per beat: read the record {beat['read_record_us']} us, store set {beat['store_set_us']} us "
          f"({beat['record_bytes']} bytes); polytrain's own record per shm all-reduce {beat['own_record_us']} us")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
