"""Failure detection by heartbeat: every rank beats into the rendezvous store and watches the others' beats.

A collective whose peer is gone waits for ``--timeout`` (300 s by default), and a peer whose machine
vanished never closes its sockets, so nothing tells the survivors before then. Under ``torchrun`` across
machines no local supervisor sees such a death either. So each rank runs one background thread that, every
``interval`` seconds, adds 1 to its own counter in the c10d store and reads every rank's counter in one
``multi_get``. A counter that has not moved for ``timeout`` seconds (measured on the watcher's own clock, so
the machines' clocks need not agree) is a lost rank: the thread calls ``on_lost`` with a
:class:`~polytrain.errors.PeerLostError` naming it (rank, what it is, host and pid), and the launcher makes
the survivor exit non-zero at once, even while its main thread is blocked inside a collective.

Nothing runs on the training thread: a step pays nothing. The thread uses a connection to the store of its
own, so it never queues behind the main thread's store calls.

Normal ends are not deaths: a rank that finishes (a parameter server, a pipeline stage, a worker done before
the others) says goodbye, which sets its counter past ``BYE``; a rank that fails with an error says so
(counter past ``FAILED``, its message under its own key), and the others report that at their next look
instead of waiting out the timeout.

Expendable ranks (``--tolerate-worker-loss``: a :class:`~polytrain.distributed.lost.LostRanks` given as
``lost``) are the exception: one that goes silent, never starts or fails is no loss of the job. The watcher
reports it to ``lost`` (with the message the error would have had), stops watching it and goes on watching the
others; the process learns of it from the registry (``topology.lost``), not by ending.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time
import traceback
from datetime import timedelta
from typing import Callable, Sequence

import torch.distributed as dist

from polytrain.distributed import collectives, hangs
from polytrain.distributed.lost import LostRanks
from polytrain.errors import PeerLostError
from polytrain.log import EVERY_RANK, get_logger

#: a counter at or past this value: the rank ended normally (goodbye); past FAILED: it failed with an error
BYE = 1 << 40
FAILED = 1 << 50
#: how long a rank may take to send its first beat (ranks start seconds apart; a missing one is the rendezvous'
#: business, which has its own timeout)
_START_FACTOR = 3


def beat_interval(timeout: float) -> float:
    """Seconds between beats: a few beats per timeout, at most one a second."""
    return min(1.0, timeout / 4)


class Heartbeat:
    """Beat for ``rank`` and watch the other ranks of a world of ``world_size`` through ``store``.

    ``store`` should be a connection of its own (``TCPStore.clone()``, or a client made for it): the
    thread's reads must not wait behind the main thread's. ``prefix`` separates one job (or one restart of
    it) from another in a store that outlives it, as torchrun's does. ``names[r]`` says what rank ``r`` is in
    the error ("parameter server rank 3"). ``on_lost(error)`` is called once, from the thread. A rank in
    ``lost.expendable`` that is lost is reported to ``lost`` instead, and no longer watched.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, *, timeout: float,
                 on_lost: Callable[[PeerLostError], None], prefix: str = "polytrain/heartbeat",
                 names: Sequence[str] | None = None, interval: float | None = None,
                 start_timeout: float | None = None, address: str | None = None, lost: LostRanks | None = None):
        self.store = store
        self.address = address  # HOST:PORT of the store, for the error when it is lost
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.interval = interval or beat_interval(timeout)
        self.start_timeout = start_timeout or _START_FACTOR * timeout
        self.on_lost = on_lost
        self.prefix = prefix.rstrip("/")
        self.names = list(names) if names else None
        self.lost = lost if lost is not None else LostRanks()
        self._unwatched: set[int] = set()  # expendable ranks reported lost: the thread's own, no lock
        self._keys = [self._key("beat", r) for r in range(world_size)]
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the thread reports a loss, or the owner stops it: one of the two
        self._ended = False
        self._thread: threading.Thread | None = None
        self._contact = time.monotonic()  # the last answer from the store

    def _key(self, kind: str, rank: int) -> str:
        return f"{self.prefix}/{kind}/{rank}"

    # -- the owner's side ----------------------------------------------------------------------------

    def start(self) -> "Heartbeat":
        """Publish where this rank runs, beat once, and start watching (a daemon thread)."""
        self.store.set_timeout(store_timeout(self.timeout))  # a hung store call counts as the store lost
        where = {"host": socket.gethostname(), "pid": os.getpid()}
        self.store.set(self._key("where", self.rank), json.dumps(where))
        self._publish()  # this rank's last collectives (distributed/hangs.py): one set with every beat
        self.store.add(self._keys[self.rank], 1)
        self._thread = threading.Thread(target=self._run, name=f"polytrain-heartbeat-{self.rank}", daemon=True)
        self._thread.start()
        # a store call to a machine that vanished may block without ever failing: a second thread watches
        # the first one's last contact with the store
        threading.Thread(target=self._guard, name=f"polytrain-heartbeat-guard-{self.rank}", daemon=True).start()
        return self

    def goodbye(self) -> None:
        """This rank ends normally: stop beating, and the others stop watching it."""
        self._end(BYE)

    def failed(self, message: str) -> None:
        """This rank ends with an error: the others report ``message`` without waiting for the timeout."""
        with contextlib.suppress(Exception):  # the store may be gone too: the peers' timeout still holds
            self.store.set(self._key("failure", self.rank), message)
        self._end(FAILED)

    def _end(self, mark: int) -> None:
        with self._lock:
            already, self._ended = self._ended, True
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            # (a loss being reported ends the process meanwhile: then this never returns, and the owner
            # does not race the thread's report)
            self._thread.join(self.interval + 5.0)
        if already:
            return
        with contextlib.suppress(Exception):
            self.store.add(self._keys[self.rank], mark)

    # -- the thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._watch()
        except Exception as exc:  # a bug here must not kill the job; it only stops the watching
            get_logger().warning(f"heartbeat stopped watching: {type(exc).__name__}: {exc}\n"
                                 f"{traceback.format_exc()}", extra=EVERY_RANK)

    def _watch(self) -> None:
        started = last_tick = time.monotonic()
        seen = [0] * self.world_size  # each rank's last counter
        moved = [started] * self.world_size  # when it last moved, on this watcher's clock
        store_since: float | None = None  # when the store stopped answering
        for key in self._keys:  # a rank not started yet reads 0 rather than blocking multi_get
            self.store.add(key, 0)
        self._moved = moved
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            try:
                self._publish()
                self.store.add(self._keys[self.rank], 1)
                values = [int(v) for v in self.store.multi_get(self._keys)]
                store_since, self._contact = None, time.monotonic()
            except Exception as exc:  # DistStoreError, a closed connection: the store's host may be gone
                store_since = store_since or now
                if now - store_since > self.timeout:
                    self._lose(PeerLostError(
                        f"the rendezvous store{self._address()} stopped answering {now - store_since:.1f} s ago "
                        f"({exc}); the process that hosts it (the launcher, or torchrun's agent on the first "
                        "machine) is gone or unreachable"))
                    return
                continue
            if now - last_tick > self.timeout / 2:
                # this watcher was not scheduled for a while (a stopped or starved process): its own pause,
                # not the others' silence; start counting afresh
                moved = [now] * self.world_size
            last_tick = now
            unwatched = set(self._unwatched)
            error = self._check(values, seen, moved, now, started)
            for rank in sorted(self._unwatched - unwatched):  # expendable ranks lost: the job goes on without them
                self._explained(PeerLostError(self.lost.lost().get(rank, f"rank {rank} was lost"), rank), values,
                                moved, now, level=logging.WARNING)
            if error is not None:
                self._lose(self._explained(error, values, moved, now))
                return

    def _guard(self) -> None:
        bound = 2 * self.timeout
        last_tick = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            if now - last_tick > self.timeout / 2:  # this process was paused, not the store
                self._contact = now
            last_tick = now
            silent = now - self._contact
            if silent > bound:
                self._lose(PeerLostError(
                    f"the rendezvous store{self._address()} has not answered for {silent:.1f} s; the process that "
                    "hosts it (the launcher, or torchrun's agent on the first machine) is gone or unreachable"))
                return

    def _check(self, values: list[int], seen: list[int], moved: list[float], now: float,
               started: float) -> PeerLostError | None:
        """The first lost rank the job cannot go on without (None: none); expendable ones are reported."""
        for rank, value in enumerate(values):
            if rank in self._unwatched and rank not in self.lost:  # revived (--on-failure continue): watched afresh
                self._unwatched.discard(rank)
                seen[rank], moved[rank] = value, now
            if rank == self.rank or rank in self._unwatched:
                continue
            error = self._verdict(rank, value, seen, moved, now, started)
            if error is None:
                continue
            if rank not in self.lost.expendable:
                return error
            self._unwatched.add(rank)  # it may beat again (frozen, then continued): it stays lost
            self.lost.report(rank, str(error))
        return None

    def _verdict(self, rank: int, value: int, seen: list[int], moved: list[float], now: float,
                 started: float) -> PeerLostError | None:
        """Whether ``rank``, whose counter reads ``value``, is lost (the error that says so) or not (None)."""
        if value >= FAILED:
            return PeerLostError(f"{self._describe(rank)} failed: {self._failure(rank)}", rank)
        if value >= BYE:
            return None
        if value != seen[rank]:
            seen[rank], moved[rank] = value, now
            return None
        silent = now - moved[rank]
        if value == 0 and now - started > self.start_timeout:
            return PeerLostError(f"{self._describe(rank)} sent no heartbeat within {self.start_timeout:g} s of "
                                 "the start: it did not start, or died starting", rank)
        if value > 0 and silent > self.timeout:
            return PeerLostError(
                f"{self._describe(rank)} sent no heartbeat for {silent:.1f} s (bound: --heartbeat-timeout "
                f"{self.timeout:g}): it died, was stopped, or its machine is unreachable", rank)
        return None

    def _lose(self, error: PeerLostError) -> None:
        with self._lock:
            if self._ended:  # the owner ended this rank normally meanwhile: nothing to report
                return
            self._ended = True
        self.on_lost(error)

    # -- the hang report (distributed/hangs.py) --------------------------------------------------------

    def _publish(self) -> None:
        """This rank's last collective, where the others read it when something hangs (store errors propagate:
        the beat that follows would meet the same)."""
        try:
            record = json.dumps(collectives.latest())
        except Exception:  # a bug in reading the record must not stop the beat
            return
        self.store.set(self._key("last", self.rank), record)

    def _explained(self, error: PeerLostError, values: list[int], moved: list[float], now: float,
                   level: int = logging.ERROR) -> PeerLostError:
        """Print and write the hang report for a silent rank's ``error``; the error, naming where that rank was
        and where the report is. A rank that failed with an error (its message says why) gets none."""
        if error.rank is None or not 0 < values[error.rank] < BYE:  # (0: it never started; no hang)
            return error
        try:
            text, verdict = self._report(str(error), values, moved, now, level)
        except Exception as exc:  # the report is a help, never a reason to keep a survivor waiting
            get_logger().warning(f"no hang report: {type(exc).__name__}: {exc}", extra=EVERY_RANK)
            return error
        path = hangs.write(text)
        where = verdict.get(error.rank, "").split(", ", 1)[-1]  # (less its silence: the error says it)
        if not where and not path:
            return error
        return PeerLostError(f"{error}" + (f"; {where}" if where else "")
                             + (f"; hang report in {path}" if path else ""), error.rank)

    def explain(self, headline: str) -> str | None:
        """The hang report, for a collective of this rank that timed out (called from the main thread): logged,
        written to the run directory; its text (None if it could not be made)."""
        moved = getattr(self, "_moved", None)
        try:
            values = [int(v) for v in self.store.multi_get(self._keys)]
            now = time.monotonic()
            text, _ = self._report(headline, values, moved or [now] * self.world_size, now)
        except Exception as exc:
            get_logger().warning(f"no hang report: {type(exc).__name__}: {exc}", extra=EVERY_RANK)
            return None
        hangs.write(text)
        return text

    def _report(self, headline: str, values: list[int], moved: list[float], now: float,
                level: int = logging.ERROR) -> tuple[str, dict[int, str]]:
        records: dict[int, dict | None] = {}
        for rank in range(self.world_size):
            key = self._key("last", rank)
            if rank == self.rank:
                records[rank] = collectives.latest()
            elif self.store.check([key]):
                records[rank] = json.loads(self.store.get(key))
            else:
                records[rank] = None
        ended = [r for r, v in enumerate(values) if v >= BYE]
        since = {r: (0.0 if r == self.rank else now - moved[r]) for r in range(self.world_size)}
        silent = {r: since[r] for r in range(self.world_size)
                  if r != self.rank and r not in ended and since[r] > self.timeout}
        names = [self._describe(r) for r in range(self.world_size)]
        text, verdict = hangs.report(self.rank, headline, records, since, silent, names, ended)
        get_logger().log(level, text)
        return text, verdict

    def _address(self) -> str:
        """`` at HOST:PORT`` of a TCP store (what a survivor cut off from it can check), else nothing."""
        if self.address:
            return f" at {self.address}"
        host, port = getattr(self.store, "host", None), getattr(self.store, "port", None)
        return f" at {host}:{port}" if host and port else ""

    def _describe(self, rank: int) -> str:
        name = self.names[rank] if self.names and rank < len(self.names) else f"rank {rank}"
        with contextlib.suppress(Exception):
            if self.store.check([self._key("where", rank)]):
                where = json.loads(self.store.get(self._key("where", rank)))
                return f"{name} (host {where['host']}, pid {where['pid']})"
        return name

    def _failure(self, rank: int) -> str:
        with contextlib.suppress(Exception):
            return self.store.get(self._key("failure", rank)).decode(errors="replace")
        return "(its error did not reach the store)"


