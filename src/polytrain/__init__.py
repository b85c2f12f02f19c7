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

from polytrain.api import fit, strategy  # noqa: E402
from polytrain.config import RunConfig, make_config  # noqa: E402
from polytrain import models  # noqa: E402,F401
from polytrain.data import build_data, register_dataset  # noqa: E402
from polytrain.data.base import DataBundle, TensorData  # noqa: E402
from polytrain.devices import (  # noqa: E402
    DeviceSpec,
    OpDeviceLog,
    PlacementPlan,
    device,
    list_devices,
    log_placement,
    parse_device,
    place,
)
from polytrain.distributed.launch import WorkerContext, launch  # noqa: E402
from polytrain.distributed.topology import Topology  # noqa: E402
from polytrain.errors import ConfigError, DeviceError, DivergedError, PolytrainError  # noqa: E402
from polytrain.strategies import Strategy, available_strategies, get_strategy, register_strategy  # noqa: E402
from polytrain.train.checkpoint import Checkpointer  # noqa: E402
from polytrain.train.schedules import Schedule, parse_schedule  # noqa: E402
from polytrain.train.session import seed_everything  # noqa: E402
from polytrain.train.trainer import Trainer  # noqa: E402

__all__ = [
    "Checkpointer", "ConfigError", "DataBundle", "DivergedError", "PolytrainError", "RunConfig", "Schedule",
    "Strategy", "TensorData", "Topology", "Trainer", "WorkerContext", "available_strategies", "build_data", "fit",
    "get_strategy", "launch", "make_config", "models", "parse_schedule", "register_dataset", "register_strategy", "seed_everything", "strategy",
    # devices and placement
    "DeviceError", "DeviceSpec", "OpDeviceLog", "PlacementPlan", "device", "list_devices", "log_placement",
    "parse_device", "place",
]
