"""``--snapshot-every K``: the state every K steps in this machine's memory, where a restart finds it.

A restart (``--max-restarts``) resumes from the latest checkpoint on disk, redoing every step since (15 s on
average with a checkpoint every 30 s). With ``--snapshot-every K`` the trainer ranks also write a *snapshot*
every K steps: a checkpoint (the same files, manifest and checks) in a directory of the machine's shared memory
(``/dev/shm``, a tmpfs), written in the background (:mod:`polytrain.train.background`: the step waits only for
the copy of the state) and kept one at a time. The launching process makes the directory for the run, hands it
to every attempt's workers (:data:`SNAPSHOT_ENV`) and removes it when the command ends; no worker's death takes
it. Before a restart, the launching process puts the newest snapshot that passes its checks into
``--checkpoint-dir`` as that directory's latest checkpoint, when it is newer than the latest there
(:func:`promote`): the restart then resumes from it as from any checkpoint, redoing at most about K steps (a
sharded run's snapshot is committed at the next one: about 2K).

What it does not cover: the machine itself (its memory goes with it: the checkpoints on disk are what a restart
elsewhere reads), and jobs that polytrain's own launcher does not start (under torchrun, srun or mpirun
``--snapshot-every`` is one line before start).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from polytrain.environ import environment
from polytrain.errors import ConfigError
from polytrain.train.checkpoint import Checkpointer
from polytrain.train.on_failure import continuing
from polytrain.train.recovery import memory_directory

#: where the workers of every attempt find the run's snapshot directory (set by the launching process)
SNAPSHOT_ENV = "POLYTRAIN_SNAPSHOT_DIR"


def check_snapshots(config: Any, elsewhere: bool) -> None:
    """One line for settings ``--snapshot-every`` cannot work with, before any process starts (``elsewhere``:
    the processes are torchrun's, srun's or mpirun's)."""
    every = config.restart.snapshot_every
    if not every:
        return
    if elsewhere:
        raise ConfigError(f"--snapshot-every {every} needs polytrain's own launcher (--workers N): the snapshot is "
                          "kept in the launching machine's memory; under torchrun, srun or mpirun use "
                          "--checkpoint-every")
    if not config.restart.max_restarts or continuing(config):
        raise ConfigError(f"--snapshot-every {every} needs --max-restarts R with --on-failure stop: a snapshot is "
                          "what a restart resumes from")


@contextlib.contextmanager
def snapshot_space(config: Any) -> Iterator[Path | None]:
    """The run's snapshot directory in shared memory for the workers of every attempt (None: no snapshots);
    removed when the block ends, however it ends."""
    if not config.restart.snapshot_every:
        yield None
        return
    directory = Path(tempfile.mkdtemp(prefix="polytrain-snapshot-", dir=memory_directory()))
    try:
        with environment({SNAPSHOT_ENV: str(directory)}):
            yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def snapshots_of(config: Any) -> Checkpointer | None:
    """Where this worker writes its snapshots (None: no snapshots)."""
    directory = os.environ.get(SNAPSHOT_ENV)
    if not config.restart.snapshot_every or not directory:
        return None
    return Checkpointer(directory, keep=1, on_error="warn")  # (a snapshot the memory refuses: the disk's is there)


def snapshot_due(config: Any, done: int, total: int) -> bool:
    """Whether to snapshot after step ``done``: every ``--snapshot-every`` steps, but not at the run's last."""
    every = config.restart.snapshot_every
    return bool(every) and done % every == 0 and done != total


def promote(snapshots: Path | None, directory: str | None, keep: int) -> int | None:
    """Put the newest good snapshot into ``directory`` as its latest checkpoint when it is newer than the latest
    there (the launching process, between attempts, with every worker stopped); the step put (None: none)."""
    if snapshots is None or not directory:
        return None
    good = Checkpointer(snapshots).choose().good
    if good is None:
        return None
    step = int(good.state["step"])
    target = Checkpointer(directory, keep=keep)
    if any(have >= step for have in target.steps()):
        return None
    target.take(Path(snapshots), step)
    return step
