"""The Python entry points behind ``polytrain train``: ``fit`` for a whole run, ``strategy`` for your own loop."""

from __future__ import annotations

from typing import Any

from torch import nn

import polytrain.components  # noqa: F401  (every setting, strategy, model and data set registered)
from polytrain.config import RunConfig, make_config, resolve
from polytrain.data.base import DataBundle
from polytrain.distributed.launch import WorkerContext
from polytrain.strategies import Strategy, get_strategy


def fit(config: RunConfig | None = None, *, model: nn.Module | str | None = None,
        data: DataBundle | str | None = None, **settings: Any) -> dict[str, Any]:
    """Train and return the run summary (rank 0's). ``settings`` are named like the CLI flags and
    override ``config``: ``fit(model="mlp", data="digits", strategy="sync", workers=2, steps=100)``.

    ``model`` and ``data`` are names/specs like the flags, or objects: an ``nn.Module`` and a
    :class:`DataBundle`, which are pickled to every worker process. ``strategy`` is a registered name, or a
    :class:`Strategy` subclass defined at module level (every worker imports it by name).
    """
    from polytrain.train.restart import run  # the run, restarted after a failure as --max-restarts says

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
    return run(config, model=model_obj, data=data_obj)


def strategy(name: str, ctx: WorkerContext, options: Any = None) -> Strategy:
    """A strategy for your own training loop inside a ``launch``-ed function::

        def train(ctx):
            sync = polytrain.strategy("sync", ctx)
            model = sync.prepare_model(build_model())
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for x, y in sync.batches(dataset, batch_size=64, steps=100):
                opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()

        polytrain.launch(train, workers=2)
    """
    return get_strategy(name)(ctx.topology, options)
