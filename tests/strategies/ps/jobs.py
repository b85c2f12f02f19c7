"""Module-level job functions for the parameter-server tests (spawned workers import them by name)."""

from __future__ import annotations

import os
import random
import time

import torch
import torch.nn.functional as F
from torch import nn

from polytrain.distributed.p2p import Channel
from polytrain.strategies.ps import Ranks, ParameterClient, ParameterServer, PartitionPlan, StalenessPolicy

LR = 0.1


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(worker: int, clock: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * worker + clock)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)


def plan_for(model: nn.Module, servers: int) -> PartitionPlan:
    return PartitionPlan.for_model(model.named_parameters(), servers, min_split=1)


class DyingSGD(torch.optim.SGD):
    """A server whose process ends abruptly at its third update."""

    def step(self, closure=None):
        self.count = getattr(self, "count", 0) + 1
        if self.count == 3:
            os._exit(1)
        return super().step(closure)


class HangingSGD(torch.optim.SGD):
    """A server that stops answering at its third update (alive, but never comes back in time)."""

    def step(self, closure=None):
        self.count = getattr(self, "count", 0) + 1
        if self.count == 3:
            time.sleep(120)
        return super().step(closure)


OPTIMIZERS = {"sgd": torch.optim.SGD, "dying": DyingSGD, "hanging": HangingSGD}


def ps_job(ctx, cfg: dict):
    """cfg: workers, servers, steps, bound, scale, timeout, optimizer, sleep (s, max per step), duplicate,
    device (the workers' model)."""
    layout = Ranks(cfg["workers"], cfg["servers"])
    channel = Channel(ctx.topology.group, cfg.get("timeout", 30), layout.name, me=layout.name(ctx.rank))
    model = make_model()
    plan = plan_for(model, layout.servers)
    if cfg.get("device") and layout.role(ctx.rank) == "trainer":
        model.to(cfg["device"])  # the wire stays on CPU buffers whatever the model's device
    if layout.role(ctx.rank) == "server":
        optimizer = OPTIMIZERS[cfg.get("optimizer", "sgd")]
        server = ParameterServer(channel, layout, plan, StalenessPolicy(cfg.get("bound")),
                                 lambda params: optimizer(params, lr=LR), scale=cfg.get("scale", 1.0))
        summary = server.serve()
        return {**summary, "values": server.flat.clone()}
    return _train(ParameterClient(channel, layout, plan, model), model, ctx.rank, cfg)


def _train(client: ParameterClient, model: nn.Module, rank: int, cfg: dict) -> dict:
    rng = random.Random(f"{rank}-{cfg.get('bound')}")
    if rank == 0:
        client.send_initial()
    versions = []
    for clock in range(cfg["steps"]):
        versions.append(client.pull(clock))
        x, y = (t.to(cfg.get("device", "cpu")) for t in batch(rank, clock))
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        if cfg.get("sleep"):
            time.sleep(rng.uniform(0, cfg["sleep"]))
        client.push(clock)
        if cfg.get("duplicate") == clock:
            client.push(clock)  # a retried push: must not be applied twice
    read = None
    if cfg["workers"] == 1:
        client.read()
        read = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
    client.done()
    return {"versions": versions, "read": read}


def gather(results: list, cfg: dict) -> dict[str, torch.Tensor]:
    """The servers' final values, assembled into the model's tensors."""
    model = make_model()
    plan = plan_for(model, cfg["servers"])
    out = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    for server in results[cfg["workers"]:]:
        plan.unflatten(server["values"], server["server"], out)
    return out


def reference(workers: int, steps: int) -> dict[str, torch.Tensor]:
    """In-process: every step, each worker's gradient on the same parameters, averaged, one SGD step."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for clock in range(steps):
        grads = []
        for worker in range(workers):
            model.zero_grad()
            x, y = batch(worker, clock)
            F.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = sum(gs) / workers
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}
