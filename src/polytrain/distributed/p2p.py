"""Point-to-point tensor messages over a gloo process group, every one with a timeout.

A :class:`Channel` sends and receives plain tensors (nothing is pickled, so nothing from the network is
unpickled) between ranks of one process group, addressed by their rank *in that group*. Every send and
receive waits at most the channel's timeout; a peer that does not answer in time, or whose connection
drops, becomes a :class:`~polytrain.errors.CommunicationError` whose one-line message names the peer
(``names(rank)``, e.g. "parameter server rank 3").

What torch 2.13's gloo backend gives and this module relies on:

* ``irecv(..., src=None)`` posts a receive from any rank of the group (``recv_anysource``);
* ``Work.wait(timedelta)`` on a gloo send or receive raises ``RuntimeError("... Timed out waiting N ms
  ...")`` when the time is up. The timed-out operation closes the group's connections ("Application timeout
  caused pair closure"), so a timeout is final: the group cannot be used afterwards;
* a receive from (or send to) a named rank whose process has exited fails at once ("Connection closed by
  peer"); a receive from any rank does not notice a dead peer and ends only by its timeout.

A rank that talks to several peers at once (a worker asking every parameter server) uses
:meth:`Channel.exchange`: it posts every receive, then every send, then waits for all, so no two ranks can
each block in a send to the other. Who sent a message received from any rank is carried in the message itself (a header tensor,
:data:`HEADER_LEN` int64 values), not read from the receive's source rank.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from polytrain.errors import CommunicationError

HEADER_LEN = 6  # int64 values: [kind, sender, a, b, c, d]; the meaning of a, b, c and d is the protocol's
Message = tuple[torch.Tensor, int, int]  # (tensor, peer rank in the group, tag)


def _default_name(rank: int) -> str:
    return f"rank {rank}"


class Channel:
    """Tensor send/receive with ``group`` (a gloo ProcessGroup), each bounded by ``timeout``."""

    def __init__(self, group: Any, timeout: timedelta | float, names: Callable[[int], str] = _default_name,
                 me: str | None = None):
        self.group = group
        self.timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
        self.names = names
        self.rank = dist.get_rank(group)
        self.me = me or names(self.rank)

    # -- plain tensors ----------------------------------------------------------------------------------

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self.exchange(sends=[(tensor, dst, tag)])

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        self.exchange(recvs=[(tensor, src, tag)])
        return tensor

    def exchange(self, sends: Sequence[Message] = (), recvs: Sequence[Message] = ()) -> None:
        """Post every receive, then every send, then wait for all of them within one timeout.

        Posting all at once is what keeps ranks that talk to several peers from waiting on each other in a
        cycle: a peer's send to us completes as soon as it is posted on its side, whatever we wait on first.
        """
        self.complete(self.post(sends=sends, recvs=recvs))

    def post(self, sends: Sequence[Message] = (), recvs: Sequence[Message] = ()) -> list[tuple[Any, str]]:
        """Post every receive, then every send, and return at once: :meth:`complete` waits for them (the
        tensors must stay untouched until then). :meth:`exchange` is both."""
        works = [(dist.irecv(t, group=self.group, group_src=src, tag=tag), f"waiting for {self.names(src)}")
                 for t, src, tag in recvs]
        works += [(dist.isend(t, group=self.group, group_dst=dst, tag=tag), f"sending to {self.names(dst)}")
                  for t, dst, tag in sends]
        return works

    def complete(self, posted: Sequence[tuple[Any, str]]) -> None:
        """Wait for what :meth:`post` posted, all within one timeout from now."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        for work, doing in posted:
            self._wait(work, doing, deadline)

    def recv_any(self, tensor: torch.Tensor, tag: int, expected: str) -> torch.Tensor:
        """Receive from whichever rank sends first; ``expected`` says who could (for the error)."""
        work = dist.irecv(tensor, group=self.group, src=None, tag=tag)
        self._wait(work, f"waiting for a message from {expected}", time.monotonic() + self.timeout.total_seconds())
        return tensor

    # -- headers: small int64 tensors that say what follows ---------------------------------------------

    def send_header(self, dst: int, tag: int, kind: int, a: int = 0, b: int = 0, c: int = 0, d: int = 0) -> None:
        self.send(header(kind, self.rank, a, b, c, d), dst, tag)

    def recv_header(self, src: int, tag: int) -> list[int]:
        return self.recv(torch.empty(HEADER_LEN, dtype=torch.int64), src, tag).tolist()

    def recv_header_any(self, tag: int, expected: str) -> list[int]:
        return self.recv_any(torch.empty(HEADER_LEN, dtype=torch.int64), tag, expected).tolist()

    # -- errors ---------------------------------------------------------------------------------------

    def _wait(self, work: Any, doing: str, deadline: float) -> None:
        left = max(0.001, deadline - time.monotonic())  # wait(timedelta(0)) would mean "no limit"
        try:
            work.wait(timedelta(seconds=left))
        except RuntimeError as exc:
            raise CommunicationError(self._explain(exc, doing)) from exc

    def _explain(self, exc: BaseException, doing: str) -> str:
        seconds = f"{self.timeout.total_seconds():g}"
        text = str(exc)
        if "Timed out" in text:
            return (f"{self.me}: no answer within {seconds} s while {doing}; it died or hangs "
                    f"(raise --timeout if it is only slow)")
        if "closed" in text.lower() or "reset" in text.lower():
            return f"{self.me}: connection lost while {doing}; it exited or crashed"
        return f"{self.me}: {doing} failed: {text.splitlines()[0] if text else type(exc).__name__}"


def header(kind: int, sender: int, a: int = 0, b: int = 0, c: int = 0, d: int = 0) -> torch.Tensor:
    return torch.tensor([kind, sender, a, b, c, d], dtype=torch.int64)


def float_bits(value: float) -> int:
    """A float64 carried exactly in one int64 header value (e.g. the learning rate of a push)."""
    return int(torch.tensor(value, dtype=torch.float64).view(torch.int64).item())


def bits_float(bits: int) -> float:
    """The float64 that :func:`float_bits` packed into ``bits``."""
    return float(torch.tensor(bits, dtype=torch.int64).view(torch.float64).item())
