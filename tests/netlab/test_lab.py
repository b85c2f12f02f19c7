"""The emulated network (polytrain.netlab): real namespaces, real rate limits, real torchrun jobs over them.

Each test makes its own lab (namespace names carry this process's id and a random tag, so tests running at
the same time elsewhere never meet) and checks that, whatever happened, none of its namespaces and no link
of it is left. Skipped with the lab's own one-line reason where namespaces cannot be made (not root, no
iproute2, a container without them).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from polytrain.errors import ConfigError
from polytrain.netlab import NetLab, lab_namespaces, parse_rate, run_job, unavailable
from tests.helpers.procs import alive, cmdline
from tests.helpers.signals import as_from_a_shell, signal_state

pytestmark = pytest.mark.serial  # rates and network namespaces: alone under pytest -n (make test)

REASON = unavailable()
needs_lab = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def leftovers(prefix: str) -> list[str]:
    """Namespaces of ``prefix`` and host links that point into them (``ip -o link``: ``link-netns NAME``)."""
    names = [ns for ns in lab_namespaces() if ns.startswith(prefix)]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=30).stdout
    return names + [line for line in links.splitlines() if prefix in line]


def test_rates_parse_as_tc_writes_them():
    assert parse_rate("100mbit") == 100_000_000
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("12.5mbps") == 100_000_000
    for bad in ("fast", "100", "100mb/s", "", "1bit"):
        with pytest.raises(ConfigError, match="--link"):
            parse_rate(bad)


RECEIVER = textwrap.dedent("""
    import socket, sys, time
    srv = socket.socket(); srv.bind((sys.argv[1], 5001)); srv.listen(1); print("ready", flush=True)
    conn, _ = srv.accept(); got = 0; first = None
    while True:
        chunk = conn.recv(1 << 16)
        if not chunk: break
        first = first or time.monotonic(); got += len(chunk)
    print(got, time.monotonic() - first, flush=True)
""")
SENDER = textwrap.dedent("""
    import socket, sys
    s = socket.create_connection((sys.argv[1], 5001), timeout=30)
    s.sendall(b"x" * int(sys.argv[2])); s.close()
""")


@needs_lab
@pytest.mark.parametrize("rate", ["40mbit"])
def test_a_transfer_between_two_nodes_runs_at_the_set_rate(rate):
    bits = parse_rate(rate)
    size = bits // 8 * 1  # about one second at the rate
    with NetLab(2, rate) as lab:
        receiver = lab.popen(1, [sys.executable, "-c", RECEIVER, lab.nodes[1].address], stdout=subprocess.PIPE,
                             text=True)
        assert receiver.stdout.readline().strip() == "ready"
        sender = lab.popen(0, [sys.executable, "-c", SENDER, lab.nodes[1].address, str(size)])
        assert sender.wait(timeout=60) == 0
        got, seconds = receiver.communicate(timeout=60)[0].split()
        assert int(got) == size
        measured = size * 8 / float(seconds)
        assert abs(measured / bits - 1) <= 0.15, f"{measured / 1e6:.1f} Mbit/s through a {rate} link"
        assert lab.tx_bytes(0) >= size  # the counters compare and advise read
    assert leftovers(lab.prefix) == []


TRAIN = ["train", "--strategy", "sync", "--comm", "backend", "--model", "mlp", "--data", "digits",
         "--progress", "lines", "--log-every", "5", "--timeout", "60", "--seed", "1"]


def _workers(namespace: str) -> list[int]:
    from polytrain.netlab.lab import pids_in
    return [p for p in alive(pids_in(namespace)) if "torch.distributed.run" not in cmdline(p)
            and "polytrain" in cmdline(p)]


@needs_lab
def test_a_job_whose_worker_is_killed_ends_and_leaves_nothing(tmp_path):
    """A normal end over the links: tests/compare/test_link.py."""
    with NetLab(2, "1gbit") as lab:
        killed_at = []

        def kill_rank1_when_training() -> None:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                if (tmp_path / "kill" / "node0.log").exists() and \
                        "step 5/" in (tmp_path / "kill" / "node0.log").read_text(errors="replace"):
                    for pid in _workers(lab.nodes[1].namespace):
                        os.kill(pid, signal.SIGKILL)
                    killed_at.append(time.monotonic())
                    return
                time.sleep(0.1)

        killer = threading.Thread(target=kill_rank1_when_training, daemon=True)
        killer.start()
        # timeout_s is a hang guard only: the job ends once its worker is killed, at any load
        killed = run_job(lab, TRAIN + ["--steps", "100000"], tmp_path / "kill", run_id="kill", grace_s=20,
                         timeout_s=300)
        killer.join(timeout=5)
        assert killed_at, "node 1's workers were never killed: node 0 did not reach step 5"
        assert killed.codes[1] not in (0, None), killed.log(1)
        for node in lab.nodes:  # nothing of the job runs once run_job returned
            assert _workers(node.namespace) == []
    assert leftovers(lab.prefix) == []


LAUNCHER = textwrap.dedent("""
    import subprocess, sys, time
    from polytrain.netlab import NetLab
    with NetLab(2, "100mbit") as lab:
        for i in range(2):
            lab.popen(i, ["sleep", "600"])
        print(lab.prefix, flush=True)
        time.sleep(600)
""")


@needs_lab
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "sigkill"])
def test_the_lab_is_gone_after_its_launcher_is_interrupted_or_killed(how, cli_env):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True, env=cli_env,
                                preexec_fn=as_from_a_shell)
    prefix = launcher.stdout.readline().strip()
    try:
        assert prefix.startswith("ptlab-") and len(leftovers(prefix)) == 3
        state = f"the launcher: {signal_state(launcher.pid)}; this process: {signal_state(os.getpid())}"  # (in the message: once in the suite Ctrl-C did not end it)
        launcher.send_signal(how)
        try:
            launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher did not end within 60 s of {how.name}; its signals then: {state}")
        deadline = time.monotonic() + 30  # SIGKILL: the watchdog removes it once it sees its launcher gone
        while leftovers(prefix) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert leftovers(prefix) == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        launcher.stdout.close()
