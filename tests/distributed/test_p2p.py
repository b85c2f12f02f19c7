"""Channel on real gloo processes: tensors both ways, receive from any rank, and errors that name the peer."""

import contextlib
import os
from pathlib import Path

import pytest
import torch

from polytrain.distributed.p2p import Channel
from polytrain.errors import CommunicationError, WorkerError
from tests.helpers.spawn import spawn

TAG, DATA = 3, 4


def exchange(ctx):
    channel = Channel(ctx.topology.group, timeout=30)
    if ctx.rank == 0:
        got = {}
        for _ in range(2):
            kind, sender, a, b, *_ = channel.recv_header_any(TAG, "rank 1 or 2")
            payload = channel.recv(torch.empty(a, dtype=torch.float64), sender, DATA)
            got[sender] = (kind, b, payload.tolist())
            channel.send(payload * 2, sender, DATA)
        return got
    payload = torch.arange(ctx.rank + 1, dtype=torch.float64)
    channel.send_header(0, TAG, kind=7, a=payload.numel(), b=10 * ctx.rank)
    channel.send(payload, 0, DATA)
    return channel.recv(torch.empty_like(payload), 0, DATA).tolist()


def test_headers_from_any_rank_then_values_from_that_rank():
    results = spawn(exchange, 3, timeout=30)
    assert results[0] == {1: (7, 10, [0.0, 1.0]), 2: (7, 20, [0.0, 1.0, 2.0])}
    assert results[1] == [0.0, 2.0] and results[2] == [0.0, 2.0, 4.0]


def silent_peer(ctx):
    if ctx.rank == 0:
        Channel(ctx.topology.group, timeout=1).recv_header_any(TAG, "rank 1")
    else:  # waits (longer) for a message that never comes; ends quietly when rank 0 goes, so that the
        # launcher's report is rank 0's error and not this rank's lost connection
        with contextlib.suppress(CommunicationError):
            Channel(ctx.topology.group, timeout=60).recv_header(0, TAG)


def test_a_receive_that_times_out_names_the_peer():
    with pytest.raises(CommunicationError, match=r"rank 0: no answer within 1 s while waiting for a message "
                                                 r"from rank 1; it died or hangs"):
        spawn(silent_peer, 2, timeout=30)


def exiting_peer(ctx, said):
    channel = Channel(ctx.topology.group, timeout=60, names=lambda r: f"peer {r}")
    if ctx.rank == 1:
        os._exit(1)
    try:
        channel.recv_header(1, TAG)
    except CommunicationError as exc:
        Path(said).write_text(str(exc))  # what rank 0 itself says
        raise


def test_a_peer_that_exits_is_named_without_waiting_for_the_timeout(tmp_path, monkeypatch):
    # the launcher stops the ranks still running 1 s after the first failure; rank 0 is given 20 s to fail by
    # itself instead (a loaded machine can leave it unscheduled for a second: under a CPU burner it was stopped
    # before it wrote what it said), which is still a third of the channel's timeout
    monkeypatch.setattr("polytrain.distributed.supervisor._SETTLE_S", 20.0)
    # the job's error is the cause the launcher saw, rank 1's exit, with rank 0's failure after it
    with pytest.raises(WorkerError, match=r"^worker rank 1 exited with code 1 .* \(then rank\(s\) 0 failed too\)"):
        spawn(exiting_peer, 2, str(tmp_path / "said"), timeout=30)
    # rank 0's receive failed at once, naming the peer (not after the channel's 60 s timeout)
    assert (tmp_path / "said").read_text() == "peer 0: connection lost while waiting for peer 1; it exited or crashed"
