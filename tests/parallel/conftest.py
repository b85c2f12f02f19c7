"""Every module here computes on one thread in the test's own process (its ``single`` references, in-process
fits), as each spawned worker does: :func:`tests.helpers.threads.one_thread`."""

from __future__ import annotations

import pytest

from tests.helpers.threads import one_thread


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield
