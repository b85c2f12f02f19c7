"""Random choices in tests (a step to signal or kill at): drawn from ``POLYTRAIN_TEST_SEED`` (default 0), so that
a run is repeatable and another seed tries other choices; each draw is printed, so a failure says how to replay it."""

from __future__ import annotations

import os
import random

ENV = "POLYTRAIN_TEST_SEED"


def seeded(label: str) -> random.Random:
    """A generator for the choices of one test (``label``: the test's name and case), from the suite's seed."""
    seed = os.environ.get(ENV, "0")
    print(f"{label}: random choices from {ENV}={seed}")
    return random.Random(f"{seed}/{label}")


def draw(label: str, low: int, high: int) -> int:
    """One integer in ``[low, high]``, printed with the seed it came from."""
    value = seeded(label).randint(low, high)
    print(f"{label}: drew {value} from [{low}, {high}]")
    return value
