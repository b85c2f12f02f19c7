"""Write the bytecode of the modules that polytrain, its tests and its optional packages import, once, into the
venv (``make`` runs it after ``pip install --no-compile``).

pip compiles every file it installs (18,000 files of the development set: 100 s of CPU on 2 cores, most of the
install), although a run imports about 5,000 of them. Where ``PYTHONDONTWRITEBYTECODE`` is set, nothing writes
the rest later, so without a warm-up every process would compile torch's sources again on each import. This
imports the modules that matter with bytecode writing on (the Makefile unsets the variable for this command
only): 45 s of CPU instead of 100. A module it misses is compiled on import as Python always does."""

from __future__ import annotations

import importlib
import sys

MODULES = [
    # torch and the pieces of torch.distributed polytrain uses
    "torch", "torch._dynamo", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor.parallel",
    "torch.distributed.pipelining", "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
    "torch.distributed.algorithms.ddp_comm_hooks", "torch.distributed.elastic.multiprocessing",
    "torch.distributed.run", "torch.utils.checkpoint", "torch.utils.tensorboard", "torch.profiler",
    "numpy", "tqdm",
    # the test runner
    "pytest", "xdist", "xdist.plugin", "execnet",
    # optional packages (each skipped where it is not installed)
    "transformers", "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2",
    "safetensors.torch", "tokenizers", "sentencepiece", "datasets", "pyarrow.parquet", "peft",
    "matplotlib.pyplot", "mlflow", "mlflow.tracking", "mlflow.store.tracking.sqlalchemy_store", "wandb",
    "wandb.sdk", "wandb.apis.public", "nbclient", "ipykernel",
]


def main() -> int:
    try:
        from _pytest.config import default_plugins

        MODULES.extend(f"_pytest.{name}" for name in default_plugins)
    except ImportError:
        pass
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # an optional package missing or broken: its tests skip or say why
            print(f"warm_bytecode: {name} not imported ({type(exc).__name__})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
