"""SharedMemoryChannel on real processes: the same calls as Channel (headers from any rank, then values from that
rank), messages kept apart by tag, a message larger than its ring streamed through it, and the errors that name the
peer (a peer that exits at once, a silent one after the timeout)."""

import contextlib
import os
from pathlib import Path

import pytest
import torch

from polytrain.distributed.p2p import Channel
from polytrain.distributed.shm_channel import MailboxLayout, SharedMemoryChannel, plan_mailboxes
from polytrain.errors import CommunicationError, WorkerError
from tests.helpers.spawn import spawn

TAG, DATA, OTHER = 3, 4, 5


def _open(ctx, timeout: float = 30, capacity: int = 1 << 20, names=None) -> SharedMemoryChannel:
    pairs = [(a, b) for a in range(ctx.world_size) for b in range(ctx.world_size) if a != b]
    layout = MailboxLayout(ctx.world_size, tuple(pairs), capacity)
    base = Channel(ctx.topology.group, timeout=timeout, **({"names": names} if names else {}))
    return SharedMemoryChannel.open(base, ctx.topology, layout)


def exchange(ctx):
    channel = _open(ctx, capacity=64 << 10)  # smaller than the values: they stream through
    if ctx.rank == 0:
        got = {}
        for _ in range(4):
            kind, sender, a, b, *_ = channel.recv_header_any(TAG, "rank 1 or 2")
            payload = channel.recv(torch.empty(a, dtype=torch.float64), sender, DATA)
            got.setdefault(sender, []).append((kind, b, float(payload.sum())))
            channel.exchange(sends=[(payload * 2, sender, DATA)])
        return got, os.path.exists(channel.path)
    sums = []
    for round_ in range(2):
        payload = torch.arange(50_000 * ctx.rank + round_, dtype=torch.float64)  # 400-800 KB
        channel.send_header(0, TAG, kind=7, a=payload.numel(), b=10 * ctx.rank + round_)
        channel.send(payload, 0, DATA)
        sums.append(float(channel.recv(torch.empty_like(payload), 0, DATA).sum()))
    return sums


def test_headers_from_any_rank_then_values_from_that_rank_through_rings_smaller_than_the_values():
    results = spawn(exchange, 3, timeout=60)
    got, file_left = results[0]
    for rank in (1, 2):
        expected = [(7, 10 * rank + r, float(torch.arange(50_000 * rank + r, dtype=torch.float64).sum()))
                    for r in range(2)]
        assert sorted(got[rank]) == expected
        assert results[rank] == [2 * s for _, _, s in expected]
    assert not file_left  # unlinked once every rank had mapped it


def by_tag(ctx):
    channel = _open(ctx)
    if ctx.rank == 1:
        channel.exchange(sends=[(torch.full((40_000,), 1.0), 0, OTHER), (torch.full((3,), 2.0), 0, DATA),
                                (torch.full((40_000,), 3.0), 0, DATA)])
        return None
    second = channel.recv(torch.empty(3), 1, DATA)  # behind a message of another tag
    third = channel.recv(torch.empty(40_000), 1, DATA)
    first = channel.recv(torch.empty(40_000), 1, OTHER)  # kept aside until asked for
    return [float(first.mean()), second.tolist(), float(third.mean())]


def test_a_receive_takes_the_first_message_of_its_tag_and_keeps_the_others_for_theirs():
    assert spawn(by_tag, 2, timeout=60)[0] == [1.0, [2.0, 2.0, 2.0], 3.0]


def silent_peer(ctx):
    channel = _open(ctx, timeout=1 if ctx.rank == 0 else 60)
    if ctx.rank == 0:
        channel.recv_header(1, TAG)
    else:  # ends quietly when rank 0 goes, so that the launcher's report is rank 0's error
        with contextlib.suppress(CommunicationError):
            channel.recv_header(0, TAG)


def test_a_receive_that_times_out_names_the_peer():
    with pytest.raises(CommunicationError, match=r"rank 0: no answer within 1 s while waiting for rank 1; it died "
                                                 r"or hangs"):
        spawn(silent_peer, 2, timeout=30)


def exiting_peer(ctx, said):
    channel = _open(ctx, timeout=60, names=lambda r: f"peer {r}")
    if ctx.rank == 1:
        os._exit(1)
    try:
        channel.recv_header(1, TAG)
    except CommunicationError as exc:
        Path(said).write_text(str(exc))
        raise


def test_a_peer_that_exits_is_named_without_waiting_for_the_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr("polytrain.distributed.supervisor._SETTLE_S", 20.0)  # (as test_p2p's twin)
    with pytest.raises(WorkerError, match=r"^worker rank 1 exited with code 1 .* \(then rank\(s\) 0 failed too\)"):
        spawn(exiting_peer, 2, str(tmp_path / "said"), timeout=30)
    assert (tmp_path / "said").read_text() == "peer 0: connection lost while waiting for peer 1; it exited or crashed"


def test_the_mailboxes_are_used_only_where_every_rank_can_map_them():
    facts = dict(machine="x86_64", system="Linux", free_bytes=1 << 30, need_bytes=1 << 20)
    assert plan_mailboxes(machine_ids=["a", "a"], **facts).use
    assert plan_mailboxes(machine_ids=["a", "b"], **facts).reason == "the ranks run on 2 machines"
    assert "aarch64" in plan_mailboxes(machine_ids=["a"], **{**facts, "machine": "aarch64"}).reason
    assert "enlarge it" in plan_mailboxes(machine_ids=["a"], **{**facts, "free_bytes": 1 << 20}).reason
    layout = MailboxLayout.for_messages(3, ((0, 2), (2, 0)), 600 << 10)
    assert layout.capacity >= 2 * (600 << 10) and layout.total_bytes == layout.counters_bytes + 2 * layout.capacity
