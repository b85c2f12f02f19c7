import logging
import os
import sys

from polytrain.cli.entry import main

code = main()  # (its stop signals answered from the first moment)
from polytrain.distributed.launch import under_torchrun  # noqa: E402 (imported by main by now)

if under_torchrun():
    # End a torchrun worker as multiprocessing ends a spawned one: with os._exit, skipping the interpreter's
    # finalization, where a C++ thread of torch's (store, gloo) could abort a run that had succeeded
    # ("terminate called without an active exception", seen once in a few dozen torchrun runs).
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code if isinstance(code, int) else 1)
sys.exit(code)
