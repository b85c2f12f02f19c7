import os
import sys

import pytest
import torch

import polytrain.components  # noqa: F401  (every setting registered, as the command line and the API do)

# polytrain's CLI runs in subprocesses in some tests; they must find this checkout's sources
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if has_gpu else 0
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA devices"))


@pytest.fixture
def cli_env():
    """Environment for running `python -m polytrain` in a subprocess against this checkout."""
    return command_env()


@pytest.fixture(scope="module")
def module_cli_env():
    """:func:`cli_env` for a module-scoped fixture."""
    return command_env()


def command_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


@pytest.fixture
def python():
    return sys.executable
