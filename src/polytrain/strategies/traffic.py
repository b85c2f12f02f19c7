"""Bytes each rank sends and receives in a strategy's exchange, counted by a model of each transport.

What is counted: the model data a strategy exchanges to train (gradients, parameters, the balancer's
timings), not the trainer's own bookkeeping (metrics gathered at log points, evaluation sums, checkpoints)
nor the one-time start-up broadcast, which every strategy pays alike. The numbers come from the sizes of
the tensors handed to the transport and a stated model of what the transport moves, not from the wire:

* all-reduce over the process group (gloo, NCCL): the ring algorithm, in which every rank sends and
  receives ``2 (N - 1) / N`` times the payload (a reduce-scatter then an all-gather, each moving
  ``(N - 1) / N``). gloo may pick another algorithm for some sizes; the ring is the bandwidth-optimal bound
  they all approach, and the same model for every strategy keeps their ratios honest.
* shared memory (``polytrain.distributed.shm``): what a rank copies in and out of the mapped region. It
  writes its whole tensor to its input slot and its ``1/N`` share of the sum to the output (``(1 + 1/N)``
  times the payload, counted as sent), and reads its share of every input slot and the whole output back
  (``2`` times the payload, counted as received). These are memory copies, not network bytes.
* point-to-point (parameter servers): the bytes of each tensor sent or received.

``take()`` gives the counts since the last call (the trainer's log points, listed per rank as
``rank_bytes_sent``/``rank_bytes_received``); ``summary()`` the whole run's totals over every trainer.
"""

from __future__ import annotations

from typing import Any


def ring_all_reduce_bytes(payload: int, ranks: int) -> float:
    """Bytes each rank sends (and, alike, receives) in a ring all-reduce of ``payload`` bytes."""
    return 2.0 * (ranks - 1) / ranks * payload if ranks > 1 else 0.0


class Traffic:
    """Counts one rank's bytes sent and received, and the training examples it processed."""

    def __init__(self) -> None:
        self.sent = self.received = 0.0  # since the last take()
        self.total_sent = self.total_received = 0.0
        self.examples = 0

    def add(self, sent: float, received: float) -> None:
        self.sent += sent
        self.received += received
        self.total_sent += sent
        self.total_received += received

    def all_reduce(self, payload: int, ranks: int) -> None:
        """One all-reduce of ``payload`` bytes over ``ranks`` ranks through the process group (ring model)."""
        moved = ring_all_reduce_bytes(payload, ranks)
        self.add(moved, moved)

    def shm_all_reduce(self, payload: int, ranks: int) -> None:
        """One all-reduce of ``payload`` bytes through shared memory: the copies in and out of the region."""
        if ranks > 1:
            self.add(payload * (1 + 1 / ranks), 2.0 * payload)

    def take(self) -> dict[str, float]:
        out = {"bytes_sent": round(self.sent), "bytes_received": round(self.received)}
        self.sent = self.received = 0.0
        return out

    def summary(self, trainers: Any) -> dict[str, Any]:
        """The run's totals over every trainer rank, per rank and per training example. Collective."""
        per_rank = trainers.all_gather_object((round(self.total_sent), round(self.total_received), self.examples))
        sent = sum(s for s, _, _ in per_rank)
        received = sum(r for _, r, _ in per_rank)
        examples = sum(n for _, _, n in per_rank)
        return {
            "bytes_sent": sent,
            "bytes_received": received,
            "rank_bytes_sent": [s for s, _, _ in per_rank],
            "rank_bytes_received": [r for _, r, _ in per_rank],
            # over all ranks: what the whole job moved to train on one example
            "bytes_sent_per_example": round(sent / examples, 2) if examples else None,
        }
