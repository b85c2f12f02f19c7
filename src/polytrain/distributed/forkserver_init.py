"""Imported once, by the multiprocessing forkserver that starts polytrain's workers (its first preload module).

Workers are forked from the forkserver and keep its signal dispositions until their own code sets theirs. Here
the stop signals (SIGTERM, SIGINT, SIGHUP, SIGUSR1) and the launcher's nudge (SIGUSR2) are ignored: a Ctrl-C
or a scheduler's SIGTERM sent to the whole process group then neither kills a worker in its first
milliseconds nor prints a KeyboardInterrupt traceback from its start-up; the launcher's request, in the
store, reaches that worker anyway.

The forkserver gets SIGKILL from the kernel the moment the launcher dies (however it dies), and its workers
theirs the moment it does (see ``_die_with_parent`` in :mod:`.worker`).
"""

import signal

from polytrain.distributed.lifetime import die_with_parent
from polytrain.distributed.stop import NUDGE, STOP_SIGNALS

for _sig in (*STOP_SIGNALS, NUDGE) if NUDGE is not None else STOP_SIGNALS:
    signal.signal(_sig, signal.SIG_IGN)
die_with_parent()
