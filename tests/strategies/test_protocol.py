"""The Strategy protocol carries a parameter server and a pipeline: two strategies written here alone, with
plain torch.distributed send/recv, train through ``polytrain.fit`` with no change to the trainer.

``ServerAveraging``: ``--workers 2`` gives 2 trainer ranks and 1 server rank; the trainers push their
gradients, the server averages them, updates its parameters and sends them back. ``TwoStages``: ``--workers
1`` gives a pipeline of 2 processes, the model's first half on rank 0 and its second half (and the loss)
on rank 1, on the ``pp`` axis. Both end equal to ``single`` on the same global batches.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

import polytrain
from polytrain.data.base import DataBundle, TensorData
from polytrain.distributed.topology import Topology
from polytrain.strategies import Strategy
from polytrain.strategies.step import StepResult, forward_backward

_TIMEOUT = timedelta(seconds=60)


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _wait(work) -> None:
    work.wait(_TIMEOUT)


class ServerAveraging(Strategy):
    name = "test-server-averaging"
    multiprocess = True

    @classmethod
    def processes(cls, workers, options=None):
        return workers + 1  # the last rank is the server

    @classmethod
    def data_slices(cls, workers, options=None):
        return workers

    def arrange(self, topology: Topology) -> Topology:
        self.server = topology.world_size - 1
        # every rank takes part in creating the trainers' group (new_group is collective over the world)
        group = dist.new_group(list(range(self.server)), timeout=_TIMEOUT)
        if topology.rank < self.server:
            self._trainers = replace(topology, world_size=self.server, group=group)
        else:  # the server is no trainer; it builds the same session (data slice 0) and never reduces metrics
            self._trainers = replace(topology, rank=0, world_size=self.server, group=None)
        return topology

    @property
    def role(self) -> str:
        return "server" if self.topology.rank == self.server else "trainer"

    @property
    def trainers(self) -> Topology:
        return self._trainers

    def train_step(self, batch):
        self.optimizer.zero_grad(set_to_none=True)
        loss = forward_backward(self.model, batch, self.recipe.task, self.server, 1,
                                self.grad_sync, self.backward)
        params = list(self.model.parameters())
        _wait(dist.isend(torch.ones(1), self.server))  # 1: gradients follow
        _wait(dist.isend(_flat(p.grad for p in params), self.server))
        fresh = torch.empty_like(_flat(params))
        _wait(dist.irecv(fresh, self.server))
        torch.nn.utils.vector_to_parameters(fresh, params)
        return StepResult(loss, len(batch))

    def finish(self) -> None:
        _wait(dist.isend(torch.zeros(1), self.server))  # 0: this trainer is done

    def serve(self):
        params = list(self.model.parameters())
        updates, running = 0, list(range(self.server))
        while running:
            grads = []
            for rank in list(running):
                kind = torch.empty(1)
                _wait(dist.irecv(kind, rank))
                if kind.item() == 0:
                    running.remove(rank)
                    continue
                grads.append(torch.empty_like(_flat(params)))
                _wait(dist.irecv(grads[-1], rank))
            if grads:  # the server owns the update: average, step, send the parameters back
                average, offset = sum(grads) / len(grads), 0
                for p in params:
                    p.grad = average[offset:offset + p.numel()].view_as(p).clone()
                    offset += p.numel()
                self.optimizer.step()
                for rank in running:
                    _wait(dist.isend(_flat(params).detach(), rank))
                updates += 1
        return {"role": "server", "updates": updates}


class TwoStages(Strategy):
    name = "test-two-stages"
    multiprocess = True

    @classmethod
    def processes(cls, workers, options=None):
        return 2 * workers

    @classmethod
    def data_slices(cls, workers, options=None):
        return workers

    def arrange(self, topology: Topology) -> Topology:
        return topology.arranged(dp=topology.world_size // 2, pp=2)

    @property
    def stage(self) -> int:
        return self.topology.axis_rank("pp")

    def prepare_model(self, model: nn.Module) -> nn.Module:
        self.whole = model
        halves = (model[:2], model[2:])  # both ranks built the same model from the same seed
        return halves[self.stage].to(self.topology.device)

    def unwrap(self, model=None):
        return self.whole

    def _peer(self) -> int:
        return 1 - self.stage

    def _forward(self, inputs):
        """Stage 0 sends its activations; stage 1 receives them (shape first) and returns its outputs."""
        if self.stage == 0:
            hidden = self.model(inputs)
            _wait(dist.isend(torch.tensor(hidden.shape, dtype=torch.float32), self._peer()))
            _wait(dist.isend(hidden.detach(), self._peer()))
            return hidden
        shape = torch.empty(2)
        _wait(dist.irecv(shape, self._peer()))
        hidden = torch.empty(*map(int, shape.tolist()))
        _wait(dist.irecv(hidden, self._peer()))
        hidden.requires_grad_(self.model.training)
        return hidden, self.model(hidden)

    def train_step(self, batch):
        self.optimizer.zero_grad(set_to_none=True)
        loss = None
        if self.stage == 0:
            hidden = self._forward(batch.inputs)
            grad = torch.empty_like(hidden)
            _wait(dist.irecv(grad, self._peer()))
            hidden.backward(grad)
        else:
            hidden, outputs = self._forward(None)
            loss = self.recipe.task.loss(outputs, batch.targets)
            loss.backward()
            _wait(dist.isend(hidden.grad, self._peer()))
            loss = loss.detach()
        self.optimizer.step()
        return StepResult(loss, len(batch))

    @torch.no_grad()
    def eval_step(self, inputs, targets):
        if self.stage == 0:
            self._forward(inputs)
            return None
        _, outputs = self._forward(None)
        return torch.stack([v.double() for v in self.recipe.task.score(outputs, targets)])

    def model_state_dict(self):
        parts = self.trainers.all_gather_object({k: v.detach() for k, v in self.whole.state_dict().items()})
        whole = {**parts[0]}
        whole.update({k: v for k, v in parts[1].items() if k.startswith("2.")})  # stage 1's layer
        return whole if self.trainers.is_main else None

    def state_dict(self):
        model = self.model_state_dict()
        return None if model is None else {"model": model, "optimizer": self.optimizer.state_dict()}


def _data() -> DataBundle:
    gen = torch.Generator().manual_seed(3)
    inputs = torch.randn(96, 6, generator=gen)
    targets = (inputs[:, 0] > 0).long() + (inputs[:, 1] > 0).long()
    return DataBundle("toy", TensorData(inputs, targets), TensorData(inputs[:32], targets[:32]), (6,), 3)


def _model() -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _fit(tmp_path, name, strategy, workers):
    path = tmp_path / f"{name}.pt"
    summary = polytrain.fit(model=_model(), data=_data(), strategy=strategy, workers=workers, batch_size=16,
                            steps=12, lr=0.1, momentum=0.0, optimizer="sgd", eval_every=6, progress="off",
                            save_model=str(path), metrics_file=str(tmp_path / f"{name}.jsonl"), timeout=60)
    return summary, torch.load(path, weights_only=True)


@pytest.mark.parametrize("strategy, workers", [(ServerAveraging, 2), (TwoStages, 1)])
def test_a_strategy_written_in_a_test_trains_through_fit_like_single(tmp_path, strategy, workers):
    single, reference = _fit(tmp_path, "single", "single", 1)
    summary, weights = _fit(tmp_path, "other", strategy, workers)
    assert summary["strategy"].endswith(f":{strategy.__qualname__}") and summary["steps"] == 12
    assert weights.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-6)
    assert summary["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-5)
    assert summary["eval_accuracy"] == single["eval_accuracy"]
    assert summary["train_loss"] == pytest.approx(single["train_loss"], rel=1e-5)


def test_the_trainer_never_asks_which_strategy_it_has():
    train = os.path.join(os.path.dirname(polytrain.__file__), "train")
    names = [f'"{name}"' for name in polytrain.available_strategies()] + ["SyncDataParallel", "SingleDevice"]
    for file in sorted(os.listdir(train)):
        if file.endswith(".py"):
            text = open(os.path.join(train, file)).read()
            found = [name for name in names if name in text] + re.findall(r"isinstance\([^)]*Strategy", text)
            assert not found, f"train/{file} mentions {found}"
