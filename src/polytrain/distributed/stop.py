"""Stopping a job in order when asked: a signal, to the launching process or to any rank.

SIGTERM, SIGINT, SIGHUP and SIGUSR1 are how Slurm (``scancel``, ``--signal=USR1@90``), Kubernetes (a pod's
grace period), a terminal (Ctrl-C, a closed session) or a user stop or preempt a job. The first one asks for
an **orderly stop**, wherever it lands: the trainer ranks agree on one step, write a checkpoint there when
the run has a checkpoint directory, and end; the command then exits with :data:`EXIT_STOPPED` (75, "stopped,
resumable": the same command with ``--resume`` continues at that step) or, when nothing could be saved,
with 128 + the signal's number. A second signal stops at once: the launcher kills its workers, a rank exits
on the spot. One stop counts once, however many times it reaches a process: ``timeout`` and Slurm signal the
command and its process group, so the same signal arrives twice within microseconds; a repeat of the first
signal within :data:`REPEAT_WINDOW_S` of its handling is that same delivery. Spawned workers run in process
groups of their own (:mod:`.worker`), so a signal to the command's group reaches only the launching process,
which passes the request on, and never a worker's compiler subprocess (``--compile``) or checkpoint writer.

How a request travels: the process a signal reaches writes it into the rendezvous store; every rank has a
thread waiting for that key, which sets its flag. A step only reads the flag.

How the ranks agree on the step, without a collective per step and without anyone waiting: a *collective
boundary* is a step whose work ends with a collective over every trainer rank (sync's all-reduce, a pipeline
step, local SGD's averaging step, a log point). A rank that knows of the request at boundary ``d`` proposes
the first collective boundary after ``d`` (:meth:`StopAgreement.stop_step`), and from there, at each
collective boundary, looks (without waiting) whether every rank has proposed: if so the stop step is the
largest proposal, else it goes on. A rank that has not proposed by the time another has finished the
collective of boundary ``b`` knew nothing at ``b - 1`` (its proposal would be in the store before it entered
that collective), so its proposal will come after ``b``: whoever goes on past ``b`` never passes the stop
step, and every rank computes the same one from the same proposals.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Iterator

from polytrain.log import get_logger

#: the signals that ask for an orderly stop
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1")
                     if hasattr(signal, name))
#: the launcher's nudge to its workers: "a stop was asked, it is in the store" (noticed before the next step)
NUDGE = getattr(signal, "SIGUSR2", None)
#: the exit code of a run stopped by a signal after writing a checkpoint (sysexits' EX_TEMPFAIL: try again)
EXIT_STOPPED = 75
#: a repeat of the first stop signal while it is being taken, or this soon (seconds) after, is the same delivery, not a second
#: signal: ``timeout`` sends its signal to the command and then to the command's process group, Slurm to the
#: job step's processes and their group, so one stop reaches a process twice within microseconds
REPEAT_WINDOW_S = 1.0
_KEY = "request"
_STARTED = "started"  # "training" once the trainers' rank 0 began, or "stopped" by the launcher before that
_WATCH_TIMEOUT = timedelta(days=365)  # the watcher waits for the key for as long as the job lives


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def signal_number(name: str) -> int:
    """``SIGTERM`` -> 15; 0 for anything else."""
    member = getattr(signal.Signals, name, None) if name.startswith("SIG") else None
    return int(member) if member is not None else 0


def exit_code(signum: int) -> int:
    """The shell's code for a process ended by ``signum`` (SIGTERM: 143, SIGINT: 130)."""
    return 128 + signum


