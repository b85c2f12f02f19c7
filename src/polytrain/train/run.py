"""From a resolved config to a finished run: check in this process, then launch the workers.

Everything that can be checked before starting processes is checked here, so a bad name or setting is
one clear error line instead of N failing workers.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from polytrain.config import RunConfig
from polytrain.data.base import DataBundle
from polytrain.data.registry import check_data_of, data_of
from polytrain.data.stream import StreamPlan, TokenStream
from polytrain.devices.config import check_device_config
from polytrain.devices.spec import parse_device
from polytrain.weights.export import check_save_model
from polytrain.distributed.launch import launch, resolve_backend, resolve_workers, under_torchrun
from polytrain.distributed.stop import StopSignal, signal_number
from polytrain.errors import ConfigError, RunStopped
from polytrain.models.lm import check_lm_model
from polytrain.models.registry import check_model, model_modules
from polytrain.weights.start import check_weights
from polytrain.precision import check_precision
from polytrain.distributed.layout import Layout
from polytrain.strategies.base import layout_for
from polytrain.strategies.registry import declared, declared_class, get_declared, strategy_class
from polytrain.parallel.degrees import deprecated_flags
from polytrain.strategies.settings import check_settings_read
from polytrain.specs import is_import_path
from polytrain.train.checkpoint import check_checkpoint_dir
from polytrain.train.data_check import check_user_data
from polytrain.train.lr_schedules import parse_lr_schedule
from polytrain.train.session import strategy_options
from polytrain.train.on_failure import check_on_failure, continuing, launch_settings
from polytrain.train.straggler import check_stragglers
from polytrain.train.unit_options import check_unit_options
from polytrain.models.lora import check_lora
from polytrain.train.trainer import train_worker


def layout_of(config: RunConfig) -> Layout:
    """The job's layout, decided here, once: from ``--workers`` (None: not given) and the strategy's own
    settings; under torchrun, the one that fills torchrun's world."""
    strategy = get_declared(config.train.strategy)  # (no strategy module imported: polytrain plan)
    options = strategy_options(config, strategy)
    if under_torchrun():
        return layout_for(strategy, int(os.environ["WORLD_SIZE"]), options)
    return strategy.layout(requested_workers(config), options)


def warn_deprecated(config: RunConfig) -> None:
    """One warning line per deprecated flag given (a second name of a degree), saying which flag it is now."""
    from polytrain.log import get_logger

    for line in deprecated_flags(config):
        get_logger().warning(line)


def requested_workers(config: RunConfig) -> int | None:
    """``--workers``, or the count the ``--device`` spec names (``cpu:4``); None when neither says."""
    if config.launch.workers is None:
        return parse_device(config.device.device).workers
    return resolve_workers(config.launch.workers, config.device.device)


def check(config: RunConfig, *, model: nn.Module | None = None, data: DataBundle | None = None) -> Layout:
    """Validate ``config`` without starting anything; return the job's layout."""
    get_declared(config.train.strategy)
    parse_device(config.device.device)
    warn_deprecated(config)
    layout = layout_of(config)
    check_settings_read(config, declared_class(config, layout), declared())  # (before the strategy's module)
    check_device_config(config.device, layout.processes)
    resolve_backend(config.launch.backend, config.device.device, soft=config.device.soft_placement)
    strategy_class(config, layout).check(layout, config, model)
    check_stragglers(config.straggler.straggler, layout.workers)
    check_unit_options(config, model)
    check_lora(config, model)
    check_on_failure(config, layout)
    check_precision(config)
    parse_lr_schedule(config.optim.lr_schedule, config.optim.lr, 1)
    if config.optim.nesterov and (config.optim.optimizer != "sgd" or config.optim.momentum <= 0):
        raise ConfigError("--nesterov needs --optimizer sgd and --momentum > 0")
    if config.optim.lr_scaling != "none" and not config.optim.base_batch_size:
        raise ConfigError(f"--lr-scaling {config.optim.lr_scaling} needs --base-batch-size "
                          "(the batch size --lr was tuned for)")
    if config.data.pack and config.train.loss == "model":
        raise ConfigError("--pack with --loss model: a model's own loss shifts the labels itself, across the packed "
                          "documents' boundaries; use --loss task (the default) with --pack")
    if config.checkpoint.resume and not config.checkpoint.checkpoint_dir:
        raise ConfigError("--resume needs --checkpoint-dir DIR (where the checkpoints are)")
    if model is None and config.model.model != "auto":
        check_model(config.model.model, config.model.model_args)
    check_weights(config)  # --init-from, --model hf:DIR: there, readable
    check_save_model(config.train.save_model, config.train.save_shard_size)  # --save-model DIR, its shard size
    if data is None:
        if is_import_path(config.data.data):  # a user's factory: its data built and checked, once, here
            bundle = data_of(config)
            _check_user_data(bundle, f"--data {config.data.data}", config, model)
            size = len(bundle.train) if hasattr(bundle.train, "__len__") else None
        else:
            size, bundle = check_data_of(config)
        _check_dataset_size(size, layout.slices, config.global_batch(layout.slices))
        if bundle is not None and bundle.task == "lm" and model is None:
            check_lm_model(bundle, config)  # the vocabulary, the positions, --pack: before any worker starts
        if bundle is not None and isinstance(bundle.train, TokenStream) and not config.checkpoint.resume:
            StreamPlan.make(bundle.train, config.global_batch(layout.slices), layout.slices)  # lanes, batch, chunks
    else:
        _check_user_data(data, f"data={data.name}", config, model)
    check_checkpoint_dir(config.checkpoint.checkpoint_dir)  # last: it creates the directory
    return layout


