"""The one reader of multiprocessing's helper bookkeeping finds this process's own forkserver and resource
tracker, and leaves a forkserver this process started alone when asked to release an inherited one."""

import os


def _nothing() -> None:
    pass


def test_the_forkserver_and_tracker_this_process_started_are_found_and_kept():
    from polytrain.distributed.mp_helpers import (forkserver_pid, helper_processes, helper_table,
                                                  release_inherited_forkserver, tracker_pid)
    from polytrain.distributed.processes import start_context

    proc = start_context().Process(target=_nothing)
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    server, tracker = forkserver_pid(), tracker_pid()
    assert server is not None and tracker is not None and server != tracker
    assert helper_processes() == {server, tracker}
    for pid in (server, tracker):
        os.kill(pid, 0)  # alive, and ours
    alive_fd = getattr(helper_table()[0][0], "_forkserver_alive_fd")
    release_inherited_forkserver()  # our own server: nothing to release
    assert getattr(helper_table()[0][0], "_forkserver_alive_fd") == alive_fd and forkserver_pid() == server
