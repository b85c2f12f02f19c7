"""Where a changing membership (:mod:`polytrain.distributed.elastic`) keeps its state in the job's store, and the
launcher's and a replacement's words there: one name for each key, whoever writes or reads it.

Under :data:`PREFIX`: ``join/<slot>`` (a replacement registered, the time) and ``join/count``; ``admitted/<slot>``
(the generation it was admitted to); ``dead/<slot>`` (the launcher saw that slot's process end, the time);
``closed`` (no one will be admitted any more); and each generation's ``g<N>/...`` keys. The launcher's heartbeat
keys its slots under :data:`HEARTBEAT_PREFIX`.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch.distributed as dist

PREFIX = "polytrain/elastic"
HEARTBEAT_PREFIX = "polytrain/heartbeat"  # the launcher's heartbeat (distributed/heartbeat.py), keyed by slot
CLOSED = PREFIX + "/closed"
JOIN_COUNT = PREFIX + "/join/count"


def key(*parts: Any) -> str:
    """The membership's key made of ``parts`` (``key("g3", "decision")``)."""
    return "/".join([PREFIX, *map(str, parts)])


def join_key(slot: int) -> str:
    return key("join", slot)


def admitted_key(slot: int) -> str:
    return key("admitted", slot)


def dead_key(slot: int) -> str:
    return key("dead", slot)


def mark_dead(store: dist.Store, slot: int) -> None:
    """The launcher's word that the process of ``slot`` ended: the survivors need not wait for the heartbeat."""
    with contextlib.suppress(Exception):
        store.set(dead_key(slot), repr(time.time()))


def admitted(store: dist.Store, slot: int) -> bool:
    """Whether the replacement now in ``slot`` was admitted by the members (it deletes an earlier one's mark)."""
    with contextlib.suppress(Exception):
        return bool(store.check([admitted_key(slot)]))
    return False


def close_admission(store: dist.Store) -> None:
    """The launcher's word that no member is left to admit anyone: a replacement waiting leaves at once (as at the
    job's end, :meth:`Membership.close`) instead of waiting out --timeout."""
    with contextlib.suppress(Exception):
        store.set(CLOSED, "1")
