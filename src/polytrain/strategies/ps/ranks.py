"""A parameter-server job's ranks, workers first (ranks 0..N-1, so rank 0 trains), then servers; and the
messages between them."""

from __future__ import annotations

from dataclasses import dataclass

from polytrain.errors import ConfigError

# message kinds (first value of every header) and tags (one per direction and part, so a receive from any
# worker only ever matches a request header)
INIT, PULL, PUSH, DONE, READ, REPLY, STATE, STATS, TICKET, LOST = 1, 2, 3, 4, 5, 6, 7, 8, 9, 10
KIND_NAMES = {INIT: "init", PULL: "pull", PUSH: "push", DONE: "done", READ: "read", REPLY: "reply",
              STATE: "optimizer state", STATS: "update records", TICKET: "ticket", LOST: "worker lost"}
#: a ticket request's answer to a worker the servers count as lost (it was silent past --heartbeat-timeout)
DROPPED = -2
TAG_REQUEST, TAG_REQUEST_DATA, TAG_REPLY, TAG_REPLY_DATA = 11, 12, 13, 14
RECORD_WIDTH = 6  # an update record's row: [worker, clock, ticket, read version, applied version, missed]


@dataclass(frozen=True)
class Ranks:
    workers: int
    servers: int

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"--workers must be >= 1, got {self.workers}")
        if self.servers < 1:
            raise ConfigError(f"--servers must be >= 1, got {self.servers}")

    @property
    def world_size(self) -> int:
        return self.workers + self.servers

    @property
    def worker_ranks(self) -> list[int]:
        return list(range(self.workers))

    @property
    def server_ranks(self) -> list[int]:
        return list(range(self.workers, self.world_size))

    def role(self, rank: int) -> str:
        self._check(rank)
        return "trainer" if rank < self.workers else "server"

    def server_index(self, rank: int) -> int:
        if self.role(rank) != "server":
            raise ValueError(f"rank {rank} is a worker, not a server")
        return rank - self.workers

    def name(self, rank: int) -> str:
        if self.role(rank) == "server":
            return f"parameter server rank {rank}"
        return f"worker rank {rank}"

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")
