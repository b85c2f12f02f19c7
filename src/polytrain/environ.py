"""Environment variables set for a while: what a run gives the processes it starts (their thread counts, its
start, where its snapshots and hang reports go) is the run's, and the launching program has its own
environment back afterwards, whatever happened in between (``polytrain.fit`` in a notebook or a test suite)."""

from __future__ import annotations

import contextlib
import os
from typing import Iterable, Iterator, Mapping


@contextlib.contextmanager
def environment(values: Mapping[str, str] | None = None, *, restore: Iterable[str] = ()) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` for the block; when it ends, every name set here or named in
    ``restore`` (names the block itself may set) is put back as it was: its old value, or unset."""
    values = dict(values or {})
    saved = {name: os.environ.get(name) for name in (*values, *restore)}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
