"""--tracker mlflow / wandb: a real run logged to a real local MLflow store (sqlite, read back through
MlflowClient) and to W&B's offline run file (read back with W&B's own record types); bad values are one line."""

import json
import sys
import time
from pathlib import Path

import pytest

import polytrain
from polytrain.config import make_config
from polytrain.errors import ConfigError

BASE = dict(strategy="single", data="digits", model="mlp:hidden=16", batch_size=32, steps=6, log_every=2,
            eval_every=3, progress="off")


def _records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_an_mlflow_run_holds_the_config_every_metric_step_the_summary_and_the_model(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    (tmp_path / "store").mkdir()  # a plain directory: the store is store/mlflow.db, the artifacts store/artifacts
    summary = polytrain.fit(tracker=["mlflow:store"], tracker_project="digits", tracker_run_name="first",
                            metrics_file=str(tmp_path / "m.jsonl"), save_model=str(tmp_path / "model.pt"), **BASE)

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("digits")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "first"
    records = _records(tmp_path / "m.jsonl")
    config = next(r["config"] for r in records if r["event"] == "start")
    assert run.data.params == {key: value if isinstance(value, str) else json.dumps(value)
                               for key, value in config.items()}
    assert run.data.params["steps"] == "6" and run.data.params["tracker_project"] == "digits"

    def history(key):
        return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}

    steps = {r["step"]: r for r in records if r["event"] == "step"}
    assert sorted(steps) == [2, 4, 6]
    assert history("train/loss") == pytest.approx({s: r["loss"] for s, r in steps.items()})
    assert history("train/lr") == pytest.approx({s: r["lr"] for s, r in steps.items()})
    assert history("perf/examples_per_sec") == pytest.approx({s: r["examples_per_sec"] for s, r in steps.items()})
    assert history("perf/rank0_examples_per_sec") == pytest.approx(
        {s: r["rank_examples_per_sec"][0] for s, r in steps.items()})
    evals = {r["step"]: r for r in records if r["event"] == "eval"}
    assert history("eval/loss") == pytest.approx({s: r["eval_loss"] for s, r in evals.items()}) and len(evals) == 2
    assert history("eval/accuracy") == pytest.approx({s: r["eval_accuracy"] for s, r in evals.items()})
    assert history("summary/train_loss") == pytest.approx({6: summary["train_loss"]})
    assert history("summary/eval_accuracy") == pytest.approx({6: summary["eval_accuracy"]})

    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.toml", "summary.json", "model"} <= names
    assert json.loads(Path(client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path / "d")))
                      .read_text())["steps"] == 6
    assert "steps = 6" in Path(client.download_artifacts(run.info.run_id, "config.toml", str(tmp_path / "d")))\
        .read_text()
    model = Path(client.download_artifacts(run.info.run_id, "model/model.pt", str(tmp_path / "d")))
    assert model.read_bytes() == (tmp_path / "model.pt").read_bytes()
    assert (tmp_path / "store" / "artifacts" / run.info.run_id / "artifacts" / "model" / "model.pt").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "m.jsonl", "model.pt", "store"]  # nothing else
    assert mlflow.__version__