class StopNow(BaseException):
    """A second signal: stop at once (a BaseException, so that no ``except Exception`` swallows it)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped at once by a second {signal_name(signum)}")
        self.signum = signum


class StopBeforeTraining(BaseException):
    """The launcher was asked to stop before any rank began training: its workers may simply be killed."""

    def __init__(self, name: str, signum: int):
        super().__init__(name)
        self.name, self.signum = name, signum


class StopSignal:
    """One process's view of a stop request: signals to this process, and, once connected to the job's
    store, every other process's.

    ``requested`` is the first request's signal name (None: none). :meth:`install` sets the signal handlers
    (main thread only); :meth:`connect` publishes requests to the store and watches for the others'. A second
    signal calls ``at_once``, or, by default, raises :class:`StopNow` in the main thread, except while
    :meth:`deferring`: then the owner calls :meth:`check` where raising is safe (woken by :attr:`wake_fd`).
    """

    def __init__(self) -> None:
        self._name: str | None = None
        self._signum = 0
        self._lock = threading.Lock()
        self._store: Callable[[], Any] | None = None  # a new client connection to the job's store
        self._prefix = "polytrain/stop"
        self._published = False
        self._launcher: Any = None  # a launcher's own connection to its workers' store (for the handler)
        self._before_training = False  # a launcher asked to stop before its workers began training
        self._second = 0  # a second signal's number
        self._deferred = False
        self._wake_r, self._wake_w = -1, -1
        self._nudge: Callable[[], list[int]] = lambda: []  # a launcher's live workers
        self._nudged = False  # the launcher nudged this worker: the request's name is in the store

    @property
    def requested(self) -> str | None:
        """The first request's signal name (``"a stop request"`` until a nudged worker has read it)."""
        return self._name if self._name is not None or not self._nudged else "a stop request"

    @property
    def signum(self) -> int:
        return self._signum

    def request(self, name: str, signum: int = 0) -> bool:
        """Ask for an orderly stop (the first request wins); returns whether this was the first."""
        with self._lock:
            if self._name is not None:
                return False
            self._name, self._signum = name, signum
            launcher = self._launcher
        if launcher is None:
            self._publish()
        elif launcher.compare_set(self._key(_STARTED), "", "stopped") == b"stopped":
            self._before_training = True  # nobody trains yet: the launcher ends its workers (check())
        else:  # at once, on its own connection (this is the main thread); then a nudge to every worker
            with self._lock:
                self._published = True
            with contextlib.suppress(Exception):
                launcher.set(self._key(_KEY), name)
            for pid in self._nudge():
                with contextlib.suppress(OSError):
                    os.kill(pid, NUDGE)
        return True

    def begin(self) -> bool:
        """Called by the trainer ranks' rank 0 before its first step: False when its launcher was asked to stop
        before that (it is killing the workers: nothing was trained, nothing is lost); True otherwise."""
        if self._store is None:
            return True
        return self._store().compare_set(self._key(_STARTED), "", "training") == b"training"

    # -- signals -------------------------------------------------------------------------------------

    def install(self, at_once: Callable[[int], None] | None = None, level: int = logging.WARNING,
                nudged: bool = False, saves: str = "after a checkpoint there if the run has a checkpoint "
                                                   "directory") -> Callable[[], None]:
        """From now on the first stop signal calls :meth:`request` and says so (at ``level``), a later one
        ``at_once(signum)`` (default: raise :class:`StopNow`, or leave it to :meth:`check` while
        :meth:`deferring`); with ``nudged`` (a launched worker), the launcher's :data:`NUDGE` marks a request
        at once. Returns what restores the previous handlers. Outside the main thread (where Python cannot
        install handlers) this does nothing."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        count = [0]
        first: list[Any] = []  # the first signal's number, and when its handling ended (None: under way)

        def handle(signum: int, frame: Any) -> None:
            if first and first[0] == signum and (first[1] is None or time.monotonic() - first[1] < REPEAT_WINDOW_S):
                return  # the same delivery again (to the command and to its process group): counted once; Python
                # may run this inside the first one's handling, which is what `None` covers
            count[0] += 1
            if count[0] == 1:
                first[:] = [signum, None]
                name = signal_name(signum)
                try:
                    self.request(name, signum)  # (already requested by another process: no matter)
                    get_logger().log(level, f"{name}: stopping in order at a step every rank agrees on"
                                            + (f", {saves}" if saves else "") + "; a second signal stops at once")
                finally:
                    first[1] = time.monotonic()
            else:
                self._second = self._second or signum
            self._wake()
            if count[0] > 1 and at_once is not None:
                at_once(signum)
            elif count[0] > 1 and not self._deferred:
                raise StopNow(signum)

        saved = {sig: signal.signal(sig, handle) for sig in STOP_SIGNALS}
        if nudged and NUDGE is not None:  # the launcher's nudge: a request is in the store (the watcher reads it)
            saved[NUDGE] = signal.signal(NUDGE, lambda signum, frame: setattr(self, "_nudged", True))

        def restore() -> None:
            for sig, old in saved.items():
                signal.signal(sig, old)

        return restore

    @contextlib.contextmanager
    def handling(self, at_once: Callable[[int], None] | None = None, level: int = logging.WARNING,
                 saves: str = "after a checkpoint there if the run has a checkpoint directory",
                 ) -> Iterator["StopSignal"]:
        """:meth:`install` for the duration of the block; ``saves``: what the stop step keeps, as its line says
        ("" for nothing)."""
        restore = self.install(at_once, level, saves=saves)
        try:
            yield self
        finally:
            restore()

    @contextlib.contextmanager
    def deferring(self) -> Iterator["StopSignal"]:
        """Within the block no handler raises (a launcher starting or watching its workers): what a signal
        asks for is raised by :meth:`check`, which the owner calls where it is safe and whenever
        :attr:`wake_fd` becomes readable."""
        self._deferred = True
        try:
            yield self
        finally:
            self._deferred = False

    @property
    def wake_fd(self) -> int:
        """A descriptor that becomes readable when a stop signal arrives (read it empty before waiting again)."""
        if self._wake_r < 0:
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_r, False)
            os.set_blocking(self._wake_w, False)
        return self._wake_r

    def check(self) -> None:
        """Raise what the signals so far ask for at once: :class:`StopNow` after a second signal,
        :class:`StopBeforeTraining` when the workers need not stop in order (nobody trained yet)."""
        with contextlib.suppress(OSError):
            while self._wake_r >= 0 and os.read(self._wake_r, 512):
                pass
        if self._second:
            raise StopNow(self._second)
        if self._before_training:
            raise StopBeforeTraining(self._name or "", self._signum)

    def _wake(self) -> None:
        if self._wake_w >= 0:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"!")

    # -- the job's store -----------------------------------------------------------------------------

    def connect(self, store_factory: Callable[[], Any], prefix: str = "polytrain/stop", watch: bool = True,
                launcher: Callable[[], list[int]] | None = None) -> None:
        """Publish this process's request (now, if one came earlier) to the store ``store_factory()``
        connects to, under ``prefix``; with ``watch``, a thread takes any other process's request from it.
        A ``launcher`` (of a new set of workers, each time; it gives their pids) ends them at once when asked
        to stop before they began training, else nudges them (:data:`NUDGE`) after publishing."""
        launcher_store = store_factory() if launcher is not None else None
        with self._lock:
            self._store, self._prefix, self._published = store_factory, prefix.rstrip("/"), False
            self._launcher, self._before_training = launcher_store, False
            self._nudge = launcher or (lambda: [])
        self._publish()
        if watch:
            threading.Thread(target=self._watch, name="polytrain-stop-watch", daemon=True).start()

    def _key(self, *parts: Any) -> str:
        return "/".join([self._prefix, *map(str, parts)])

    def _publish(self) -> None:
        with self._lock:
            if self._name is None or self._store is None or self._published:
                return
            self._published = True
            name = self._name
        # a thread of its own: this may run inside a signal handler, and a store call may block
        threading.Thread(target=self._set, args=(name,), name="polytrain-stop-publish", daemon=True).start()

    def _set(self, name: str) -> None:
        with contextlib.suppress(Exception):  # the store is gone: the job is ending anyway
            self._store().set(self._key(_KEY), name)

    def _watch(self) -> None:
        try:
            store = self._store()
            store.wait([self._key(_KEY)], _WATCH_TIMEOUT)
            name = store.get(self._key(_KEY)).decode()
        except Exception:  # the store is gone (the job ended, or the heartbeat reports it)
            return
        with self._lock:
            if self._name is None:
                self._name, self._published = name, True

    def agreement(self, rank: int, size: int, timeout: timedelta = timedelta(minutes=5)) -> "StopAgreement":
        """The trainer ranks' agreement on the stop step, for rank ``rank`` of ``size`` trainer ranks."""
        return StopAgreement(self, rank, size, timeout)


