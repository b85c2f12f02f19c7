"""The Python entry points behind ``polytrain train``: ``fit`` for a whole run, ``strategy`` for your own loop."""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn

import polytrain.components  # noqa: F401  (every setting, strategy, model and data set registered)
from polytrain.config import RunConfig, make_config, resolve
from polytrain.data.base import DataBundle
from polytrain.data.batches import BatchPlan, SlicedBatches
from polytrain.distributed.launch import WorkerContext
from polytrain.errors import ConfigError
from polytrain.strategies import Strategy, get_strategy
from polytrain.strategies.base import data_slice


def fit(config: RunConfig | None = None, *, model: nn.Module | str | None = None,
        data: DataBundle | str | None = None, **settings: Any) -> dict[str, Any]:
    """Train and return the run summary (rank 0's). ``settings`` are named like the CLI flags and
    override ``config``: ``fit(model="mlp", data="digits", strategy="sync", workers=2, steps=100)``.

    ``model`` and ``data`` are names/specs like the flags, or objects: an ``nn.Module`` and a
    :class:`DataBundle`, which are pickled to every worker process. ``strategy`` is a registered name, or a
    :class:`Strategy` subclass defined at module level (every worker imports it by name).
    """
    from polytrain.train.startup import run_environment

    with run_environment():
        return _fit(config, model, data, settings)


def _fit(config: RunConfig | None, model: Any, data: Any, settings: dict[str, Any]) -> dict[str, Any]:
    from polytrain.train.restart import run  # the run, restarted after a failure as --max-restarts says
    from polytrain.distributed.hangs import use_run_directory
    from polytrain.train.startup import mark

    mark()  # the summary's startup_s counts from this call

    chosen = settings.get("strategy")
    if isinstance(chosen, type) and issubclass(chosen, Strategy):  # a class: named so workers import it
        settings["strategy"] = f"{chosen.__module__}:{chosen.__qualname__}"
    for key, value in (("model", model), ("data", data)):
        if isinstance(value, str):
            settings[key] = value
    model_obj = model if isinstance(model, nn.Module) else None
    data_obj = data if isinstance(data, DataBundle) else None
    if config is None:
        config = make_config(**settings)
    elif settings:
        config = resolve(config.flat(), {k.replace("-", "_"): v for k, v in settings.items()},
                         file_name="the config passed to fit()")
    use_run_directory(config)  # where a hang report is written (distributed/hangs.py)
    return run(config, model=model_obj, data=data_obj)


def strategy(name: str, ctx: WorkerContext, options: Any = None) -> "OwnLoop":
    """A strategy for your own training loop inside a ``launch``-ed function::

        def train(ctx):
            sync = polytrain.strategy("sync", ctx)
            model = sync.prepare_model(build_model())
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for x, y in sync.batches(dataset, batch_size=64, steps=100):
                opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()

        polytrain.launch(train, workers=2)

    The strategy lays out the job as ``ctx.layout`` says, or as its own layout for this many processes.
    """
    cls = get_strategy(name)
    layout = ctx.layout if ctx.layout is not None and ctx.layout.strategy == cls.name else None
    return OwnLoop(cls(ctx.topology, options, layout))


class OwnLoop:
    """A strategy's parts for a training loop of your own: the model prepared for the exchange, the same
    slices of each global batch as the trainer draws; anything else is the strategy's own (``.strategy``)."""

    def __init__(self, strategy: Strategy):
        self.strategy = strategy

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """``model`` on this process's device, wrapped for the exchange where the strategy needs it (DDP)."""
        return self.strategy._wrap(model)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain module under what :meth:`prepare_model` returned."""
        return self.strategy._unwrap(model)

    def batches(self, dataset: Any, batch_size: int, *, steps: int | None = None, epochs: int | None = None,
                seed: int = 0, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This process's part of each global batch of ``batch_size`` examples, on this process's device,
        the same slices the trainer takes. Stops after ``steps`` optimizer steps or ``epochs`` passes (one
        epoch if neither is given)."""
        plan = BatchPlan(len(dataset), batch_size, seed)
        mine = data_slice(self.strategy)
        if batch_size % mine.count:
            raise ConfigError(f"batch size {batch_size} does not divide over {mine.count} workers")
        total = steps if steps is not None else (epochs or 1) * plan.steps_per_epoch
        for batch in SlicedBatches(dataset, plan, mine, self.strategy.topology.device, start_step):
            if batch.step >= total:
                return
            yield batch.inputs, batch.targets

    def __getattr__(self, name: str) -> Any:
        return getattr(self.strategy, name)
