"""What a rank holds, counted in tests: the bytes of tensors, a sharded tensor (DTensor) by its local shard."""

from __future__ import annotations

from typing import Any, Iterable

import torch


def local_bytes(tensors: Iterable[Any]) -> int:
    """The bytes of the tensors among ``tensors`` (others skipped), each DTensor's local shard only."""
    total = 0
    for value in tensors:
        if torch.is_tensor(value):
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()
    return total
