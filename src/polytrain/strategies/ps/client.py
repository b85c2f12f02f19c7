"""A worker's side of the parameter servers: pull the parameters into the local model, push gradients.

Values travel through CPU buffers (one per server, laid out by the plan), so the model may live on a GPU
while gloo carries the bytes. Each call talks to every server at once: headers to all, then values.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from polytrain.distributed.p2p import HEADER_LEN, Channel, header
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
        self._send(INIT, self._values(self.params))

    def pull(self, clock: int) -> list[int]:
        """Wait until every server lets this worker start ``clock``; load the values into the model.
        Returns each server's version (global clock) of the values."""
        return self._ask(PULL, clock)

    def push(self, clock: int) -> None:
        """Send this worker's gradients of step ``clock`` (missing gradients count as zero)."""
        grads = {name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in self.params.items()}
        self._send(PUSH, self._values(grads), clock)

    def read(self) -> list[int]:
        """The servers' current values into the model, whatever the clocks (for saving or evaluating)."""
        return self._ask(READ, 0)

    def done(self) -> None:
        """This worker will send nothing more; a server ends once every worker said so."""
        self._send(DONE, None)

    # -- helpers ----------------------------------------------------------------------------------------

    def _values(self, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        cpu = {name: t.detach().to("cpu") for name, t in tensors.items()}
        return [self.plan.flatten(cpu, s, out=self.buffers[s]) for s in range(self.plan.servers)]

    def _send(self, kind: int, values: list[torch.Tensor] | None, clock: int = 0) -> None:
        """A header (and values) to every server, all posted at once."""
        me = self.channel.rank
        sends = []
        for s, rank in enumerate(self.layout.server_ranks):
            sends.append((header(kind, me, clock, self.versions[s]), rank, TAG_REQUEST))
            if values is not None and values[s].numel():
                sends.append((values[s], rank, TAG_REQUEST_DATA))
        self.channel.exchange(sends=sends)

    def _ask(self, kind: int, clock: int) -> list[int]:
        """Post every server's answer's receives first, then ask: no server ever waits for us to listen."""
        heads = [torch.empty(HEADER_LEN, dtype=torch.int64) for _ in self.layout.server_ranks]
        recvs = []
        for s, rank in enumerate(self.layout.server_ranks):
            recvs.append((heads[s], rank, TAG_REPLY))
            if self.buffers[s].numel():
                recvs.append((self.buffers[s], rank, TAG_REPLY_DATA))
        sends = [(header(kind, self.channel.rank, clock, 0), rank, TAG_REQUEST) for rank in self.layout.server_ranks]
        self.channel.exchange(sends=sends, recvs=recvs)
        for s, rank in enumerate(self.layout.server_ranks):
            answer, _, version, updates = heads[s].tolist()
            if answer != REPLY:
                raise CommunicationError(f"{self.channel.me}: {self.layout.name(rank)} answered with message "
                                         f"kind {answer} instead of a reply")
            self.versions[s], self.updates[s] = version, updates
            self.plan.unflatten(self.buffers[s], s, self.params)
        return list(self.versions)
