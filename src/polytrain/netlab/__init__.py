"""An emulated network on one machine: each worker (or parameter server) in a network namespace of its own,
all joined to one bridge by links limited to a set rate, so that strategies pay for the network as they would
between machines. Needs Linux, root and iproute2 (``ip``, ``tc``); :func:`unavailable` says why not in one line.

    from polytrain.netlab import NetLab, run_job
    with NetLab(2, "100mbit") as lab:                     # 2 namespaces + a bridge; links 100 Mbit/s each way
        result = run_job(lab, ["train", "--strategy", "sync", "--comm", "backend", ...], logs, run_id="x")
        result.codes, result.tx_bytes, result.wall_s      # exit codes, bytes each node sent over its link

- :mod:`.lab`: :class:`NetLab` (namespaces, veth pairs, the bridge, ``tc tbf`` on both ends of each link,
  clean-up on every path), :func:`parse_rate`, :func:`unavailable`, :func:`sweep`.
- :mod:`.job`: :func:`run_job`, one ``torchrun`` per node (static rendezvous at node 0, gloo on the link).
- :mod:`.reaper`: the watchdog that removes a lab whose maker was killed.
"""

from polytrain.netlab.job import JobResult, run_job, torchrun_argv
from polytrain.netlab.lab import (NAME_ROOT, NetLab, Node, check_available, format_rate, lab_namespaces,
                                  network_lab, parse_rate, sweep, unavailable)

__all__ = ["NAME_ROOT", "JobResult", "NetLab", "Node", "check_available", "format_rate", "lab_namespaces",
           "network_lab", "parse_rate", "run_job", "sweep", "torchrun_argv", "unavailable"]
