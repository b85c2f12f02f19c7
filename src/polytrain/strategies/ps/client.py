"""A worker's side of the parameter servers: pull the parameters into the local model, push gradients.

Values travel through CPU buffers (one per server, laid out by the plan), so the model may live on a GPU
while gloo carries the bytes. Each call talks to every server at once: headers to all, then values.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from polytrain.distributed.p2p import Channel, header
from polytrain.errors import CommunicationError
from polytrain.strategies.ps.layout import (DONE, INIT, PULL, PUSH, READ, REPLY, TAG_REPLY, TAG_REPLY_DATA,
                                            TAG_REQUEST, TAG_REQUEST_DATA, Layout)
from polytrain.strategies.ps.partition import PartitionPlan


class ParameterClient:
    def __init__(self, channel: Channel, layout: Layout, plan: PartitionPlan, model: nn.Module):
        self.channel = channel
        self.layout = layout
        self.plan = plan
        self.params: dict[str, nn.Parameter] = dict(model.named_parameters())
        dtype = next(iter(self.params.values())).dtype
        self.buffers = [torch.empty(plan.numel(s), dtype=dtype) for s in range(plan.servers)]
        self.versions = [0] * plan.servers  # per server: the global clock of the values last pulled
        self.updates = [0] * plan.servers  # per server: updates applied when they were pulled

    # -- calls ------------------------------------------------------------------------------------------

    def send_initial(self) -> None:
        """First worker only, before anyone's first pull: the model's values become the servers' values."""
        self._send_all(INIT, 0, 0, self._values(self.params))

    def pull(self, clock: int) -> list[int]:
        """Wait until every server lets this worker start ``clock``; load the values into the model.
        Returns each server's version (global clock) of the values."""
        self._headers(PULL, clock, 0)
        return self._receive_values()

    def push(self, clock: int) -> None:
        """Send this worker's gradients of step ``clock`` (missing gradients count as zero)."""
        grads = {name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in self.params.items()}
        values = self._values(grads)
        self.channel.send_many([(header(PUSH, self.channel.rank, clock, self.versions[s]), rank)
                                for s, rank in enumerate(self.layout.server_ranks)], TAG_REQUEST)
        self._send_values(values)

    def read(self) -> list[int]:
        """The servers' current values into the model, whatever the clocks (for saving or evaluating)."""
        self._headers(READ, 0, 0)
        return self._receive_values()

    def done(self) -> None:
        """This worker will send nothing more; a server ends once every worker said so."""
        self._headers(DONE, 0, 0)

    # -- helpers ----------------------------------------------------------------------------------------

    def _values(self, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        cpu = {name: t.detach().to("cpu") for name, t in tensors.items()}
        return [self.plan.flatten(cpu, s, out=self.buffers[s]) for s in range(self.plan.servers)]

    def _headers(self, kind: int, a: int, b: int) -> None:
        self.channel.send_many([(header(kind, self.channel.rank, a, b), rank)
                                for rank in self.layout.server_ranks], TAG_REQUEST)

    def _send_all(self, kind: int, a: int, b: int, values: list[torch.Tensor]) -> None:
        self._headers(kind, a, b)
        self._send_values(values)

    def _send_values(self, values: list[torch.Tensor]) -> None:
        self.channel.send_many([(v, rank) for v, rank in zip(values, self.layout.server_ranks) if v.numel()],
                               TAG_REQUEST_DATA)

    def _receive_values(self) -> list[int]:
        for s, rank in enumerate(self.layout.server_ranks):
            kind, _, version, updates = self.channel.recv_header(rank, TAG_REPLY)
            if kind != REPLY:
                raise CommunicationError(f"{self.channel.me}: {self.layout.name(rank)} sent an unexpected "
                                         f"message kind {kind}")
            if self.buffers[s].numel():
                self.channel.recv(self.buffers[s], rank, TAG_REPLY_DATA)
            self.versions[s], self.updates[s] = version, updates
            self.plan.unflatten(self.buffers[s], s, self.params)
        return list(self.versions)
