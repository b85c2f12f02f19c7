"""Where a run reports: the console (a progress bar on a terminal, plain lines otherwise), a JSON-lines
metrics file and TensorBoard. Only the main rank creates a :class:`RunLog` with sinks enabled (``--on-failure
continue``: when it is lost, the new main rank's takes over, :meth:`RunLog.take_over`).

The metrics file contract (other tools rely on it): one JSON object per line, each with ``event``:
``start`` (with the resolved ``config``), ``step`` (``step``, ``loss``, ``lr``, ``examples_per_sec`` and ``sec_per_batch`` (over the latest
max(``--log-every``, 50) steps after the first 5, each step's own seconds: not the log points' work),
``rank_examples_per_sec``, ``rank_batch`` (each rank's mean slice), ``time_s``: wall seconds since the loop
began, ``eta_s``: the wall seconds the steps left should take, ...),
``eval`` (``eval_loss``, ``eval_accuracy``) and a final ``end`` (``steps``, ``train_loss``, ``eval_loss``,
``eval_accuracy``, ``wall_s``, each trainer rank's memory: ``peak_memory_mb``, ``rank_peak_memory_mb``,
``rank_state_mb``, ``rank_activation_mb``, ``rank_memory_bytes`` (:mod:`polytrain.train.memory`), ...).

Experiment trackers (``--tracker mlflow|wandb``, :mod:`polytrain.train.trackers`) get the same records: the
config, each step's and evaluation's numbers under TensorBoard's names, the summary and the saved model.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from polytrain.log import get_logger
from polytrain.options import option, register_section

PROGRESS = ("auto", "bar", "lines", "off")


@register_section("log", "logging", order=90)
@dataclass
class LogConfig:
    log_every: int = option(10, "log loss, lr and throughput every N steps", minimum=1, metavar="N")
    log_dir: str | None = option(None, "TensorBoard log directory (also gets the resolved config.toml)",
                                 metavar="DIR")
    metrics_file: str | None = option(None, "append one JSON object per logged step (and a final one) here",
                                      metavar="FILE.jsonl")
    histogram_every: int = option(100, "weight/gradient histograms to TensorBoard every N steps (0: never)",
                                  minimum=0, metavar="N")
    progress: str = option("auto", "console output: auto (a bar on a terminal, lines otherwise), bar, lines, off",
                           choices=PROGRESS)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def clock(seconds: float | None) -> str:
    """Seconds as the progress line shows them: ``0:07``, ``12:34``, ``1:02:03`` (``?`` when not known)."""
    if seconds is None:
        return "?"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def step_scalars(record: dict[str, Any]) -> dict[str, Any]:
    """A step record's numbers by their TensorBoard names (``train/loss``, ``perf/rank0_examples_per_sec``,
    ``strategy/rank1_bytes_sent``, ...), in the order TensorBoard gets them."""
    out = {"train/loss": record["loss"]}
    if "perplexity" in record:
        out["train/perplexity"] = record["perplexity"]
    out["train/lr"] = record["lr"]
    out["perf/examples_per_sec"] = record["examples_per_sec"]
    out["perf/sec_per_batch"] = record["sec_per_batch"]
    for rank, value in enumerate(record.get("rank_examples_per_sec", [])):
        out[f"perf/rank{rank}_examples_per_sec"] = value
    for rank, value in enumerate(record.get("rank_batch", [])):
        out[f"perf/rank{rank}_batch"] = value
    for key, values in record.items():  # a strategy's own per-rank numbers (take_metrics)
        if key.startswith("rank_") and key not in ("rank_examples_per_sec", "rank_batch"):
            for rank, value in enumerate(values):
                if _number(value):
                    out[f"strategy/rank{rank}_{key[5:]}"] = value
    return out


class RunLog:
    """Fans each record out to the enabled sinks. With ``enabled=False`` every call does nothing."""

    def __init__(self, cfg: LogConfig, total_steps: int, enabled: bool = True, tracking: Any = None):
        self.cfg, self.total_steps, self.enabled = cfg, total_steps, enabled
        self.log = get_logger()
        self._bar = None
        self._tb = None
        self._metrics = None
        self._trackers: list[Any] = []  # --tracker: MLflow / W&B runs (polytrain.train.trackers)
        self._tracked = "FAILED"  # how the trackers' runs end if end() is never reached
        self._model_file: Path | None = None
        if not enabled:
            return
        if tracking is not None and tracking.tracker:
            from polytrain.train.trackers import open_trackers  # imports a tracker's library: only when asked for
            self._trackers = open_trackers(tracking)
        use_bar = cfg.progress == "bar" or (cfg.progress == "auto" and sys.stderr.isatty())
        if use_bar:
            from tqdm import tqdm
            self._bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True, leave=True)
        self._open_files()

    def take_over(self, tracking: Any = None, run_ids: dict[str, str] | None = None,
                  save_model: str | None = None) -> None:
        """This rank reports from now on: the one that did was lost (``--on-failure continue``). The metrics file
        and TensorBoard get its records from here on, appended; the console gets lines (no bar); an MLflow run
        (``run_ids``: :meth:`run_ids` of the lost rank's) is continued; a W&B run was the lost rank's process's
        and ends with it (one warning)."""
        if self.enabled:
            return
        self.enabled = True
        self._open_files()
        self._model_file = Path(save_model) if save_model else None
        if tracking is not None and tracking.tracker:
            from polytrain.train.trackers import reopen_trackers

            try:
                self._trackers, lost = reopen_trackers(tracking, run_ids or {})
            except Exception as exc:  # noqa: BLE001 - a tracker out of reach must not end the training
                self.log.warning(f"--tracker: could not continue the run: {type(exc).__name__}: {exc}")
                self._trackers, lost = [], []
            for tracker in self._trackers:
                self.info(f"tracking: {tracker.where}, continued")
            if lost:
                self.log.warning(f"--tracker {' '.join(lost)}: the run was the lost rank's and ends with it; the rest "
                                 "of this run's numbers go to the console"
                                 + (f" and {self.cfg.metrics_file}" if self.cfg.metrics_file else ""))

    def run_ids(self) -> dict[str, str]:
        """The trackers' runs another process can continue: ``--tracker`` value -> run id (MLflow's)."""
        return {tracker.spec: tracker.run_id for tracker in self._trackers if tracker.name == "mlflow"}

    def _open_files(self) -> None:
        cfg = self.cfg
        if cfg.metrics_file:
            Path(cfg.metrics_file).parent.mkdir(parents=True, exist_ok=True)
            self._metrics = open(cfg.metrics_file, "a", buffering=1)
        if cfg.log_dir:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when asked for
            self._tb = SummaryWriter(cfg.log_dir)

    def info(self, message: str) -> None:
        if not self.enabled or self.cfg.progress == "off":
            return
        if self._bar is not None:
            self._bar.write(message)
        else:
            self.log.info(message)

    def start(self, config: dict[str, Any], config_toml: str, start_step: int) -> None:
        if not self.enabled:
            return
        if self.cfg.log_dir:
            Path(self.cfg.log_dir, "config.toml").write_text(config_toml)
        self._write({"event": "start", "step": start_step, "config": config})
        if config.get("save_model"):
            self._model_file = Path(config["save_model"])
        for tracker in self._trackers:
            tracker.start(config, config_toml)
            self.info(f"tracking: {tracker.where}")
        if self._bar is not None:
            self._bar.update(start_step)

    def step(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._write({"event": "step", **record})
        step = record["step"]
        if self._tb is not None or self._trackers:  # (named for TensorBoard and the trackers only)
            scalars = step_scalars(record)
            if self._tb is not None:
                for tag, value in scalars.items():
                    self._tb.add_scalar(tag, value, step)
            self._track({**scalars, "train/epoch": record.get("epoch"), "perf/time_s": record.get("time_s")}, step)
        ranks, slices = record.get("rank_examples_per_sec", []), record.get("rank_batch", [])
        per_rank = (" per rank " + "/".join(f"{v:.0f}" for v in ranks)) if len(ranks) > 1 else ""
        if len(set(slices)) > 1:  # a balanced split moved examples between ranks: show how many each took
            per_rank += " slices " + "/".join(f"{v:.4g}" for v in slices)
        if self._bar is not None:
            self._bar.set_postfix_str(f"loss {record['loss']:.4f} lr {record['lr']:.3g} "
                                      f"{record['examples_per_sec']:.0f} ex/s{per_rank}", refresh=False)
        elif self.cfg.progress != "off":
            self.log.info(f"step {step}/{self.total_steps}  loss {record['loss']:.4f}  lr {record['lr']:.4g}  "
                          f"{record['examples_per_sec']:.1f} ex/s  {record['sec_per_batch']:.4f} s/batch  "
                          f"elapsed {clock(record.get('time_s'))}  left {clock(record.get('eta_s'))}"
                          + (f" {per_rank}" if per_rank else ""))

    def advance(self, steps: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(steps)

    def evaluation(self, step: int, loss: float, accuracy: float | None, extra: dict[str, float] | None = None) -> None:
        """An evaluation's mean loss and accuracy, and the task's ``extra`` metrics (perplexity)."""
        if not self.enabled:
            return
        extra = extra or {}
        self._write({"event": "eval", "step": step, "eval_loss": loss, "eval_accuracy": accuracy,
                     **{f"eval_{k}": v for k, v in extra.items()}})
        if self._tb is not None:
            self._tb.add_scalar("eval/loss", loss, step)
            if accuracy is not None:
                self._tb.add_scalar("eval/accuracy", accuracy, step)
            for key, value in extra.items():
                self._tb.add_scalar(f"eval/{key}", value, step)
        self._track({"eval/loss": loss, "eval/accuracy": accuracy, **{f"eval/{k}": v for k, v in extra.items()}},
                    step)
        more = "".join(f"  {key} {value:.4g}" for key, value in extra.items())
        self.info(f"eval at step {step}: loss {loss:.4f}  accuracy {_fmt(accuracy, '.4f')}{more}")

    def histograms(self, model: nn.Module, step: int) -> None:
        """Weights and (when present) gradients of every parameter, to TensorBoard."""
        if self._tb is None:
            return
        for name, param in model.named_parameters():
            if param.numel() == 0:  # a pipeline rank holds only its own stages' tensors
                continue
            self._tb.add_histogram(f"weights/{name}", param.detach().float().cpu(), step)
            if param.grad is not None:
                self._tb.add_histogram(f"grads/{name}", param.grad.detach().float().cpu(), step)

    def end(self, summary: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._write({"event": "end", **summary})
        if self._tb is not None:  # the summary's numbers, and its histograms ({value: count}), at the last step
            step = summary.get("steps", 0)
            for key, value in summary.items():
                if _number(value):
                    self._tb.add_scalar(f"summary/{key}", value, step)
                elif key.endswith("_histogram") and isinstance(value, dict) and value:
                    counts = torch.tensor(list(value.values()))
                    values = torch.tensor([float(k) for k in value]).repeat_interleave(counts)
                    self._tb.add_histogram(f"summary/{key[:-len('_histogram')]}", values, step)
        if self._trackers:
            self._track({f"summary/{key}": value for key, value in summary.items()}, summary.get("steps", 0))
            model = self._model_file if "stopped" not in summary and self._model_file is not None \
                and self._model_file.is_file() else None
            for tracker in self._trackers:
                tracker.end(summary, model)
            self._tracked = "KILLED" if "stopped" in summary else "FINISHED"
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._metrics is not None:
            self._metrics.close()
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            tracker.close(self._tracked)

    def _track(self, scalars: dict[str, Any], step: int) -> None:
        if self._trackers:
            from polytrain.train.trackers import numbers

            values = numbers(scalars)
            for tracker in self._trackers:
                tracker.log(values, step)

    def _write(self, record: dict[str, Any]) -> None:
        if self._metrics is not None:
            self._metrics.write(json.dumps(record) + "\n")
