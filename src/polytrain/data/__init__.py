"""Datasets: the packaged ``digits`` and ``text``, ``synthetic`` data of any shape, ``cifar10:DIR``, ``text:FILE``,
``sentences:FILE``, token files ``tokens:FILE.bin``, local Hugging Face data ``hf:PATH``, and user factories.

The names below are imported on first use (PEP 562), so that a process that only tokenizes
(:mod:`polytrain.data.pretokenize`'s workers) does not import torch."""

import importlib as _importlib

_EXPORTS = {"DataBundle": "polytrain.data.base", "TensorData": "polytrain.data.base",
            "example_uniform": "polytrain.data.base", "available_datasets": "polytrain.data.registry",
            "build_data": "polytrain.data.registry", "check_data": "polytrain.data.registry",
            "register_dataset": "polytrain.data.registry"}

__all__ = ["DataBundle", "TensorData", "example_uniform", "available_datasets", "build_data", "check_data",
           "register_dataset"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'polytrain.data' has no attribute {name!r}")
    value = getattr(_importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