def exit_on_loss(report: Callable[[PeerLostError], None] | None = None,
                 code: int = PeerLostError.exit_code) -> Callable[[PeerLostError], None]:
    """An ``on_lost`` that logs the error, hands it to ``report`` (the launcher's pipe), writes torchrun's
    error file where torchrun asked for one, and ends this process at once: the main thread may be blocked
    in a collective that would otherwise wait for ``--timeout``."""

    def lost(error: PeerLostError) -> None:
        try:
            get_logger().error(f"{error}; stopping this rank")
            if report is not None:
                report(error)
            _record_for_torchrun(error)
            if error.rank is None:
                _end_stranded_agent()
        finally:
            os._exit(code)

    return lost


def _end_stranded_agent() -> None:
    """Under torchrun, when the rendezvous store is lost: end this worker's torchrun agent too. The agent
    polls the same store from its main loop, blocked in a receive over a link that vanished (measured: it
    ignores SIGTERM and never exits, and never reaps its workers); so the machine cut off from the store
    ends its whole job, as the one that still has it does."""
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return
    agent = os.getppid()
    with contextlib.suppress(OSError):
        with open(f"/proc/{agent}/cmdline", "rb") as fh:
            cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace")
        if "torch.distributed.run" in cmdline or "torchrun" in cmdline:
            get_logger().error(f"ending torchrun's agent (pid {agent}): it waits on the same lost store and "
                               "would not exit by itself")
            os.kill(agent, signal.SIGKILL)


