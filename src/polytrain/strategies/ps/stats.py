"""Staleness numbers: per log point on each worker, and over the whole run from the servers' records.

The staleness of an applied gradient is the server's version (steps whose every slice is applied) when it
was applied minus the version of the values it was computed on (:class:`~.book.UpdateRecord`). A pushed
gradient reaches every server; its staleness is the most of any server's (values from several servers may
differ in age).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

import torch


class StalenessWindow:
    """A worker's gradients' staleness since the last log point (each pull's answer tells the last one)."""

    def __init__(self) -> None:
        self._values: list[int] = []

    def add(self, staleness: int) -> None:
        if staleness >= 0:  # -1: no gradient of this worker applied yet
            self._values.append(staleness)

    def take(self) -> dict[str, float]:
        values, self._values = self._values, []
        if not values:
            return {}
        return {"staleness_max": max(values), "staleness_mean": round(sum(values) / len(values), 4)}


def staleness_summary(rows: Sequence[torch.Tensor], duplicates: int, bound: int | None) -> dict[str, Any]:
    """The run's staleness from every server's records (rows ``[worker, clock, ticket, read version, applied
    version, missed]``): max, mean and histogram over pushed gradients, how many were applied, and how
    many slices each worker computed (a fast worker takes more)."""
    worst: dict[tuple[int, int], int] = {}
    slices: Counter[int] = Counter()
    for server_rows in rows:
        for worker, clock, _, read, applied, _ in server_rows.tolist():
            key = (worker, clock)
            if key not in worst:
                slices[worker] += 1
            worst[key] = max(worst.get(key, 0), applied - read)
    values = list(worst.values())
    counts = Counter(values)
    return {
        "staleness_bound": bound,
        "staleness_max": max(values, default=0),
        "staleness_mean": round(sum(values) / len(values), 4) if values else 0.0,
        # JSON object keys are strings; sorted by staleness
        "staleness_histogram": {str(k): counts[k] for k in sorted(counts)},
        "gradients_applied": len(values),
        "duplicate_pushes_ignored": duplicates,
        "slices_per_worker": [slices[w] for w in sorted(slices)],
    }
