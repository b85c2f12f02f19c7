"""The Kubernetes manifests of docs/clusters: what each relies on, reproduced here (no cluster): the environment
Kubeflow's training operator gives a PyTorchJob's pods, and an Indexed Job's completion index with a headless
Service's pod names under torchrun. Each "pod" is a process on loopback started with the manifest's own command
line (the device, the checkpoint directory and the run's length replaced), and the job trains the model that
polytrain's own launcher trains, bit for bit."""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path

import pytest

from tests.helpers.cluster_runs import RUN, assert_same_model

yaml = pytest.importorskip("yaml")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "clusters"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in a container's command and args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def _pods(commands: list[tuple[list[str], dict[str, str]]], cwd: Path, timeout: float = 180) -> list[tuple[int, str]]:
    procs = [subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for argv, env in commands]
    outs = []
    try:
        for proc in procs:
            outs.append((proc.wait(timeout), proc.stdout.read()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
    return outs


def _container(spec: dict) -> dict:
    return spec["template"]["spec"]["containers"][0]


def test_a_pytorchjob_pod_joins_with_the_operators_environment(launcher_cli_env, cluster_reference, tmp_path):
    job = yaml.safe_load((DOCS / "k8s-pytorchjob.yaml").read_text())
    replicas = job["spec"]["pytorchReplicaSpecs"]
    master, worker = _container(replicas["Master"]), _container(replicas["Worker"])
    # the operator sets its variables in the container named "pytorch", MASTER_PORT from the port it names
    assert master["name"] == worker["name"] == "pytorch"
    assert master["command"] + master["args"] == worker["command"] + worker["args"]
    assert any(p["name"] == "pytorchjob-port" for p in master["ports"])  # its number is MASTER_PORT (a free one here)
    assert "--resume" in master["args"]  # a restarted pod continues from the latest checkpoint
    # what training-operator's setPodEnv gives each pod: the master's service name, the port, all replicas, RANK
    # (master 0, worker i: i + 1); no LOCAL_RANK. Here 1 master and 1 worker, the service name on loopback, and
    # one CPU thread per pod, as the local launcher gives each of its 2 workers one of this machine's 2 cores.
    operator = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2",
                "PYTHONUNBUFFERED": "0", "OMP_NUM_THREADS": "1"}
    argv = master["command"] + master["args"] + ["--device", "cpu", "--checkpoint-dir", str(tmp_path / "ck"), *RUN,
                                                 "--save-model", str(tmp_path / "m.pt")]
    outs = _pods([(argv, dict(launcher_cli_env, **operator, RANK=str(rank))) for rank in (0, 1)], tmp_path)
    assert [code for code, _ in outs] == [0, 0], outs
    assert "strategy sync: 2 processes" in outs[0][1] and "done: 16 steps" in outs[0][1]
    assert "no checkpoint in" in outs[0][1]  # --resume on a first start: from step 0
    assert_same_model(tmp_path / "m.pt", cluster_reference)


def test_an_indexed_job_runs_torchrun_at_its_completion_index(launcher_cli_env, cluster_reference, tmp_path):
    service, job = yaml.safe_load_all((DOCS / "k8s-indexed-job.yaml").read_text())
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = container["args"]
    # the contract: one pod per index, all at once; pod 0 is <job>-0.<subdomain>, which the headless Service
    # (selecting the Job's pods by the job-name label Kubernetes gives them) makes resolvable
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert pod["subdomain"] == service["metadata"]["name"]
    assert f"--master-addr={job['metadata']['name']}-0.{service['metadata']['name']}" in args
    assert f"--nnodes={spec['completions']}" in args and "--node-rank=$(JOB_COMPLETION_INDEX)" in args
    assert "--resume" in args
    # here: each pod one worker with one CPU thread, the pod-0 name on loopback, a free port
    port = _free_port()
    local = {"--nproc-per-node": "1", "--master-addr": "127.0.0.1", "--master-port": str(port)}
    argv = [str(Path(launcher_cli_env["PATH"].split(":")[0]) / container["command"][0])]
    for arg in args:
        key = arg.split("=", 1)[0]
        argv.append(f"{key}={local[key]}" if key in local else arg)
    argv += ["--device", "cpu", "--checkpoint-dir", str(tmp_path / "ck"), *RUN, "--save-model", str(tmp_path / "m.pt")]
    commands = []
    for index in range(spec["completions"]):
        env = dict(launcher_cli_env, JOB_COMPLETION_INDEX=str(index), OMP_NUM_THREADS="1")  # (as above)
        commands.append(([_expand(arg, env) for arg in argv], env))
    outs = _pods(commands, tmp_path)
    # JOB_COMPLETION_INDEX became each torchrun's node rank: one job of 2 ranks, the pod of index 0 its rank 0
    assert [code for code, _ in outs] == [0, 0], outs
    assert "strategy sync: 2 processes" in outs[0][1] and "done: 16 steps" in outs[0][1], outs
    assert_same_model(tmp_path / "m.pt", cluster_reference)
