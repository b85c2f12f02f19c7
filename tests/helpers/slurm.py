"""A one-node Slurm cluster of the test's own: munged, slurmctld and slurmd from the system's packages, on free
loopback ports, configured in a temporary directory (two CPUs, so two tasks), stopped with every process it
started. ``SlurmCluster.start`` raises :class:`Unavailable` with the reason when it cannot run here."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scontrol", "sinfo", "squeue", "scancel")


class Unavailable(Exception):
    """Slurm cannot run here; the message says why."""


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _which(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.access(p, os.X_OK)),
                                      None)


class SlurmCluster:
    def __init__(self, cpus: int = 2):
        self.cpus = cpus
        self.dir = Path(tempfile.mkdtemp(prefix="polytrain-slurm-"))
        os.chmod(self.dir, 0o755)  # munged wants its socket's directories reachable
        self.procs: dict[str, subprocess.Popen] = {}
        self.conf = self.dir / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    def start(self) -> "SlurmCluster":
        missing = [name for name in DAEMONS if _which(name) is None]
        if missing:
            raise Unavailable(f"Slurm is not installed here ({', '.join(missing)} missing): "
                              "apt-get install slurm-wlm munge (Debian), as .ci/run does")
        if os.geteuid() != 0:
            raise Unavailable("starting slurmd needs root here (it runs jobs as their users)")
        try:
            self._start()
        except Exception:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        munge = self.dir / "munge"
        munge.mkdir(mode=0o755)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.socket = munge / "socket"
        self._daemon("munged", [_which("munged"), "-F", "--force", "-S", str(self.socket), f"--key-file={key}",
                                f"--pid-file={munge / 'pid'}", f"--seed-file={munge / 'seed'}",
                                f"--log-file={self.dir / 'munged.log'}"])
        self._wait(lambda: self.socket.exists(), "munged did not create its socket", 10)
        for name in ("state", "spool", "log"):
            (self.dir / name).mkdir()
        ctld_port, slurmd_port = _free_ports(2)
        host = socket.gethostname().split(".")[0]  # slurmd finds its node by the short host name
        self.conf.write_text("\n".join([
            "ClusterName=polytrain-test", f"SlurmctldHost={host}(127.0.0.1)", "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", f"AuthInfo=socket={self.socket}", "CredType=cred/munge",
            f"SlurmctldPort={ctld_port}", f"SlurmdPort={slurmd_port}",
            f"StateSaveLocation={self.dir / 'state'}", f"SlurmdSpoolDir={self.dir / 'spool'}",
            f"SlurmctldPidFile={self.dir / 'slurmctld.pid'}", f"SlurmdPidFile={self.dir / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.dir / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={self.dir / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/pgid", "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU", "SchedulerType=sched/builtin", "MpiDefault=none", "ReturnToService=2",
            "SlurmdParameters=config_overrides", "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
            "SwitchType=switch/none", "KillWait=5", "MinJobAge=300", "InactiveLimit=0",
            f"NodeName={host} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
            f"PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP", ""]))
        self._daemon("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._daemon("slurmd", [_which("slurmd"), "-D", "-f", str(self.conf)])
        self._wait(lambda: "idle" in self.run("sinfo", "-h", "-o", "%t", check=False).stdout,
                   "the node did not come up idle", 30)

    def _daemon(self, name: str, argv: list) -> None:
        log = open(self.dir / f"{name}.out", "wb")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)
        log.close()

    def _wait(self, ready, what: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise Unavailable(f"{name} exited with {proc.returncode} at start: {self.log_tail(name)}")
            if ready():
                return
            time.sleep(0.1)
        raise Unavailable(f"{what} within {seconds:.0f} s: {self.log_tail()}")

    def log_tail(self, name: str | None = None) -> str:
        names = [name] if name else list(self.procs)
        out = []
        for each in names:
            path = self.dir / f"{each}.out"
            if path.exists():
                out += [f"{each}: {line}" for line in path.read_text(errors="replace").splitlines()[-3:]]
        return " | ".join(out)

    def run(self, *argv: str, check: bool = True, timeout: float = 60, env: dict | None = None,
            **kwargs) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(argv), env={**self.env, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout, **kwargs)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def job_field(self, job: str, field: str) -> str:
        shown = self.run("scontrol", "show", "job", "--oneliner", job).stdout
        return dict(item.split("=", 1) for item in shown.split() if "=" in item).get(field, "")

    def stop(self) -> None:
        """Cancel every job, then end the daemons this cluster started (and the job steps' stepds)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "--user", "root"], env=self.env, capture_output=True, timeout=20)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and self._jobs():
                time.sleep(0.2)
        deadline = time.monotonic() + 5
        while self._stepds() and time.monotonic() < deadline:  # a finished job's step daemons leave by themselves
            time.sleep(0.1)
        stepds = self._stepds()
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        for pid in stepds:  # a step daemon left behind by a job that did not end
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def _jobs(self) -> bool:
        proc = subprocess.run(["squeue", "-h"], env=self.env, capture_output=True, text=True, timeout=10)
        return bool(proc.stdout.strip()) and proc.returncode == 0

    def _stepds(self) -> list[int]:
        """This cluster's step daemons: slurmstepd processes started by our slurmd (they inherit its SLURM_CONF)."""
        mark = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if (Path(f"/proc/{entry}/cmdline").read_bytes().startswith(b"slurmstepd")
                        and mark in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")):
                    found.append(int(entry))
            except OSError:
                continue
        return found
