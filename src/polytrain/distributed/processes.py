"""The launcher's helper processes from multiprocessing: how workers start (a forkserver that has imported
torch once), the forkserver made ready while a stop signal can still end the launch, and both helpers (the
forkserver and the resource tracker) ended before the command exits."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import threading
import time
from typing import Any

import torch.multiprocessing as mp

from polytrain.distributed.mp_helpers import forkserver_pid, helper_processes, helper_table
from polytrain.distributed.prestart import PRELOAD, prestarted
from polytrain.distributed.stop import StopSignal
from polytrain.errors import ConfigError


#: how workers start: ``forkserver`` forks them from a server that has imported torch and polytrain once
#: (a worker is up in a fraction of a second instead of importing torch anew); ``spawn`` is the fallback
#: for environments where forking is not wanted: set ``POLYTRAIN_START_METHOD=spawn``; ``fork`` forks them from
#: the launching process itself, which is what a function defined in ``python -c``, a REPL or a notebook needs
#: (:func:`start_context` picks it there on its own)
START_METHODS = ("forkserver", "spawn", "fork")



def start_context(job: Any = None) -> Any:
    """The multiprocessing context that starts the workers of ``job``: ``POLYTRAIN_START_METHOD``'s, else the
    forkserver; or, where what the workers run cannot be imported by name in a fresh process (a function
    defined in ``python -c``, a REPL or a notebook), a fork of this process, on Linux before CUDA is in use.
    Where it can be neither, one ConfigError line says to put the function in a file."""
    chosen = os.environ.get("POLYTRAIN_START_METHOD")
    if chosen is not None and chosen not in START_METHODS:
        raise ConfigError(f"POLYTRAIN_START_METHOD={chosen}: must be one of {', '.join(START_METHODS)}")
    unimportable = _unimportable(job) if job is not None else None
    method = chosen or ("fork" if unimportable else "forkserver")
    why = _cannot_fork() if method == "fork" else f"POLYTRAIN_START_METHOD={chosen} starts fresh processes"
    if unimportable and (method != "fork" or why):
        raise ConfigError(f"launch: {unimportable}, so a fresh process cannot import it, and this process cannot "
                          f"fork the workers instead ({why}); put the function in a file (a module) and import it "
                          "from there")
    if method == "fork" and why:
        raise ConfigError(f"POLYTRAIN_START_METHOD=fork: this process cannot fork its workers ({why}); unset it")
    ctx = mp.get_context(method)
    if method == "forkserver":
        wanted = [*PRELOAD, *strategy_modules()]
        early = prestarted(forkserver_pid())  # started at the command's first moment (distributed/prestart.py)
        if early is not None and not set(wanted) <= early:  # the guess missed a module: a forkserver as always
            stop_helper_processes(keep=helper_processes() - {forkserver_pid()})
        # (only read when the forkserver starts: once per launcher process)
        ctx.set_forkserver_preload(wanted)
    return ctx


def strategy_modules() -> list[str]:
    """polytrain's own strategy modules that this process has imported, for the forkserver to import once: the
    run's own strategy (the launcher's checks import it), not the others (their modules import DTensor,
    pipelining and the tracer: seconds of CPU that a run of ``sync`` need not pay), nor the launcher's before it
    is needed (``polytrain plan`` imports none)."""
    from polytrain.strategies.registry import BUILTIN_STRATEGIES

    return [module for module in dict.fromkeys(BUILTIN_STRATEGIES.values()) if module in sys.modules]


def _unimportable(job: Any) -> str | None:
    """What makes ``job``'s function (or what it is sent with) unimportable in a fresh process, in words; None
    when a fresh process can import all of it by name."""
    name = getattr(job.fn, "__name__", repr(job.fn))
    try:
        sent = pickle.dumps(job)
    except Exception as exc:  # noqa: BLE001 - a lambda, a local function, an object pickle refuses
        return f"{name} cannot be sent to a fresh process ({type(exc).__name__}: {str(exc).splitlines()[0]})"
    main = sys.modules.get("__main__")
    if b"__main__" in sent and main is not None and not getattr(main, "__file__", None):
        return f"{name} is defined in __main__, which has no file (python -c, a REPL or a notebook)"
    return None


def fork_or_spawn() -> str:
    """How a plain script of torch.multiprocessing workers (the benchmarks' references) starts them: ``fork``
    where this process can (Linux, CUDA unused), so that no worker imports torch again; else ``spawn``."""
    return "spawn" if _cannot_fork() else "fork"


def _cannot_fork() -> str | None:
    """Why this process cannot fork its workers; None when it can."""
    if not sys.platform.startswith("linux"):
        return f"forking a process with threads is safe only on Linux, not on {sys.platform}"
    import torch

    if torch.cuda.is_initialized():
        return "it has used CUDA, which a forked process cannot use again"
    return None


#: the forkservers that have imported everything and forked a worker (a restart's launch finds its own there)
_WARM: set[int] = set()


def forkserver_ready(ctx: Any, stop: StopSignal | None) -> None:
    """Start the forkserver (it imports torch first: seconds) in a thread, while this one stays ready to
    stop: a signal meanwhile ends the launch at once (no worker exists yet) instead of after the import. A
    forkserver already warm (an earlier launch of this process: a restart's) is used as it is."""
    if stop is None or ctx.get_start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    # spawned from this (main) thread: the kernel ends the forkserver when the thread that started it ends
    forkserver.ensure_running()
    pid = forkserver_pid()
    if pid is not None and pid in _WARM:
        return
    done = threading.Event()

    def start() -> None:
        with contextlib.suppress(Exception):  # killed at the command's end if the launch was stopped meanwhile
            proc = ctx.Process(target=_ready, name="polytrain-warmup")
            proc.start()
            proc.join()
        done.set()

    threading.Thread(target=start, name="polytrain-forkserver-start", daemon=True).start()
    while not done.wait(0.05):
        stop.check()
    if pid is not None:
        _WARM.add(pid)


def _ready() -> None:
    """The forkserver's first child: nothing to do (it proves the forkserver has imported and forks)."""


def stop_helper_processes(timeout: float = 5.0, keep: set[int] | frozenset[int] = frozenset()) -> None:
    """End this process's multiprocessing forkserver and resource tracker now (they would outlive the
    command by seconds otherwise, which a scheduler sees as a job still running), except those in ``keep``
    (a command run inside a longer program leaves the helpers that program had before it as it found them).
    The forkserver holds nothing to clean up and may still be importing torch: it is killed; the resource
    tracker is asked to end (it removes what a killed worker left registered) and killed after ``timeout``
    seconds (through :mod:`polytrain.distributed.mp_helpers`: the standard library stops them only at exit)."""
    for owner, pid_attr, fd_attr, waits in helper_table():
        pid, fd = getattr(owner, pid_attr, None), getattr(owner, fd_attr, None)
        if pid is None or fd is None or pid in keep:
            continue
        _WARM.discard(pid)
        with contextlib.suppress(OSError):
            os.close(fd)  # its end of the "alive" pipe: the helper exits when every copy is closed
        setattr(owner, fd_attr, None)
        setattr(owner, pid_attr, None)
        _reap(pid, timeout if waits else 0.0)


def _reap(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        if time.monotonic() > deadline:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            return
        time.sleep(0.01)
