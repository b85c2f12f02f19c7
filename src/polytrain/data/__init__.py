"""Datasets: the packaged ``digits`` and ``text``, ``synthetic`` data of any shape, ``cifar10:DIR``, ``text:FILE``,
``sentences:FILE``, token files ``tokens:FILE.bin``, local Hugging Face data ``hf:PATH``, and user factories."""

from polytrain.data.base import DataBundle, TensorData, example_uniform
from polytrain.data.registry import available_datasets, build_data, check_data, register_dataset

__all__ = ["DataBundle", "TensorData", "example_uniform", "available_datasets", "build_data", "check_data",
           "register_dataset"]
