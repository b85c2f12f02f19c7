"""Each rank's record of its last collectives: which operation, on which group, its sequence number there, the
tensor sizes, when it started and whether it finished. What a hang report (:mod:`.hangs`) is made of.

Two sources, both always on:

* torch's flight recorder, which ``ProcessGroupGloo`` (and NCCL) fills for every collective and point-to-point
  operation issued through a process group: DDP's buckets, FSDP2's gathers and reduce-scatters, the pipeline's
  sends and receives, every ``torch.distributed`` call. torch 2.13 keeps 2000 entries by default; polytrain
  asks for the last :data:`FR_ENTRIES` (``TORCH_FR_BUFFER_SIZE``, unless the user set it), which makes reading
  it cheap (about 80 us, with no stack traces) and leaves its per-operation cost as it is;
* polytrain's own collectives that do not go through a process group (the shared-memory all-reduce of
  ``sync --comm shm``), recorded here: :func:`begin` and :func:`end`, a few attribute writes each.

:func:`latest` is this rank's summary: the oldest operation still running (what the rank waits in), else the
newest finished one, with each group's newest sequence number. The heartbeat's thread publishes it with every
beat, so a rank that freezes leaves its last word in the store.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

FR_ENV = "TORCH_FR_BUFFER_SIZE"
FR_ENTRIES = 16
_OWN_ENTRIES = 8


def keep_record() -> None:
    """Before this process makes its process group: the flight recorder keeps the last :data:`FR_ENTRIES`
    operations (a size the user set is kept; 0 turns torch's record off, and only polytrain's own remains).
    Done when this module is imported (the launcher imports it, and its workers inherit its environment; a
    torchrun worker imports it before it joins the group)."""
    os.environ.setdefault(FR_ENV, str(FR_ENTRIES))


keep_record()


@dataclass
class Entry:
    op: str
    group: str
    seq: int
    sizes: list[list[int]]
    started_ns: int  # time.time_ns() when it started
    done: bool = False


@dataclass
class _Own:
    entries: deque = field(default_factory=lambda: deque(maxlen=_OWN_ENTRIES))
    seqs: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


_OWN = _Own()


def begin(op: str, group: str, sizes: list[list[int]]) -> Entry:
    """Record the start of one of polytrain's own collectives (the same calls in the same order on every rank
    of ``group``, so its sequence number is comparable across ranks); :func:`end` it when it returns."""
    with _OWN.lock:
        seq = _OWN.seqs.get(group, 0) + 1
        _OWN.seqs[group] = seq
        entry = Entry(op, group, seq, sizes, time.time_ns())
        _OWN.entries.append(entry)
    return entry


def end(entry: Entry) -> None:
    entry.done = True


def _flight_recorder() -> list[Entry]:
    """The flight recorder's entries of this process (empty where torch has none, or it is off)."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace
    except ImportError:
        return []
    try:
        dump = pickle.loads(_dump_fr_trace(True, False, False))
    except Exception:  # no process group yet, or a torch whose format differs: nothing to say
        return []
    out = []
    for e in dump.get("entries", []):
        name, desc = (list(e.get("process_group") or ("?", "")) + [""])[:2]
        group = desc if desc and desc not in ("undefined", "default_pg") else ("world" if name == "0" else f"group {name}")
        p2p = bool(e.get("is_p2p"))
        seq = int(e.get("p2p_seq_id" if p2p else "collective_seq_id") or 0)
        op = str(e.get("profiling_name", "?"))
        out.append(Entry(op, group + (" p2p" if p2p else ""), seq, list(e.get("input_sizes") or []),
                         int(e.get("time_created_ns") or 0), bool(e.get("retired")) or e.get("state") == "completed"))
    return out


def latest(now_ns: int | None = None) -> dict[str, Any] | None:
    """This rank's last collective as a small JSON-able dict (None: none yet): ``op``, ``group``, ``seq``,
    ``sizes``, ``running`` (not finished), ``age_s`` (since it started, on this rank's clock) and ``seqs`` (each
    group's newest sequence number, and whether that one is still running)."""
    now_ns = now_ns or time.time_ns()
    with _OWN.lock:
        own = list(_OWN.entries)
    entries = _flight_recorder() + own
    if not entries:
        return None
    running = [e for e in entries if not e.done]
    chosen = min(running, key=lambda e: e.started_ns) if running else max(entries, key=lambda e: e.started_ns)
    seqs: dict[str, list[Any]] = {}
    for e in sorted(entries, key=lambda e: (e.group, e.seq)):
        seqs[e.group] = [e.seq, not e.done]
    return {"op": chosen.op, "group": chosen.group, "seq": chosen.seq, "sizes": chosen.sizes[:4],
            "running": not chosen.done, "age_s": round(max(0, now_ns - chosen.started_ns) / 1e9, 3), "seqs": seqs}
