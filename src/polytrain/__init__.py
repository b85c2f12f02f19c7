"""polytrain: train one PyTorch model on many devices and machines; the parallel strategy is a setting.

Public API::

    polytrain.fit(...)                 a whole training run (what `polytrain train` does)
    polytrain.make_config(...)         a RunConfig from flag-named settings
    polytrain.Trainer                  the training loop inside one worker
    polytrain.launch(fn, workers=N)    run fn(ctx) in N worker processes (or under torchrun)
    polytrain.strategy(name, ctx)      a strategy for your own training loop
    polytrain.build_data(spec)         a dataset by name (digits, synthetic, cifar10:DIR, package.module:fn)
    polytrain.place(model, {"features": "cuda:0", "classifier": "cuda:1"}, soft=False)
    with polytrain.device("cuda:1"): ...   build modules on a device (tf.device)
    polytrain.parse_device("/gpu:1")       the one device-name parser; polytrain.devices has the rest
"""

__version__ = "0.1.0"

import importlib as _importlib

#: where each public name lives: imported on first use (PEP 562), so that ``import polytrain.errors`` or the
#: command line's start does not import torch and every component first
_EXPORTS = {
    "fit": "polytrain.api", "strategy": "polytrain.api",
    "RunConfig": "polytrain.api", "make_config": "polytrain.api",  # (api registers every component first)
    "build_data": "polytrain.data", "register_dataset": "polytrain.data",
    "DataBundle": "polytrain.data.base", "TensorData": "polytrain.data.base",
    **{name: "polytrain.devices" for name in ("DeviceSpec", "OpDeviceLog", "PlacementPlan", "device", "list_devices",
                                              "log_placement", "parse_device", "place")},
    "WorkerContext": "polytrain.distributed.launch", "launch": "polytrain.distributed.launch",
    "Topology": "polytrain.distributed.topology",
    **{name: "polytrain.errors" for name in ("ConfigError", "DeviceError", "DivergedError", "PolytrainError")},
    **{name: "polytrain.strategies" for name in ("Strategy", "available_strategies", "get_strategy",
                                                 "register_strategy")},
    "Checkpointer": "polytrain.train.checkpoint",
    "LRSchedule": "polytrain.train.lr_schedules", "parse_lr_schedule": "polytrain.train.lr_schedules",
    "seed_everything": "polytrain.train.session",
    "Trainer": "polytrain.train.trainer",
}

__all__ = sorted([*_EXPORTS, "models"])


def __getattr__(name: str):
    if name == "models":
        return _importlib.import_module("polytrain.models")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'polytrain' has no attribute {name!r}")
    value = getattr(_importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
