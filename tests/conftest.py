import os
import sys

import pytest
import torch

import polytrain.components  # noqa: F401  (every setting registered, as the command line and the API do)
from tests.helpers.serial import suite_lock

# One CPU thread for what runs in a pytest process (the in-process fits and their single references), as polytrain's
# spawned workers take one each: under `pytest -n 2` on 2 cores, torch's default of a thread per core put 4 threads
# on 2 cores, and a tiny model's 8 single steps took 33 s instead of 3-8 s. A test wanting more sets its own.
torch.set_num_threads(1)

# polytrain's CLI runs in subprocesses in some tests; they must find this checkout's sources
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


#: the modules that take longest, started first so that pytest -n 2 does not end with one of them alone (the
#: rest keep their order); a module runs on one worker (--dist loadscope: its module fixtures run once)
FIRST = [
    "tests/cli/test_signals.py",
    "tests/cli/test_bench.py",
    "tests/parallel/test_pipeline_traced.py",
    "tests/cli/test_checkpoint.py",
    "tests/devices/test_memory_limit.py",
    "tests/train/test_dirlock.py",
]


def pytest_collection_modifyitems(config, items):
    rank = {path: n for n, path in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(FIRST)))  # (a stable sort)
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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist, a test marked ``serial`` runs while no other test does (tests/helpers/serial.py)."""
    lock = item.config.stash.get(_LOCK, None)
    if lock is None:
        yield
        return
    alone = item.get_closest_marker("serial") is not None
    with lock.held(alone, keep=nextitem is not None and nextitem.get_closest_marker("serial") is not None):
        yield


_LOCK = pytest.StashKey()


def pytest_configure(config):
    config.stash[_LOCK] = suite_lock(config)
