"""--max-restarts: a worker SIGKILLed at a random step, the job restarted from its latest checkpoint, and the
final model bit for bit the uninterrupted run's (CPU, same world size); --checkpoint-every-seconds; the
settings a restart cannot work with."""

import glob
import json
import os

import pytest
import torch

import polytrain
from polytrain.errors import ConfigError, WorkerError
from polytrain.train.faults import KILL_ENV
from tests.helpers.seed import draw

STEPS = 20
BASE = dict(data="digits", model="mlp:hidden=16x16", batch_size=32, steps=STEPS, progress="off", log_every=2,
            eval_every=0, checkpoint_every=4, lr=0.05)
STRATEGIES = {
    "sync": dict(strategy="sync", workers=2),
    # staleness 0: the server applies each step's slices in slice order, whichever worker computed them and
    # whenever they came, so two runs are the same bit for bit (rank 2 is the server)
    "async": dict(strategy="async", workers=2, servers=1, staleness=0),
    # checkpoints at meetings (every 4 steps, H = 2); plain SGD: a checkpoint keeps rank 0's inner optimizer
    # state only, so inner momentum would differ after a resume
    "local-sgd": dict(strategy="local-sgd", workers=2, sync_every=2, momentum=0.0),
    "pipeline": dict(strategy="pipeline", stages=2, microbatches=2),
}


