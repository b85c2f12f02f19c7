"""Errors that polytrain reports to users.

A :class:`PolytrainError` is a user error: the CLI prints its message as one line, with no traceback,
and exits with its ``exit_code``. Anything else escaping a command is a bug and keeps its traceback.
"""

from __future__ import annotations


class PolytrainError(Exception):
    """A problem the user can fix; the message says what was wrong and how to fix it."""

    exit_code = 2


class ConfigError(PolytrainError):
    """A bad configuration key, flag value or combination of settings."""


class DeviceError(PolytrainError):
    """A device that does not exist, is not available, or cannot run an operator."""


class DataError(PolytrainError):
    """A dataset that cannot be found or read."""


class DivergedError(PolytrainError):
    """The loss became NaN or infinite; training stopped."""

    exit_code = 3

    def __init__(self, step: int, loss: float):
        super().__init__(
            f"model diverged at step {step}: loss is {loss}; "
            "lower --lr, add warmup (e.g. --lr-schedule cosine:warmup=100) or check the data"
        )
        self.step = step
        self.loss = loss


class WorkerError(PolytrainError):
    """A worker process failed; the message names its rank and error."""

    exit_code = 1


class PeerLostError(WorkerError):
    """Another rank stopped sending heartbeats, or said it failed; this rank stopped too. ``rank`` is the
    lost rank (None: the rendezvous store itself was lost)."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


class StateLost(PeerLostError):
    """``--on-failure continue``: the survivors of a loss do not hold the whole state between them (every worker
    holding some shard was lost); the job ends, its last checkpoint stands."""

    def __init__(self, message: str):
        super().__init__(message, rank=None)


class CommunicationError(PolytrainError):
    """A collective did not complete: a peer did not arrive within the timeout."""

    exit_code = 1


class MemoryLimitError(PolytrainError):
    """A worker would pass ``--memory-limit``: the message names its rank, the limit, the allocation that failed
    and what to try. Not a :class:`WorkerError`: the same run would fail the same way, so it is not restarted."""

    exit_code = 1


class CheckpointError(PolytrainError):
    """A checkpoint or model file could not be written: the disk is full, over quota, read-only or failing;
    the message names the directory, the bytes needed and free."""

    exit_code = 1


class RunStopped(PolytrainError):
    """A stop signal (SIGTERM, SIGINT, SIGHUP, SIGUSR1) ended the run in order. ``exit_code`` is 75 ("stopped,
    resumable": a checkpoint at the stop step, or nothing trained yet; the same command with ``--resume``
    continues) or 128 + the signal's number when trained steps were not saved. ``summary``: rank 0's, if any."""

    def __init__(self, message: str, *, signal_name: str, signum: int, resumable: bool,
                 step: int | None = None, checkpoint: str | None = None, summary: dict | None = None):
        super().__init__(message)
        self.signal_name, self.signum, self.resumable = signal_name, signum, resumable
        self.step, self.checkpoint, self.summary = step, checkpoint, summary
        self.exit_code = 75 if resumable or not signum else 128 + signum
