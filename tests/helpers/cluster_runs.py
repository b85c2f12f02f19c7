"""The run that every launcher of tests/distributed/test_cluster_launch.py and test_kubernetes.py makes, and the
model polytrain's own launcher trains with it (the reference each launch must equal, bit for bit)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

BIN = Path(sys.executable).parent
# 2 workers of sync; checkpoints every 5 steps (what a requeued job resumes from)
RUN = ["--strategy", "sync", "--steps", "16", "--checkpoint-every", "5", "--heartbeat-timeout", "2",
       "--progress", "lines", "--log-every", "4", "--seed", "3", "--timeout", "60"]


def launcher_env(cli_env: dict[str, str]) -> dict[str, str]:
    """``cli_env`` with this venv's commands first on PATH and no scheduler's variables of the caller's own."""
    env = dict(cli_env, PATH=f"{BIN}{os.pathsep}{cli_env.get('PATH', '')}")
    for key in [k for k in env if k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_"))]:
        env.pop(key, None)
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                "JOB_COMPLETION_INDEX", "POLYTRAIN_CLUSTER"):
        env.pop(key, None)
    return env


def local_reference(env: dict[str, str], work: Path) -> dict[str, torch.Tensor]:
    proc = subprocess.run([str(BIN / "polytrain"), "train", *RUN, "--workers", "2", "--checkpoint-dir",
                           str(work / "ck"), "--save-model", str(work / "m.pt")], env=env, cwd=work,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    return torch.load(work / "m.pt", map_location="cpu", weights_only=True)


def assert_same_model(path: Path, reference: dict[str, torch.Tensor]) -> None:
    model = torch.load(path, map_location="cpu", weights_only=True)
    assert model.keys() == reference.keys()
    different = [name for name in reference if not torch.equal(model[name], reference[name])]
    assert not different, f"parameters that differ from the local launcher's run: {different}"