class StopAgreement:
    """Which step the trainer ranks stop after, once a stop was requested (see the module's docstring)."""

    def __init__(self, stop: StopSignal, rank: int, size: int, timeout: timedelta):
        self.stop, self.rank, self.size = stop, rank, size
        self._timeout = timeout
        self._store: Any = None
        self.proposal: int | None = None
        self.target: int | None = None
        #: once agreed, each trainer rank's step boundary when it first knew of the request, and its proposal
        self.seen: list[int] | None = None
        self.proposed: list[int] | None = None

    def stop_step(self, done: int, collective: Callable[[int], bool], last: int) -> int | None:
        """Called at every step boundary (``done`` steps done) before the next step: the step to stop after,
        once known (None: go on). ``collective(b)``: whether step ``b`` ends with a collective over every
        trainer rank; ``last``: the run's last step (a proposal never goes past it: the run ends there)."""
        if self.target is not None or self.stop.requested is None:
            return self.target
        if self.size == 1:
            self.target = done
            self.seen, self.proposed = [done], [done]
            return done
        if self.proposal is None:
            self.proposal = next((b for b in range(done + 1, last) if collective(b)), last)
            self._client().set(self._key(self.rank), f"{self.proposal} {done}")  # the proposal, where it was seen
        if done >= self.proposal and collective(done):
            keys = [self._key(rank) for rank in range(self.size)]
            if self._client().check(keys):
                values = [value.split() for value in self._client().multi_get(keys)]
                self.proposed, self.seen = [int(p) for p, _ in values], [int(d) for _, d in values]
                self.target = max(self.proposed)
                if self.target < done:  # a strategy that called a step collective which is not
                    raise RuntimeError(f"stop step {self.target} agreed while this rank is already at step {done}")
        return self.target

    def record(self) -> dict[str, Any]:
        """Once agreed, how: each trainer rank's step boundary when it knew of the request (``seen``) and the
        step it proposed (``proposed``: the first one after ``seen`` that ends with a collective)."""
        return {"seen": self.seen, "proposed": self.proposed}

    def _key(self, rank: int) -> str:
        return self.stop._key("at", rank)

    def _client(self) -> Any:
        if self._store is None:
            if self.stop._store is None:  # only a process whose launch connected it gets a request from elsewhere
                raise RuntimeError("a stop over several ranks needs the job's store (StopSignal.connect)")
            self._store = self.stop._store()
            self._store.set_timeout(self._timeout)
        return self._store


def exit_at_once(signum: int) -> None:
    """A rank's answer to a second signal: one line, then exit with the signal's code, without cleanup."""
    with contextlib.suppress(Exception):
        sys.stderr.write(f"polytrain: {signal_name(signum)} again: stopping this process at once\n")
        sys.stderr.flush()
    os._exit(exit_code(signum))
