"""``spawn(fn, world_size)``: run ``fn(ctx, *args)`` in real gloo worker processes on loopback.

It goes through polytrain's own launcher (loopback-bound store, gloo pinned to the loopback interface,
failure supervision), so every multi-process test also exercises the real launch path. ``fn`` must be a
module-level function (workers are spawned and import it by name).
"""

from __future__ import annotations

from typing import Any, Callable

from polytrain.distributed.launch import launch


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    return launch(fn, *args, workers=world_size, device="cpu", backend="gloo", timeout=timeout,
                  threads_per_worker=1)
