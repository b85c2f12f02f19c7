"""``polytrain train``'s forkserver started at the command's first moment, so that its import of torch overlaps
the command's own.

A local run's workers are forked from a multiprocessing forkserver that has imported torch and polytrain once
(:mod:`polytrain.distributed.processes`). Started where the launcher needs it, the forkserver's imports came
after the command's (its settings and checks import torch too), one after the other: on 2 cores the forkserver
started 7.5 s after the command and forked the workers 10 s later (``train --workers 2 --steps 2`` at a load of
8). :func:`prestart` starts it before the command imports anything heavy, from the command line alone, with the
modules the run will want: the two imports then run side by side.

It is a guess made from the arguments (``--strategy``, ``--workers``, ``--device``, ``--config``'s keys, the
environment of torchrun, srun or mpirun). Where the run starts no forkserver after all (one worker in this
process, a job of torchrun's), the command's end stops it; where the run wants modules it did not import (the
degrees picked another strategy's class), the launcher stops it and starts one as it always did
(:func:`~polytrain.distributed.processes.start_context`). A wrong guess costs CPU, never a different run.

This module imports nothing of torch's."""

from __future__ import annotations

import os
from typing import Sequence

from polytrain.builtin_strategies import BUILTIN_STRATEGIES, DEFAULT_STRATEGY
from polytrain.distributed.mp_helpers import forkserver_pid, tracker_pid

#: what the forkserver imports once, so that no worker imports it again: torch._dynamo too (a torch optimizer
#: imports it when the first one is made: 800 modules, seconds of CPU in every worker otherwise); the run's own
#: strategy module comes after them
PRELOAD = ["polytrain.distributed.forkserver_init", "torch", "torch.distributed", "torch._dynamo",
           "polytrain.distributed.worker", "polytrain.train.trainer"]

#: the other strategies' modules that importing a strategy's module imports (so that the launcher's check finds
#: them preloaded; an entry too few restarts the forkserver, one too many imports a module no worker uses)
_IMPORTS_WITH = {"polytrain.parallel.fsdp": ("polytrain.parallel.tp.strategy",),
                 "polytrain.parallel.pp.strategy": ("polytrain.parallel.fsdp", "polytrain.parallel.tp.strategy")}
#: a process started by one of these has its workers started by them, not by polytrain's forkserver
_LAUNCHED_ELSEWHERE = ("TORCHELASTIC_RUN_ID", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
#: arguments after which the command trains nothing
_NO_RUN = ("-h", "--help", "--help-all", "--print-config")

_started: dict[int, frozenset[str]] = {}  # the prestarted forkserver's pid -> what it preloads
_trackers: set[int] = set()  # the resource tracker started with it


def prestart(argv: Sequence[str]) -> None:
    """Start the forkserver now when ``argv`` (the command's arguments, the command first) is a ``train`` run
    whose workers it will fork; else do nothing."""
    strategy = guess_strategy(argv, os.environ)
    if strategy is None:
        return
    from multiprocessing import forkserver

    module = BUILTIN_STRATEGIES[strategy]
    preload = [*PRELOAD, module, *_IMPORTS_WITH.get(module, ())]
    tracker = tracker_pid()
    forkserver.set_forkserver_preload(preload)
    forkserver.ensure_running()  # from the main thread: the forkserver dies with it (forkserver_init)
    pid = forkserver_pid()
    if pid is not None:
        _started[pid] = frozenset(preload)
    if tracker is None and (started := tracker_pid()) is not None:  # multiprocessing's resource tracker, with it
        _trackers.add(started)


def prestarted(pid: int | None) -> frozenset[str] | None:
    """What the forkserver ``pid`` preloads when :func:`prestart` started it; None otherwise."""
    return _started.get(pid) if pid is not None else None


def prestarted_pids() -> set[int]:
    """The helper processes :func:`prestart` started: the forkserver, and the resource tracker with it."""
    return set(_started) | _trackers


def stop_prestarted() -> None:
    """Kill the forkserver :func:`prestart` started and multiprocessing's resource tracker with it (a stop signal
    while the command starts: nothing else has run). The forkserver would die with this process anyway, once
    its first import has run."""
    import signal

    for pid in prestarted_pids():
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (OSError, ChildProcessError):
            pass
    _started.clear()
    _trackers.clear()


def guess_strategy(argv: Sequence[str], environ: "os._Environ[str] | dict[str, str]") -> str | None:
    """The built-in strategy of the ``train`` run that ``argv`` asks for, when its workers will be forked by
    polytrain's forkserver on this machine; None when they will not or it cannot tell."""
    args = list(argv)
    if not args or args[0] != "train" or any(a in _NO_RUN for a in args):
        return None
    if any(key in environ for key in _LAUNCHED_ELSEWHERE):
        return None
    if environ.get("POLYTRAIN_START_METHOD", "forkserver") != "forkserver":
        return None
    given = _config_file(_flag(args, "--config"))
    if given is None:
        return None
    for key in ("strategy", "workers", "device"):
        flag = _flag(args, "--" + key)
        if flag is not None:
            given[key] = flag
    strategy = str(given.get("strategy", DEFAULT_STRATEGY))
    workers, device = str(given.get("workers", "")), str(given.get("device", "cpu"))
    if strategy not in BUILTIN_STRATEGIES or strategy == "single" or workers in ("0", "1"):
        return None
    if device != "cpu" and not (device.startswith("cpu:") and device[4:].isdigit() and int(device[4:]) > 1):
        return None  # (a GPU count, or one CPU worker: this process may run the one worker itself)
    return strategy


def _flag(args: list[str], name: str) -> str | None:
    """The last value given to ``name`` (``--name V`` or ``--name=V``); None when it is not given."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg[len(name) + 1:]
    return value


def _config_file(path: str | None) -> dict[str, object] | None:
    """``--config FILE.toml``'s top-level keys (none given: empty); None when it cannot be read here (the
    command says why later)."""
    if path is None:
        return {}
    try:
        import tomllib

        with open(os.path.expanduser(path), "rb") as fh:
            return {k.replace("-", "_"): v for k, v in tomllib.load(fh).items() if not isinstance(v, dict)}
    except (OSError, ValueError, ImportError):
        return None

