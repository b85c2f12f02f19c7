"""``--strategy async`` when a process dies mid-run: the job stops and its error names who died.

The deaths are deterministic (at a given update or step), set by the strategies below, which the spawned
processes import by name; nothing waits on a clock. Each run's --timeout is 60 s: had a receive missed the
death, the job would end with a timeout error instead, which the expected messages exclude.
"""

from __future__ import annotations

import os
import signal

import pytest

import polytrain
from polytrain.errors import PolytrainError
from polytrain.strategies.ps.strategy import AsyncParameterServer


def _sigkill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class ServerKilledAtItsFifthUpdate(AsyncParameterServer):
    name = "test-async-server-killed"

    def _build_server(self, make_optimizer, dtype):
        def dying(params):
            optimizer = make_optimizer(params)
            step, count = optimizer.step, [0]

            def step_or_die(*args, **kwargs):
                count[0] += 1
                if count[0] == 5 and self.topology.rank == self.topology.world_size - 1:
                    _sigkill_self()  # the last server, as kill -9 or the OOM killer would
                return step(*args, **kwargs)

            optimizer.step = step_or_die
            return optimizer

        return super()._build_server(dying, dtype)


class WorkerKilledAtStep4(AsyncParameterServer):
    name = "test-async-worker-killed"

    def train_step(self, batch, lr):
        if self.topology.rank == 1 and batch.step == 4:  # every worker's loop reaches step 4, slices or none
            _sigkill_self()
        return super().train_step(batch, lr)


def _fit(strategy, **settings):
    return polytrain.fit(strategy=strategy, model="mlp:hidden=16", data="digits", batch_size=32, steps=40,
                         progress="off", eval_every=0, timeout=60, **settings)


@pytest.mark.parametrize("staleness", [None, 0])
def test_a_killed_server_stops_the_job_naming_the_server(staleness):
    with pytest.raises(PolytrainError, match=r"^parameter server rank 3 was killed by signal SIGKILL"):
        _fit(ServerKilledAtItsFifthUpdate, workers=2, servers=2, staleness=staleness)


def test_a_killed_worker_stops_the_job_naming_its_rank():
    with pytest.raises(PolytrainError, match=r"^worker rank 1 was killed by signal SIGKILL"):
        _fit(WorkerKilledAtStep4, workers=2, servers=1)
