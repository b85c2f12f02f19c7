"""Experiment trackers beside TensorBoard: ``--tracker mlflow[:URI]`` and ``--tracker wandb[:MODE]``.

Each goes through the library's own client (optional extras: ``pip install 'polytrain[mlflow]'``,
``'polytrain[wandb]'``) and gets what the metrics file gets (:mod:`polytrain.train.loggers`): the resolved
config as the run's parameters (MLflow params, W&B config), every logged step's and evaluation's numbers at
their step under TensorBoard's names (``train/loss``, ``perf/examples_per_sec``, ``eval/loss``, ...), the end
summary (its numbers as ``summary/KEY`` at the last step and, in MLflow, ``summary.json``), and the
``--save-model`` file as an artifact. Only the main trainer rank opens a run (``--on-failure continue``: when it
is lost, the rank that takes reporting over continues an MLflow run, :func:`reopen_trackers`).

* ``mlflow``: the URI after the colon (a plain directory ``DIR``: ``sqlite:///DIR/mlflow.db``, artifacts in
  ``DIR/artifacts``), else ``MLFLOW_TRACKING_URI``, else MLflow's default (``sqlite:///mlflow.db`` in the working
  directory); the experiment is ``--tracker-project`` (made if missing). The run ends FINISHED,
  KILLED (a stop signal) or FAILED (an error).
* ``wandb``: ``offline`` unless the mode after the colon or ``WANDB_MODE`` says otherwise (``online`` needs
  ``wandb login``); files under ``WANDB_DIR`` (default: the working directory's ``wandb/``); ``wandb sync DIR``
  uploads an offline run later.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polytrain.errors import ConfigError
from polytrain.options import option, register_section

KINDS = ("mlflow", "wandb")
WANDB_MODES = ("offline", "online", "disabled")
_MODULES = {"mlflow": "mlflow", "wandb": "wandb"}
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")  # an MLflow URI (sqlite:, http:, file:, databricks...)


def parse_tracker(spec: str) -> tuple[str, str | None]:
    """``(kind, argument)`` of one ``--tracker`` value; ValueError with the reason otherwise."""
    kind, colon, arg = spec.strip().partition(":")
    if kind not in KINDS:
        raise ValueError(f"unknown tracker '{kind}' in '{spec}'; accepted: mlflow[:URI], wandb[:MODE] "
                         "(TensorBoard: --log-dir)")
    if colon and not arg:
        raise ValueError(f"'{spec}': nothing after the colon; give mlflow:URI or wandb:MODE, or drop the colon")
    if kind == "wandb" and arg is not None and colon and arg not in WANDB_MODES:
        raise ValueError(f"'{spec}': unknown W&B mode '{arg}'; accepted: {', '.join(WANDB_MODES)}")
    return kind, (arg if colon else None)


def mlflow_store(arg: str | None) -> tuple[str | None, str | None]:
    """``(tracking URI, artifact location)`` of ``--tracker mlflow[:ARG]``: a URI as given (None: MLflow's
    own default); a plain directory path is a sqlite store ``DIR/mlflow.db`` with the artifacts in
    ``DIR/artifacts`` (MLflow no longer writes its old file store)."""
    if arg is None or _SCHEME.match(arg):
        return arg, None
    directory = Path(arg).expanduser().resolve()
    return f"sqlite:///{directory / 'mlflow.db'}", (directory / "artifacts").as_uri()


def _missing_directory(spec: str, arg: str | None) -> str | None:
    """The line for ``mlflow:DIR`` (or ``mlflow:file:DIR``) whose directory does not exist; None otherwise."""
    if arg is None or (_SCHEME.match(arg) and not arg.startswith("file:")):
        return None
    path = arg.removeprefix("file://").removeprefix("file:") if arg.startswith("file:") else arg
    if Path(path).expanduser().is_dir():
        return None
    return (f"'{spec}': the directory {path} does not exist; create it (mkdir -p {path}) or give an MLflow URI "
            "(sqlite:///runs.db, http://host:5000)")


def _check_trackers(specs: list[str]) -> None:
    for spec in specs:
        kind, arg = parse_tracker(spec)
        missing = _missing_directory(spec, arg) if kind == "mlflow" else None
        if missing:
            raise ValueError(missing)
    kinds = [parse_tracker(spec)[0] for spec in specs]
    twice = sorted({k for k in kinds if kinds.count(k) > 1})
    if twice:
        raise ValueError(f"{twice[0]} is given twice; give each tracker once")
    for kind in kinds:
        if importlib.util.find_spec(_MODULES[kind]) is None:
            raise ValueError(f"{kind} needs its client library, which is not installed: "
                             f"pip install 'polytrain[{kind}]'")


@register_section("tracking", "experiment trackers (MLflow, Weights & Biases)", order=91)
@dataclass
class TrackingConfig:
    tracker: list[str] = option([], "also log the run to an experiment tracker: mlflow[:URI|DIR] (default "
                                    "$MLFLOW_TRACKING_URI or sqlite:///mlflow.db; a directory: DIR/mlflow.db) or "
                                    "wandb[:MODE] (offline "
                                    "unless MODE or $WANDB_MODE says online); repeatable",
                                repeat=True, check=_check_trackers, metavar="NAME[:ARG]")
    tracker_project: str = option("polytrain", "the MLflow experiment / W&B project the run is logged to",
                                  metavar="NAME")
    tracker_run_name: str | None = option(None, "the run's name in the trackers (default: the tracker's own)",
                                          metavar="NAME")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def numbers(scalars: dict[str, Any]) -> dict[str, float]:
    """The finite-or-not plain numbers of ``scalars`` as floats (a None loss, lists and strings dropped)."""
    return {key: float(value) for key, value in scalars.items() if _number(value)}


class MlflowTracker:
    """One MLflow run through ``mlflow.tracking.MlflowClient`` (no global active run is touched)."""

    name = "mlflow"
    spec: str | None = None  # the --tracker value it was opened for

    def __init__(self, uri: str | None, project: str, run_name: str | None, run_id: str | None = None):
        from mlflow.tracking import MlflowClient

        uri, artifacts = mlflow_store(uri)
        self.client = MlflowClient(tracking_uri=uri)  # None: $MLFLOW_TRACKING_URI or MLflow's default
        self.uri = self.client.tracking_uri
        if run_id is None:
            found = self.client.get_experiment_by_name(project)
            experiment = (found.experiment_id if found is not None
                          else self.client.create_experiment(project, artifact_location=artifacts))
            run_id = self.client.create_run(experiment, run_name=run_name, tags={"polytrain": "train"}).info.run_id
        self.run_id = run_id  # given: a run another process opened, continued (--on-failure continue)
        self.where = f"mlflow run {self.run_id} (experiment '{project}' at {self.uri})"

    def start(self, config: dict[str, Any], config_toml: str) -> None:
        from mlflow.entities import Param

        params = [Param(key, _param_value(value)) for key, value in sorted(config.items())]
        for first in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
            self.client.log_batch(self.run_id, params=params[first:first + 100])
        self.client.log_text(self.run_id, config_toml, "config.toml")

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in scalars.items()]
        for first in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics a call
            self.client.log_batch(self.run_id, metrics=metrics[first:first + 1000])

    def end(self, summary: dict[str, Any], model: Path | None) -> None:
        self.client.log_text(self.run_id, json.dumps(summary, indent=1, default=str), "summary.json")
        if model is not None:
            self.client.log_artifact(self.run_id, str(model), artifact_path="model")

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status)


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text[:6000]  # MLflow's limit on a parameter's value


class WandbTracker:
    """One W&B run through ``wandb.init`` (offline unless told otherwise)."""

    name = "wandb"
    spec: str | None = None  # the --tracker value it was opened for

    def __init__(self, mode: str | None, project: str, run_name: str | None):
        import wandb

        self.wandb = wandb
        mode = mode or os.environ.get("WANDB_MODE") or "offline"
        settings = wandb.Settings(console="off", silent=True)  # the run's output stays polytrain's own
        self.run = wandb.init(project=project, name=run_name, mode=mode, settings=settings, reinit="create_new")
        self.where = f"wandb run {self.run.id} ({mode}, {Path(self.run.dir).parent})"  # (run.dir: its files/)

    def start(self, config: dict[str, Any], config_toml: str) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def end(self, summary: dict[str, Any], model: Path | None) -> None:
        self.run.summary.update({key: value for key, value in summary.items()
                                 if _number(value) or isinstance(value, str)})
        if model is not None:
            artifact = self.wandb.Artifact(f"model-{self.run.id}", type="model")
            artifact.add_file(str(model))
            self.run.log_artifact(artifact)

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


def reopen_trackers(cfg: TrackingConfig, run_ids: dict[str, str]) -> tuple[list[Any], list[str]]:
    """The runs another process opened (``run_ids``: ``--tracker`` value -> run id), continued by this one
    (``--on-failure continue``, the reporting rank lost): MLflow's, by their id; and the values whose run cannot be
    continued (W&B: a run is one process's)."""
    reopened, lost = [], []
    for spec in cfg.tracker:
        kind, arg = parse_tracker(spec)
        if kind == "mlflow" and spec in run_ids:
            reopened.append(MlflowTracker(arg, cfg.tracker_project, None, run_id=run_ids[spec]))
            reopened[-1].spec = spec
        else:
            lost.append(spec)
    return reopened, lost


def open_trackers(cfg: TrackingConfig) -> list[Any]:
    """A started run in each tracker ``cfg`` names (the main rank only); a ConfigError line if one cannot
    be opened, with the runs already opened closed as FAILED."""
    opened: list[Any] = []
    for spec in cfg.tracker:
        kind, arg = parse_tracker(spec)
        try:
            tracker_cls = MlflowTracker if kind == "mlflow" else WandbTracker
            opened.append(tracker_cls(arg, cfg.tracker_project, cfg.tracker_run_name))
            opened[-1].spec = spec
        except Exception as exc:  # noqa: BLE001 - the library's own error, said in one line
            for tracker in opened:
                tracker.close("FAILED")
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"--tracker {spec}: could not open a run: {reason}") from None
    return opened