def _check_user_data(data: DataBundle, what: str, config: RunConfig, model: nn.Module | None) -> None:
    check_user_data(data, what, model, config.model.model, config.model.model_args,
                    own_loss=config.train.loss == "model")


def _check_dataset_size(train_size: int | None, processes: int, global_batch: int) -> None:
    if train_size is None:
        return
    if processes > train_size:
        raise ConfigError(f"--workers {processes}: more workers than training examples ({train_size}); "
                          "use fewer workers or more data")
    if global_batch > train_size:
        raise ConfigError(f"--batch-size {global_batch}: larger than the training set ({train_size} examples); "
                          "use a smaller batch")


def run(config: RunConfig, *, model: nn.Module | None = None, data: DataBundle | None = None,
        stop: StopSignal | None = None) -> dict[str, Any] | None:
    """Train as ``config`` says (spawning workers if the strategy needs them); return rank 0's summary
    (None in the other processes of a torchrun job). With ``stop`` (its handlers installed by the caller), a
    stop signal ends the run in order and raises :class:`~polytrain.errors.RunStopped`."""
    layout = layout_of(config) if under_torchrun() else check(config, model=model, data=data)
    config, layout = launch_settings(config, layout)  # --on-failure continue: any worker may be lost
    results = launch(
        train_worker, config, model, data,
        device=config.device.device, backend=config.launch.backend, layout=layout,
        timeout=config.launch.timeout, threads_per_worker=config.launch.threads_per_worker,
        master_port=config.launch.master_port, log_all_ranks=config.launch.log_all_ranks,
        soft_placement=config.device.soft_placement, host_memory=config.launch.host_memory,
        heartbeat_timeout=config.launch.heartbeat_timeout, stop=stop, memory_limit=config.device.memory_limit,
        elastic=continuing(config), replacements=config.restart.max_restarts if continuing(config) else 0,
        preload=model_modules(config) if config.device.memory_limit else (),
    )
    # under torchrun: this process's own; --on-failure continue: the last members' main rank's (the others: None)
    summary = next((r for r in results if r is not None), None) if continuing(config) else results[0]
    if isinstance(summary, dict) and summary.get("stopped"):
        raise stopped_error(summary, stop.requested if stop is not None else None)
    if under_torchrun() and int(os.environ["RANK"]) != 0:
        return None
    return summary


def stopped_error(summary: dict[str, Any], signal: str | None = None) -> RunStopped:
    """The one line that ends a run stopped by a signal (``signal``: the one this process got, if any), from
    its summary's ``stopped`` record."""
    stopped = summary["stopped"]
    name, step, path = signal or stopped["signal"], stopped["step"], stopped["checkpoint"]
    last = f"step {step}, the last (no final evaluation{'; ' if stopped.get('model') else ''}" \
        f"{', '.join(stopped.get('model') or [])})"
    if path and stopped.get("last"):
        message = f"stopped by {name} after {last}; checkpoint {path}: the same command with --resume evaluates it"
    elif path:
        message = f"stopped by {name} after step {step}; checkpoint {path}: the same command with --resume continues there"
    elif stopped.get("model"):
        message = f"stopped by {name} after {last}"
    elif not stopped["trained"]:
        message = f"stopped by {name} at step {step}, before this run trained a step; nothing was lost"
    else:
        message = (f"stopped by {name} after step {step}; the {stopped['trained']} step(s) trained were not saved "
                   "(no --checkpoint-dir)")
    return RunStopped(message, signal_name=name, signum=signal_number(name), step=step, checkpoint=path,
                      resumable=bool(path) or not stopped["trained"], summary=summary)
