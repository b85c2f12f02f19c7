"""Runs made in the test's own process (``single`` references, in-process fits) on one CPU thread, as each
spawned worker computes (``threads_per_worker``). PyTorch's default in a pytest worker is one thread per core:
on a 2-core machine with another pytest worker and its processes beside it, those threads wait on each other at
every operation, and a tiny model's step takes 5-10 times as long."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """This process computes on one thread inside the block; its thread count as before after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