def _record_for_torchrun(error: PeerLostError) -> None:
    """torchrun's agent reads a failed worker's error file (TORCHELASTIC_ERROR_FILE) for its summary."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    with contextlib.suppress(Exception):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
        ErrorHandler().record_exception(error)


class NoHeartbeat:
    """What :func:`watch_peers` returns when there is nothing to watch (one process, or turned off)."""

    def goodbye(self) -> None:
        pass

    def failed(self, message: str) -> None:
        pass


def watch_peers(address: str, port: int, rank: int, world_size: int, timeout: float, *,
                connect_timeout: float, names: Sequence[str] | None = None,
                report: Callable[[PeerLostError], None] | None = None,
                prefix: str = "polytrain/heartbeat", lost: LostRanks | None = None) -> Heartbeat | NoHeartbeat:
    """Start this rank's heartbeat on a connection of its own to the store at ``address:port``; a lost
    peer ends this process (:func:`exit_on_loss`), unless it is expendable in ``lost``: then it is reported
    there. ``timeout`` 0 turns it off."""
    if timeout <= 0 or world_size < 2:
        return NoHeartbeat()
    store = dist.TCPStore(address, port, None, is_master=False, timeout=store_timeout(connect_timeout))
    return Heartbeat(store, rank, world_size, timeout=timeout, on_lost=exit_on_loss(report), prefix=prefix,
                     names=names, address=f"{address}:{port}", lost=lost).start()


def store_timeout(seconds: float) -> timedelta:
    """The heartbeat connection's own store timeout: a call that hangs longer counts as a store failure."""
    return timedelta(seconds=max(1.0, seconds))
