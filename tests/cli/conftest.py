import time

import pytest

#: the strategies whose runs tests/cli runs through the command's main in the test's process
WARM_STRATEGIES = ("sync", "async", "pipeline")


@pytest.fixture(scope="module")
def warm_forkserver():
    """This process's forkserver, started once with the modules of :data:`WARM_STRATEGIES`: the command's main
    called in this process keeps a forkserver it found running, so each run through it forks its workers from this
    one instead of starting (and importing torch in) a forkserver of its own, which its end would stop again."""
    import importlib

    from polytrain.builtin_strategies import BUILTIN_STRATEGIES
    from polytrain.distributed.processes import start_context

    for name in WARM_STRATEGIES:
        importlib.import_module(BUILTIN_STRATEGIES[name])
    warm = start_context().Process(target=time.sleep, args=(0,))  # (its start starts the forkserver)
    warm.start()
    warm.join(600)
    assert warm.exitcode == 0, warm.exitcode
