"""Rank-aware logging for the ``polytrain`` logger.

Rank 0 speaks at INFO by default; other ranks only report errors, and the warnings that are theirs alone (logged
with ``extra=EVERY_RANK``: a device this rank fell back from, its heartbeat's trouble), prefixed ``[rank N]``: a
warning every rank would give (a resume without a checkpoint, Python's own warnings) is printed once, by rank 0.
With ``all_ranks=True`` every rank speaks and every line carries its ``[rank N]`` prefix.
"""

from __future__ import annotations

import logging
import sys
import warnings

LOGGER_NAME = "polytrain"
#: ``extra=`` of a warning that a rank other than 0 prints too: what only that rank knows
EVERY_RANK = {"every_rank": True}


def _own_warnings_and_errors(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR or getattr(record, "every_rank", False)


class _RankFormatter(logging.Formatter):
    def __init__(self, rank: int, world_size: int, all_ranks: bool):
        super().__init__()
        self.prefix = f"[rank {rank}] " if world_size > 1 and (all_ranks or rank != 0) else ""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.levelno >= logging.WARNING:
            message = f"{record.levelname.lower()}: {message}"
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        return self.prefix + message


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stdout`` is when a record is emitted, not the stream it was at set-up: in a
    process that redirects it meanwhile (a notebook cell's capture, pytest's per-test capture, a library's
    ``redirect_stdout``), messages go to the current one instead of failing on a closed file."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property  # type: ignore[override]
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # (StreamHandler.__init__ and setStream assign it)
        pass


def setup_logging(rank: int = 0, world_size: int = 1, *, all_ranks: bool = False,
                  level: int = logging.INFO) -> logging.Logger:
    """Configure the ``polytrain`` logger for this process and return it."""
    logger = logging.getLogger(LOGGER_NAME)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = _StdoutHandler()
    handler.setFormatter(_RankFormatter(rank, world_size, all_ranks))
    logger.addHandler(handler)
    logger.setLevel(level if (rank == 0 or all_ranks) else max(level, logging.WARNING))
    if rank != 0 and not all_ranks:  # rank 0 gives the warnings every rank would: once, not once per rank
        handler.addFilter(_own_warnings_and_errors)
        warnings.simplefilter("ignore")
    logger.propagate = False
    return logger


def get_logger(name: str | None = None) -> logging.Logger:
    return logging.getLogger(LOGGER_NAME if not name else f"{LOGGER_NAME}.{name}")