def _wandb_records(path):
    """The records of a W&B run file: its 7-byte header, then a leveldb-style log of 32 KiB blocks whose
    records (4-byte checksum, 2-byte length, 1-byte type: 1 whole, 2/3/4 first/middle/last piece) hold
    W&B's own protobuf ``Record`` messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, pending, block = 7, b"", 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # too little room for a header: the rest of the block is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield pb.Record.FromString(pending)
            pending = b""


def _value(item):
    return json.loads(item.value_json) if item.value_json else item.number


def test_a_wandb_offline_run_file_holds_the_config_every_metric_step_the_summary_and_the_model(tmp_path,
                                                                                                monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline by default
    try:
        polytrain.fit(tracker=["wandb"], metrics_file=str(tmp_path / "m.jsonl"),
                      save_model=str(tmp_path / "model.pt"), **BASE)
    finally:
        wandb.teardown()  # a single-process run is this process: end the W&B service it started
    (path,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 300  # (a hang guard) W&B's service writes the file out after run.finish() returns
    records = list(_wandb_records(path))
    while not any(r.HasField("exit") for r in records):
        assert time.monotonic() < deadline, f"{path}: no exit record after 300 s"
        time.sleep(0.05)
        records = list(_wandb_records(path))
    config = {item.key: json.loads(item.value_json) for r in records if r.HasField("config")
              for item in r.config.update}
    start = next(r["config"] for r in _records(tmp_path / "m.jsonl") if r["event"] == "start")
    assert {key: config[key] for key in start} == start
    logged: dict[str, dict[int, float]] = {}
    for r in records:
        if r.HasField("history"):
            for item in r.history.item:
                key = item.key or "/".join(item.nested_key)
                logged.setdefault(key, {})[r.history.step.num] = _value(item)
    rows = _records(tmp_path / "m.jsonl")
    assert logged["train/loss"] == pytest.approx({r["step"]: r["loss"] for r in rows if r["event"] == "step"})
    assert logged["eval/loss"] == pytest.approx({r["step"]: r["eval_loss"] for r in rows if r["event"] == "eval"})
    end = next(r for r in rows if r["event"] == "end")
    summary = {item.key or "/".join(item.nested_key): _value(item) for r in records if r.HasField("summary")
               for item in r.summary.update}
    assert summary["eval_accuracy"] == pytest.approx(end["eval_accuracy"]) and summary["steps"] == 6
    artifacts = [r.artifact for r in records if r.HasField("artifact")]
    assert [(a.type, [c.path for c in a.manifest.contents]) for a in artifacts] == [("model", ["model.pt"])]


def test_bad_tracker_values_are_one_line_before_anything_starts(monkeypatch):
    cases = [(["neptune"], "--tracker: unknown tracker 'neptune' in 'neptune'; accepted: mlflow[:URI], wandb[:MODE]"),
             (["wandb:cloudy"], "--tracker: 'wandb:cloudy': unknown W&B mode 'cloudy'; accepted: offline, online, "
                                "disabled"),
             (["mlflow:"], "--tracker: 'mlflow:': nothing after the colon; give mlflow:URI or wandb:MODE"),
             (["wandb", "wandb:offline"], "--tracker: wandb is given twice; give each tracker once"),
             (["mlflow:/nonexistent/dir"], "--tracker: 'mlflow:/nonexistent/dir': the directory /nonexistent/dir does "
                                           "not exist; create it (mkdir -p /nonexistent/dir) or give an MLflow URI"),
             (["mlflow:file:///nonexistent/dir"], "--tracker: 'mlflow:file:///nonexistent/dir': the directory "
                                                  "/nonexistent/dir does not exist")]
    for value, text in cases:
        with pytest.raises(ConfigError) as info:
            make_config(tracker=value)
        assert str(info.value).startswith(text) and "\n" not in str(info.value)
    monkeypatch.setitem(sys.modules, "mlflow", None)  # Python's own way of making an import fail
    with pytest.raises(ConfigError, match=r"^--tracker: mlflow needs its client library, which is not installed: "
                                          r"pip install 'polytrain\[mlflow\]'$"):
        make_config(tracker=["mlflow:sqlite:///x.db"])


def test_a_tracker_that_cannot_open_its_run_stops_before_training_with_one_line(tmp_path):
    pytest.importorskip("mlflow")
    with pytest.raises(ConfigError, match=r"^--tracker mlflow:nosuch://x: could not open a run: .*unsupported URI") \
            as info:
        polytrain.fit(tracker=["mlflow:nosuch://x"], metrics_file=str(tmp_path / "m.jsonl"), **BASE)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "m.jsonl").exists()  # nothing trained, nothing logged


def test_a_rank_that_takes_reporting_over_continues_the_mlflow_run(tmp_path):
    """--on-failure continue with the reporting rank lost: the rank that takes reporting over continues its MLflow
    run by the id the lost one handed over (train/elastic.py keeps it in the store), and ends it FINISHED."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from polytrain.train.loggers import RunLog

    config = make_config(tracker=[f"mlflow:{tmp_path}"], progress="off", steps=4)

    def step(n, loss):
        return {"step": n, "loss": loss, "lr": 0.1, "examples_per_sec": 10.0, "sec_per_batch": 0.1}

    lost = RunLog(config.log, 4, enabled=True, tracking=config.tracking)  # the reporting rank, then lost
    lost.start(config.flat(), "", 0)
    lost.step(step(2, 1.0))
    taking_over = RunLog(config.log, 4, enabled=False, tracking=config.tracking)
    taking_over.take_over(config.tracking, lost.run_ids())
    taking_over.step(step(4, 0.5))
    taking_over.end({"steps": 4, "train_loss": 0.5})
    taking_over.close()

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("polytrain").experiment_id])
    assert run.info.status == "FINISHED"
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")} == {2: 1.0, 4: 0.5}
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "summary/steps")} == {4: 4}
