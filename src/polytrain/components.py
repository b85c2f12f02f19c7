"""The composition: importing this module registers every component polytrain is made of — each config
section (and so each flag and TOML key), the built-in strategies, models and data sets.

The command line, the Python API (:func:`polytrain.fit`, :func:`polytrain.make_config`) and the trainer in a
worker import it; the components themselves import only what they use, and :mod:`polytrain.config` imports
none of them (it merges whatever sections are registered), so no component depends on the whole.
"""

from __future__ import annotations

import polytrain.data.config  # noqa: F401  (--data, --batch-size, ...)
import polytrain.data.registry  # noqa: F401  (digits, synthetic, cifar10, text, ...)
import polytrain.devices.config  # noqa: F401  (--device, --place, ...)
import polytrain.distributed.launch  # noqa: F401  (--workers, --backend, --timeout, ...)
import polytrain.models.lora  # noqa: F401  (--lora, --merge-lora)
import polytrain.models.registry  # noqa: F401  (--model and the reference models)
import polytrain.parallel.degrees  # noqa: F401  (--dp-replicate, --dp-shard, --pp, --tp)
import polytrain.strategies  # noqa: F401  (the registry and the protocol)
import polytrain.train.checkpoint  # noqa: F401  (--checkpoint-dir, ...)
import polytrain.train.config  # noqa: F401  (--strategy, --steps, ...)
import polytrain.train.faults  # noqa: F401  (--max-restarts, --checkpoint-every-seconds)
import polytrain.train.loggers  # noqa: F401  (--log-every, --metrics-file, ...)
import polytrain.train.on_failure  # noqa: F401  (--on-failure stop|continue)
import polytrain.train.optim  # noqa: F401  (--optimizer, --lr, ...)
import polytrain.train.profile  # noqa: F401  (--profile STEPS)
import polytrain.train.straggler  # noqa: F401  (--straggler)
import polytrain.train.trackers  # noqa: F401  (--tracker mlflow|wandb)
import polytrain.train.unit_options  # noqa: F401  (--activation-checkpointing, --compile)

# polytrain's own strategies as declared (strategies/declared.py): each one's light module registers its section
# (--stages, --microbatches, --sync-every, --staleness, fsdp's and tp's options), so that every flag and key exists
# before any name is looked up (the parser, make_config); a strategy's own module is imported where a run with it
# is built (get_strategy)
from polytrain.strategies.registry import declared as _declared  # noqa: E402

_declared()
