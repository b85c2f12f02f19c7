"""The watchdog of one network lab: ``python -m polytrain.netlab.reaper PREFIX``.

Started by :class:`~polytrain.netlab.lab.NetLab` in a session of its own, with a pipe from the lab's maker
on its stdin. When the pipe closes — the maker ended the lab, or died in any way, SIGKILL included — it
kills whatever still runs in the namespaces named ``PREFIX-*`` and deletes them, then exits.
"""

from __future__ import annotations

import signal
import sys


def main(prefix: str) -> int:
    from polytrain.netlab.lab import lab_namespaces, remove

    for name in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(name, signal.SIG_IGN)  # only the pipe's end ends it
    sys.stdin.buffer.read()  # blocks until the maker closes its end or dies
    remove([ns for ns in lab_namespaces() if ns.startswith(prefix + "-")])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
