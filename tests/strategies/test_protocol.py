"""The Strategy protocol carries a parameter server and a pipeline: two strategies written here alone, with
plain torch.distributed send/recv, train through ``polytrain.fit`` with no change to the trainer.

``ServerAveraging``: ``--workers 2`` gives 2 trainer ranks and 1 server rank (its layout says so); the
trainers push their gradients, the server (a rank with a loop of its own) averages them, updates its
parameters and sends them back. ``TwoStages``: ``--workers 1`` gives a pipeline of 2 processes, the model's
first half on rank 0 and its second half (and the loss) on rank 1, on the ``pp`` axis. Both end equal to
``single`` on the same global batches.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import re
import textwrap
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

import polytrain
from polytrain.data.base import DataBundle, TensorData
from polytrain.distributed.layout import Layout
from polytrain.strategies import Strategy
from polytrain.strategies.step import StepResult, forward_backward
from polytrain.strategies.traits import Traits

_TIMEOUT = timedelta(seconds=60)


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _wait(work) -> None:
    work.wait(_TIMEOUT)


class ServerAveraging(Strategy):
    name = "test-server-averaging"

    @classmethod
    def layout(cls, workers, options=None):  # the trainers, then one server rank
        n = workers or 2
        return Layout(cls.name, ("trainer",) * n + ("server",), (("dp", n),), n)

    def prepare(self, model, make_optimizer, recipe=None, place=None):
        self.server = self.layout.processes - 1
        if self.layout.role(self.topology.rank) == "server":
            self.own_loop = self  # this rank runs run() below instead of the trainer's loop
        return super().prepare(model, make_optimizer, recipe, place)

    def train_step(self, batch, lr):
        self._set_lr(lr)  # (the server's optimizer steps at its own lr)
        self.optimizer.zero_grad(set_to_none=True)
        loss = forward_backward(self.model, batch, self.recipe.task, self.server, 1, self._grad_sync, self._backward)
        params = list(self.model.parameters())
        _wait(dist.isend(torch.ones(1), self.server))  # 1: gradients follow
        _wait(dist.isend(_flat(p.grad for p in params), self.server))
        fresh = torch.empty_like(_flat(params))
        _wait(dist.irecv(fresh, self.server))
        torch.nn.utils.vector_to_parameters(fresh, params)
        return StepResult(loss, len(batch))

    def finish(self) -> None:
        _wait(dist.isend(torch.zeros(1), self.server))  # 0: this trainer is done

    def run(self, source):
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

    @classmethod
    def layout(cls, workers, options=None):  # D replicas of a pipeline of 2 stages
        dp = workers or 1
        return Layout(cls.name, ("trainer",) * (2 * dp), (("dp", dp), ("pp", 2)), dp)

    @property
    def stage(self) -> int:
        return self.topology.axis_rank("pp")

    def _wrap(self, model: nn.Module) -> nn.Module:
        self.whole = model
        halves = (model[:2], model[2:])  # both ranks built the same model from the same seed
        return halves[self.stage].to(self.topology.device)

    def _unwrap(self, model):
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

    def train_step(self, batch, lr):
        self._set_lr(lr)
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

    def state_dict(self, optimizer=True):
        parts = self.trainers.all_gather_object({k: v.detach() for k, v in self.whole.state_dict().items()})
        whole = {**parts[0]}
        whole.update({k: v for k, v in parts[1].items() if k.startswith("2.")})  # stage 1's layer
        return {"model": whole, "optimizer": self.optimizer.state_dict()} if self.trainers.is_main else None


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


def test_the_trainer_never_asks_which_strategy_it_has_nor_what_a_rank_is_for():
    train = os.path.join(os.path.dirname(polytrain.__file__), "train")
    names = [f'"{name}"' for name in polytrain.available_strategies()] + ["SyncDataParallel", "SingleDevice"]
    for file in sorted(os.listdir(train)):
        if file.endswith(".py"):
            text = open(os.path.join(train, file)).read()
            found = [name for name in names if name in text] + re.findall(r"isinstance\([^)]*Strategy", text)
            found += re.findall(r"\broles?\b", text)
            assert not found, f"train/{file} mentions {found}"


#: every public name of the Strategy class, each strategy has it: methods, properties, class attributes and the
#: attributes set on an instance. What only some strategies do is a capability among them, None where absent
PROTOCOL = {
    "layout", "check",  # before anything starts (an instance's ``layout`` is the one the class gave)
    "prepare", "module", "train_step", "eval_step", "finish", "describe",  # the model and its step
    "take_metrics", "summary_metrics",  # numbers of its own
    "state_dict", "load_state_dict", "local_state",  # the whole model's state, and this rank's own
    "name", "summary", "config_section", "traits",  # declared by the class
    "options", "topology", "trainers", "model", "optimizer", "recipe", "traffic", "amp", "phase",  # set up
    "own_loop", "out_of_order", "rebalancing", "sharded_state", "held_state", "healing",  # capabilities
}

#: the public names a strategy class (or a mixin of it) adds of its own: no code outside it calls them (train/
#: reads only the protocol: below), and a new one is added here on purpose or made private
OWN = {
    "polytrain.strategies.ps.strategy.AsyncParameterServer": {
        "channel", "client", "clock", "plan", "policy", "ranks", "server", "source", "state_format", "step",
        "tolerant"},
    "polytrain.strategies.periodic.Diloco": {"exchange", "outer", "outer_lr", "outer_momentum"},
    "polytrain.parallel.pp.strategy.Pipeline": {
        "info", "me", "mine", "modules", "num_stages", "owned", "ranks", "replicas", "schedule", "sharded", "split",
        "stage_objects", "tp"},
    "polytrain.parallel.pp.traced_run.TracedRun": {"is_traced", "owned", "split"},
    "polytrain.parallel.pp.replicas.StageReplicas": {"owned"},
    "polytrain.strategies.sync.SyncDataParallel": {"compression_state"},
    "polytrain.parallel.tp.strategy.TensorParallel": {"plan"},
}


def _self_attributes(tree: ast.AST, owner: str = "self") -> set[str]:
    """The public attributes ``owner.X = ...`` (or ``+=``, ``: T =``, in a tuple) sets anywhere in ``tree``."""
    found = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(t, ast.Attribute) and _ident(t.value) == owner and not t.attr.startswith("_"):
                    found.add(t.attr)
    return found


def _ident(node: ast.AST) -> str:
    """The name an expression ends in: ``a.b.strategy`` is ``strategy``, ``get_strategy(x)`` ``get_strategy``."""
    if isinstance(node, ast.Call):
        return _ident(node.func)
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def public_names(klass: type) -> set[str]:
    """Every public name ``klass`` itself defines: its methods, properties and class attributes, and the
    attributes its methods set on an instance."""
    source = textwrap.dedent(inspect.getsource(klass))
    return {n for n in vars(klass) if not n.startswith("_")} | _self_attributes(ast.parse(source))


def test_the_strategy_protocol_is_every_public_name_its_test_lists():
    assert public_names(Strategy) == PROTOCOL
    seen = {}
    for name in polytrain.available_strategies():  # each class and mixin of a registered strategy
        for klass in polytrain.get_strategy(name).__mro__[:-1]:
            if klass is not Strategy:
                seen[f"{klass.__module__}.{klass.__qualname__}"] = public_names(klass) - PROTOCOL
    added = {cls: sorted(names - OWN.get(cls, set())) for cls, names in seen.items() if names - OWN.get(cls, set())}
    assert not added, f"public names not in the protocol's test: {added} (make them private, or list them)"
    gone = {cls: sorted(names - seen.get(cls, set())) for cls, names in OWN.items() if names - seen.get(cls, set())}
    assert not gone, f"listed but no longer there: {gone}"


def test_the_count_sees_instance_attributes_and_mixins():
    class Mixin:
        def helper(self):
            self.found, self._private = 1, 2

    class Extended(Mixin, Strategy):
        shown = True

        def prepare(self, model, make_optimizer, recipe=None, place=None):
            self.extra: int = 3
            return super().prepare(model, make_optimizer, recipe, place)

    assert public_names(Extended) == {"shown", "prepare", "extra"} and public_names(Mixin) == {"helper", "found"}


TRAIN = os.path.join(os.path.dirname(polytrain.__file__), "train")
#: what a strategy declares (polytrain.strategies.traits.Traits), and the names the probes had before it
TRAITS = {f.name for f in dataclasses.fields(Traits)} | {"also_reads", "is_traced"}


def test_train_reads_only_the_protocol_of_a_strategy_and_probes_none():
    """Every ``<...strategy>.X`` in train/ (``strategy``, ``self.strategy``, ``get_strategy(...)``,
    ``strategy_cls``, ...) is a protocol name; no getattr/hasattr/setattr/vars of a strategy, and no getattr of a
    trait's name on anything."""
    found = []
    for file in sorted(os.listdir(TRAIN)):
        if not file.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(open(os.path.join(TRAIN, file)).read())):
            if isinstance(node, ast.Attribute) and "strategy" in _ident(node.value) and node.attr not in PROTOCOL:
                found.append(f"train/{file}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.Call) and _ident(node.func) in ("getattr", "hasattr", "setattr", "delattr", "vars"):
                obj, attr = node.args[0], node.args[1] if len(node.args) > 1 else None
                named = isinstance(attr, ast.Constant) and attr.value in TRAITS
                if "strategy" in _ident(obj) or named:
                    found.append(f"train/{file}:{node.lineno} {ast.unparse(node)}")
    assert not found, f"train/ reads what is not the strategy protocol: {found}"


def test_train_builds_and_prepares_a_strategy_in_one_place():
    """A start and the elastic rebuild after a membership change make a strategy through the same functions:
    train/ constructs one (``strategy_cls(...)``) and calls its ``prepare`` only in session.py's."""
    found = []
    for file in sorted(os.listdir(TRAIN)):
        if not file.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(open(os.path.join(TRAIN, file)).read())):
            if isinstance(node, ast.FunctionDef):
                for call in ast.walk(node):
                    if not isinstance(call, ast.Call):
                        continue
                    prepares = isinstance(call.func, ast.Attribute) and call.func.attr == "prepare" and                         "strategy" in _ident(call.func.value)
                    if prepares or _ident(call.func) in ("strategy_cls", "_cls"):  # (elastic's was self._cls(...))
                        found.append(f"{file}:{node.name}:{_ident(call.func)}")
    assert sorted(found) == ["session.py:make_strategy:strategy_cls", "session.py:prepare_strategy:prepare"], found