def _fit(tmp_path, name, settings, **more):
    model = tmp_path / f"{name}.pt"
    summary = polytrain.fit(checkpoint_dir=str(tmp_path / f"{name}-ckpt"), save_model=str(model),
                            metrics_file=str(tmp_path / f"{name}.jsonl"), **{**BASE, **settings, **more})
    return summary, torch.load(model, weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Each strategy's uninterrupted run, made once for the module (a kill test compares with it): a function of
    the strategy's name giving the run's directory and model. Sync's checkpoints by elapsed time (every log
    point), asserted in test_checkpoints_by_elapsed_time_land_on_log_points_on_every_rank; a checkpoint changes
    nothing in the training, so that run is the reference of the sync kill tests too."""
    made = {}

    def run(name):
        if name not in made:
            out = tmp_path_factory.mktemp(f"whole-{name}")
            more = dict(checkpoint_every=0, checkpoint_every_seconds=0.001, keep_checkpoints=100) \
                if name == "sync" else {}
            made[name] = out, _fit(out, "whole", STRATEGIES[name], **more)[1]
        return made[name]

    return run


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_killed_worker_is_restarted_and_the_model_ends_bit_for_bit_as_uninterrupted(tmp_path, monkeypatch, name,
                                                                                      uninterrupted):
    settings = STRATEGIES[name]
    step = draw(f"restart[{name}]", 3, STEPS - 2)  # any step: before the first checkpoint too
    rank = 1  # a trainer rank
    _, whole = uninterrupted(name)
    monkeypatch.setenv(KILL_ENV, f"rank={rank},steps={step}")
    summary, restarted = _fit(tmp_path, "restarted", settings, max_restarts=1)
    assert summary["steps"] == STEPS and summary["restarts"] == 1, f"killed after step {step}"
    assert summary["total_wall_s"] > summary["wall_s"]
    (cause,) = summary["restart_causes"]
    assert cause["rank"] == rank and f"rank {rank} was killed by signal SIGKILL" in cause["cause"]
    resumed = (step - 1) // 4 * 4  # the kill comes before step's own checkpoint; none before step 4: from 0
    assert cause["resume_from"] == (f"step-{resumed:08d}.pt" if resumed else None)
    assert whole.keys() == restarted.keys()
    assert all(torch.equal(whole[k], restarted[k]) for k in whole), f"{name}: killed after step {step}"
    with open(tmp_path / "restarted.jsonl") as fh:
        records = [json.loads(line) for line in fh]
    assert [r["event"] for r in records].count("restart") == 1


def test_a_restart_resumes_from_the_snapshot_in_memory_and_the_model_ends_bit_for_bit(tmp_path, monkeypatch,
                                                                                     uninterrupted):
    """--snapshot-every 2 without periodic checkpoints on disk: the restart resumes from the newest snapshot (the
    one being written when the worker died may not be whole: then the one before), and nothing is left in memory.
    What the restart cost is in the summary and the metrics file: the step reached, the step resumed, and the
    seconds from the death to the next completed step and back to the step reached."""
    settings = dict(STRATEGIES["sync"], checkpoint_every=0)
    step = draw("snapshot", 5, STEPS - 2)
    _, whole = uninterrupted("sync")
    before = set(glob.glob("/dev/shm/polytrain-snapshot-*") + glob.glob("/dev/shm/polytrain-progress-*"))
    monkeypatch.setenv(KILL_ENV, f"rank=1,steps={step}")
    summary, restarted = _fit(tmp_path, "restarted", settings, max_restarts=1, snapshot_every=2)
    assert summary["steps"] == STEPS and summary["restarts"] == 1, f"killed after step {step}"
    last = (step - 1) // 2 * 2  # the newest snapshot before the kill (which comes before step's own)
    (cause,) = summary["restart_causes"]
    assert cause["resume_from"] in (f"step-{last:08d}.pt", f"step-{last - 2:08d}.pt"), (step, cause)
    resumed = int(cause["resume_from"][5:13])
    assert (cause["reached_step"], cause["resumed_step"], cause["redone_steps"]) == (step, resumed, step - resumed)
    assert 0 < cause["first_step_s"] <= cause["back_s"] and cause["redo_s"] >= 0, cause
    assert summary["restart_cost_s"]["back_s"]["median"] == cause["back_s"]
    with open(tmp_path / "restarted.jsonl") as fh:
        (recovery,) = [r for r in map(json.loads, fh) if r["event"] == "recovery"]
    assert recovery == {"event": "recovery", **{k: cause[k] for k in recovery if k != "event"}}
    assert summary["snapshot_stall_s"]["checkpoints"] >= 1
    assert all(torch.equal(whole[k], restarted[k]) for k in whole), f"killed after step {step}"
    assert set(glob.glob("/dev/shm/polytrain-snapshot-*") + glob.glob("/dev/shm/polytrain-progress-*")) <= before


def _no_workers_left(ctx):
    os._exit(9)  # every attempt dies: the restarts run out


def test_restarts_run_out_and_the_last_failure_is_raised(tmp_path, monkeypatch):
    monkeypatch.setenv(KILL_ENV, "rank=0,steps=3+3")
    with pytest.raises(WorkerError, match=r"worker rank 0 was killed by signal SIGKILL"):
        polytrain.fit(checkpoint_dir=str(tmp_path / "c"), max_restarts=1, **BASE, **STRATEGIES["sync"])


def test_checkpoints_by_elapsed_time_land_on_log_points_on_every_rank(uninterrupted):
    out, _ = uninterrupted("sync")  # --checkpoint-every-seconds 0.001, --keep-checkpoints 100
    saved = sorted(p.name for p in (out / "whole-ckpt").glob("step-*.pt"))
    assert saved == [f"step-{s:08d}.pt" for s in range(2, STEPS + 1, 2)]  # every log point, and the end


@pytest.mark.parametrize("settings, message", [
    (dict(max_restarts=2), r"--max-restarts 2 needs --checkpoint-dir DIR"),
    (dict(checkpoint_every_seconds=60), r"--checkpoint-every-seconds needs --checkpoint-dir DIR"),
    (dict(checkpoint_background=True), r"--checkpoint-background needs --checkpoint-dir DIR"),
    (dict(snapshot_every=2), r"--snapshot-every 2 needs --max-restarts R with --on-failure stop"),
    (dict(max_restarts=1, checkpoint_dir="CKPT", strategy="single"),
     r"--max-restarts: --strategy single with 1 process runs inside this one, which cannot restart itself"),
])
def test_settings_a_restart_cannot_work_with_are_one_line(tmp_path, settings, message):
    if settings.get("checkpoint_dir") == "CKPT":
        settings = dict(settings, checkpoint_dir=str(tmp_path / "c"))
    with pytest.raises(ConfigError, match=message):
        polytrain.fit(**dict(BASE, checkpoint_every=0, **settings))


def test_the_command_line_summary_lists_the_restarts_and_their_causes():
    from polytrain.cli.train import format_summary

    summary = dict(steps=20, wall_s=3.0, strategy="sync", workers=2, examples_per_sec=100.0, train_loss=0.5,
                   restarts=1, restart_causes=[dict(cause="worker rank 1 was killed by signal SIGKILL", after_s=1.4)],
                   total_wall_s=4.26)
    assert format_summary(summary).splitlines()[-1] == \
        "  restarts: 1 (worker rank 1 was killed by signal SIGKILL (after 1 s)); 4.3 s in all"
    cost = dict(reached_step=9, resumed_step=8, redone_steps=1, first_step_s=1.23, back_s=1.5)
    summary["restart_causes"] = [dict(summary["restart_causes"][0], **cost)]
    assert format_summary(summary).splitlines()[-1] == \
        "  restarts: 1 (worker rank 1 was killed by signal SIGKILL (after 1 s; next step after 1.2 s, back at step 9 " \
        "after 1.5 s, 1 steps redone)); 4.3 s in all"
    assert "restarts" not in format_summary(dict(summary, restarts=0))


@pytest.mark.slow  # ~20 s: two torchrun attempts of fresh processes
def test_under_torchrun_its_restart_resumes_from_the_checkpoint(tmp_path, cli_env, uninterrupted):
    """torchrun --max-restarts 1: rank 1 killed after step 7; torchrun's restart resumes step 4's checkpoint by
    itself and the saved model equals the uninterrupted polytrain run's (the module's sync reference: BASE's
    settings on 2 workers)."""
    import subprocess
    import sys

    args = ["--strategy", "sync", "--steps", str(STEPS), "--checkpoint-every", "4", "--data", BASE["data"],
            "--model", BASE["model"], "--batch-size", str(BASE["batch_size"]), "--progress", "off", "--eval-every",
            "0", "--log-every", str(BASE["log_every"]), "--lr", str(BASE["lr"])]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "--max-restarts", "1", "-m", "polytrain", "train", *args]
    env = dict(cli_env, **{KILL_ENV: "rank=1,steps=7"})
    run = subprocess.run(torchrun + ["--checkpoint-dir", str(tmp_path / "c"), "--save-model", str(tmp_path / "t.pt")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "torchrun restart 1: resuming from the latest checkpoint" in run.stderr
    assert "resumed from step 4" in run.stdout + run.stderr and "restarts: 1" in run.stdout
    _, whole = uninterrupted("sync")
    restarted = torch.load(tmp_path / "t.pt", weights_only=True)
    assert whole.keys() == restarted.keys()
    assert all(torch.equal(whole[k], restarted[k]) for k in whole)


def test_under_torchrun_more_restarts_than_torchrun_has_is_one_line(tmp_path, monkeypatch):
    from polytrain.config import make_config
    from polytrain.train.restart import check_restarts

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")  # what torchrun sets in its workers
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    config = make_config(**BASE, max_restarts=3, checkpoint_dir=str(tmp_path / "c"))
    with pytest.raises(ConfigError, match=r"^--max-restarts 3: under torchrun the restarts are torchrun's; give "
                                          r"torchrun --max-restarts 3 \(it has 1\)$"):
        check_restarts(config)
    config = make_config(**BASE, max_restarts=1, snapshot_every=5, checkpoint_dir=str(tmp_path / "c"))
    with pytest.raises(ConfigError, match=r"^--snapshot-every 5 needs polytrain's own launcher \(--workers N\): "):
        check_restarts(config)


@pytest.mark.parametrize("spec", ["rank=1", "rank=one,steps=3", "rank=1,steps=3,signal=SIGNOPE"])
def test_a_malformed_kill_hook_is_one_line(monkeypatch, spec):
    from polytrain.train.faults import InjectedKill

    monkeypatch.setenv(KILL_ENV, spec)
    with pytest.raises(ConfigError, match=rf"^{KILL_ENV}='{spec}': expected rank=R,steps=A\+B\+...\[,signal=SIGSTOP\] "
                                          r"\(.+\)$"):
        InjectedKill.from_env(0)


def test_the_kill_hook_fires_at_its_step_or_once_at_the_first_slice_past_it(monkeypatch, tmp_path):
    """A trainer rank steps 1, 2, 3...; an async helper computes slices of whatever steps it is handed, so its
    kill fires at the first slice of the named step or a later one (SIGCONT: harmless to send to oneself)."""
    from polytrain.train.faults import KILL_LOG_ENV, InjectedKill

    log = tmp_path / "kills"
    monkeypatch.setenv(KILL_LOG_ENV, str(log))
    monkeypatch.setenv(KILL_ENV, "rank=1,steps=6,signal=SIGCONT")
    fired = lambda: [int(line.split()[1]) for line in log.read_text().splitlines()] if log.exists() else []

    stepping = InjectedKill.from_env(1)
    for step in (5, 7, 6, 8):
        stepping.after_step(step)
    assert fired() == [6]
    log.unlink()
    slicing = InjectedKill.from_env(1)
    for step in (2, 5, 9, 6, 11):
        slicing.after_slice(step)
    assert fired() == [9]
    assert InjectedKill.from_env(0).step is None  # another rank's hook
