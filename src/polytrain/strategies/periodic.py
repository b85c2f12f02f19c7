"""``local-sgd`` and ``diloco``: every worker trains its own replica, and the replicas meet every H steps.

Each worker steps its own optimizer (``--optimizer``, the *inner* one) on its slice of every global batch,
exchanging nothing; every ``--sync-every H`` global steps the workers all-reduce their parameters over the
trainers' process group (no DDP, no per-step exchange), which is H times fewer bytes than ``sync``:

* ``local-sgd`` (Stich 2019; Lin et al. 2020) replaces every replica by the average.
* ``diloco`` (Douillard et al. 2023) keeps the parameters of the last meeting (the *anchor*), takes
  ``delta = anchor - average`` as a gradient and steps the anchor with outer SGD with Nesterov momentum
  (``--outer-lr``, ``--outer-momentum``); every worker starts the next round from the new anchor.

With H = 1 and inner plain SGD both equal ``sync`` (the average of N steps from one point is one step along
the averaged gradient; diloco with outer lr 1 and no momentum lands on that average). Floating-point
buffers (BatchNorm statistics) are averaged at each meeting too; clipping (``--clip-grad-norm``) clips
each worker's own gradient, since there is no global one.

Sync points are the global steps that are multiples of H, counted from step 0, so a resumed run meets at
the same steps as an uninterrupted one. Between meetings the replicas differ: evaluation scores each
worker's replica on its slice of the test set, and the whole model that is saved (checkpoint, --save-model)
is the average of the replicas (one extra all-reduce; at a meeting they are already equal). A
checkpoint also holds rank 0's inner optimizer state (loaded by every worker on resume: the others' inner
momentum is not kept) and, for diloco, the anchor and the outer momentum. Resuming mid-round therefore
starts every worker from the average of the replicas at the checkpoint, with the round's anchor, so the
next outer step still measures the change since the last meeting.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from polytrain.data.batches import Batch
from polytrain.distributed.layout import Layout
from polytrain.errors import ConfigError
from polytrain.phases import phase
from polytrain.strategies.base import Strategy
from polytrain.strategies.registry import register_strategy
from polytrain.strategies.step import StepResult
from polytrain.strategies.periodic_config import (DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM, DilocoDeclared,
                                                 LocalSGDDeclared, PeriodicConfig)
from polytrain.strategies.streaming import OuterExchange
from polytrain.parallel.dtensor import average, full, like, load_whole, local, shard_of, whole_state

def default_outer_momentum(optimizer: torch.optim.Optimizer, outer_lr: float = DEFAULT_OUTER_LR) -> tuple[float, str]:
    """diloco's outer momentum when ``--outer-momentum`` is not given, chosen from the inner optimizer, and
    why (the start-up line says it). Over an inner momentum (SGD or RMSprop with momentum > 0): 1 - outer lr
    (0.3 at the default 0.7), so that an outer step's long-run gain, outer lr / (1 - momentum), is 1 -- the
    average's own move, the inner momentum already accelerating; the paper's 0.9 on top of inner SGD momentum
    0.9 ended at 0.86 test accuracy on digits_cnn in 240 steps and diverged in 480 (docs/async.md). Otherwise
    the paper's 0.9 (its own setting: an Adam inner optimizer; plain SGD)."""
    inner = max((float(group.get("momentum") or 0.0) for group in optimizer.param_groups), default=0.0)
    if inner > 0 and not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        momentum = round(max(0.0, 1.0 - outer_lr), 6)
        return momentum, (f"1 - outer lr over inner momentum {inner:g} (the paper's {DEFAULT_OUTER_MOMENTUM:g} "
                          f"compounds with it)")
    return DEFAULT_OUTER_MOMENTUM, "the paper's default"


@register_strategy
class LocalSGD(LocalSGDDeclared, Strategy):

    def __init__(self, topology: Any, options: PeriodicConfig | None = None, layout: Layout | None = None):
        super().__init__(topology, options, layout)
        self._dirty = False  # steps taken since the replicas last met: they may differ

    def describe(self) -> str:
        return f"{super().describe()}, each worker its own optimizer; {self._meeting()} every " \
               f"{self.options.sync_every} step(s)"

    def _meeting(self) -> str:
        return "parameters averaged"

    def _materialize(self, model: nn.Module) -> nn.Module:
        return model if self._sharded() else super()._materialize(model)  # sharded: unit by unit in _wrap

    def _sharded(self) -> bool:
        return self.topology.axis_size("dp_shard") > 1

    def _wrap(self, model: nn.Module) -> nn.Module:
        from polytrain.parallel.fsdp import shard_model

        topo = self.topology
        if self._sharded():  # each replica fsdp-sharded over its dp_shard ranks (FSDP, not HSDP: they meet here)
            model = shard_model(model, topo, topo.submesh("dp_shard"))
        else:
            model = model.to(topo.device)
        group, size = self._replicas()
        if size > 1:  # start from replica 0's parameters, as DDP does (not counted: start-up only)
            for tensors in _by_dtype([local(t) for t in list(model.parameters()) + list(model.buffers())]).values():
                flat = _flatten_dense_tensors([t.detach() for t in tensors])
                dist.broadcast(flat, src=dist.get_global_rank(group, 0), group=group)
                for t, value in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
                    t.data.copy_(value)
        return model

    def _replicas(self) -> tuple[Any, int]:
        """The group the replicas meet in (the ranks of this one's coordinate in every other replica) and its size."""
        size = self.topology.axis_size("dp_replicate")
        return (self.topology.axis_group("dp_replicate") if size > 1 else None), size

    def _grad_sync(self, model: nn.Module, enabled: bool) -> Any:
        from polytrain.parallel.fsdp import gradient_sync

        return gradient_sync(model, enabled)  # --accumulate over a sharded replica: reduce-scattered once

    # -- the step ----------------------------------------------------------------------------------

    def train_step(self, batch: Batch, lr: float) -> StepResult:
        result = super().train_step(batch, lr)  # forward, backward and this worker's own optimizer step
        self._dirty = True
        if self.layout.meets_at(batch.step + 1):
            started = time.perf_counter()
            with torch.no_grad(), self.phase("sync"), phase("exchange"):
                self._meet()
            self._dirty = False
            # the meeting's all-reduce: exchanging parameters and waiting for the slowest worker's round
            result.wait_s += time.perf_counter() - started
        return result

    def _meet(self) -> None:
        """The meeting: every replica becomes the average."""
        self._average_into(self._synced(self.module))

    def _synced(self, model: nn.Module) -> list[torch.Tensor]:
        """What the replicas exchange at a meeting: the parameters and the floating-point buffers (BatchNorm
        statistics; integer ones such as its step counter are equal on every worker anyway), each rank's shard of
        them."""
        return [local(t) for t in list(model.parameters()) + list(model.buffers()) if t.is_floating_point()]

    def _average_into(self, tensors: list[torch.Tensor]) -> None:
        """Replace ``tensors`` (this rank's shards) by their average over the replicas, in place: one
        all-reduce per dtype."""
        group, size = self._replicas()
        if not self.topology.distributed or size < 2:
            return
        for kind in _by_dtype(tensors).values():
            self.traffic.all_reduce(average(kind, group, size), size)

    # -- the whole model ---------------------------------------------------------------------------

    @torch.no_grad()
    def state_dict(self, optimizer: bool = True) -> dict[str, Any] | None:
        model = self.module.state_dict()
        if self._dirty:  # mid-round: the average of the replicas, leaving each worker's own untouched
            model = {k: v.detach().clone() for k, v in model.items()}
            self._average_into([local(v) for v in model.values() if v.is_floating_point()])
        assert self.optimizer is not None
        if self._sharded():  # each replica's shards gathered whole (a collective over its dp_shard ranks)
            model, held = whole_state(self.module, self.optimizer, optimizer, model)
            return {"model": model, **({"optimizer": held} if optimizer else {})} if self.trainers.is_main else None
        if not self.trainers.is_main:
            return None
        return {"model": model, **({"optimizer": self.optimizer.state_dict()} if optimizer else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._sharded():  # each tensor cut into this rank's shard
            assert self.optimizer is not None
            return load_whole(self.module, self.optimizer, state)
        super().load_state_dict(state)


@register_strategy
class Diloco(DilocoDeclared, LocalSGD):

    def __init__(self, topology: Any, options: PeriodicConfig | None = None, layout: Layout | None = None):
        super().__init__(topology, options, layout)
        opts = self.options
        self.outer_lr = DEFAULT_OUTER_LR if opts.outer_lr is None else opts.outer_lr
        #: None until prepare() chooses it from the inner optimizer (default_outer_momentum), when not given
        self.outer_momentum: float | None = opts.outer_momentum
        self._outer_momentum_why = ""
        self._anchor: list[torch.Tensor] = []
        self.outer: torch.optim.Optimizer | None = None
        self.exchange: OuterExchange | None = None

    @classmethod
    def check(cls, layout: Layout, config: Any, model: nn.Module | None) -> None:
        super().check(layout, config, model)
        opts = config.periodic
        if opts.fragments > opts.sync_every:
            raise ConfigError(f"--fragments {opts.fragments} is more than --sync-every {opts.sync_every}: fragments "
                              "meet at different steps of each H-step round; give --fragments <= --sync-every")
        if opts.overlap_steps >= opts.sync_every:
            raise ConfigError(f"--overlap-steps {opts.overlap_steps} must be below --sync-every {opts.sync_every} (a "
                              "fragment's exchange ends before it meets again)")
        if opts.outer_error_feedback and opts.outer_quantize == "off":
            raise ConfigError("--outer-error-feedback keeps what --outer-quantize rounds off, and it is off; give "
                              "--outer-quantize int8 or int4, or drop --outer-error-feedback")
        if opts.outer_error_feedback and layout.axis("dp_shard") > 1:
            raise ConfigError(f"--outer-error-feedback with --dp-shard {layout.axis('dp_shard')}: what rounding left "
                              "out is kept per rank, and a checkpoint keeps one rank's; drop one of them")

    def _meeting(self) -> str:
        momentum = "?" if self.outer_momentum is None else f"{self.outer_momentum:g}"
        why = f": {self._outer_momentum_why}, --outer-momentum sets it" if self._outer_momentum_why else ""
        text = f"outer SGD step (lr {self.outer_lr:g}, Nesterov momentum {momentum}{why})"
        streaming = self.exchange.describe() if self.exchange is not None else ""
        return f"{text}; {streaming};" if streaming else text

    def prepare(self, model: nn.Module, make_optimizer: Any, recipe: Any = None, place: Any = None) -> nn.Module:
        prepared = super().prepare(model, make_optimizer, recipe, place)
        # the anchor: the parameters every worker started this round from (its shard of them); the outer
        # optimizer steps it
        self._anchor = [local(p).detach().clone() for p in self.module.parameters()]
        if self.outer_momentum is None:
            assert self.optimizer is not None
            self.outer_momentum, self._outer_momentum_why = default_outer_momentum(self.optimizer, self.outer_lr)
        self.outer = torch.optim.SGD(self._anchor, lr=self.outer_lr, momentum=self.outer_momentum,
                                     nesterov=self.outer_momentum > 0)
        opts = self.options
        try:
            self.exchange = OuterExchange(self, opts.fragments, opts.overlap_steps, opts.overlap_mix,
                                          opts.outer_quantize, opts.outer_error_feedback)
        except ValueError as exc:
            raise ConfigError(f"--fragments {opts.fragments}: {exc}; give fewer fragments") from None
        return prepared

    def train_step(self, batch: Batch, lr: float) -> StepResult:
        result = Strategy.train_step(self, batch, lr)  # forward, backward and this worker's own optimizer step
        self._dirty = True
        exchange, done = self.exchange, batch.step + 1
        assert exchange is not None
        if exchange.busy_after(done):
            with torch.no_grad(), self.phase("sync"), phase("exchange"):
                # the meetings' exchanges, and waiting for the slowest worker (or for an overlapped exchange)
                result.wait_s += exchange.after_step(done)
            self._dirty = not exchange.all_met(done)
        return result

    def finish(self) -> None:
        super().finish()
        if self.exchange is not None:
            with torch.no_grad():
                self.exchange.settle()

    def _meet(self) -> None:
        params = [local(p) for p in self.module.parameters()]
        super()._meet()  # the replicas' average (buffers: just averaged)
        for anchor, averaged in zip(self._anchor, params):
            anchor.grad = anchor - averaged  # the round's outer "gradient": how far the average moved, negated
        assert self.outer is not None
        self.outer.step()
        for anchor, param in zip(self._anchor, params):
            param.data.copy_(anchor)
            anchor.grad = None

    def state_dict(self, optimizer: bool = True) -> dict[str, Any] | None:
        if self.exchange is not None and self.exchange.pending:  # an overlapped exchange: applied now
            with torch.no_grad():
                self.exchange.settle()
        state = super().state_dict(optimizer)
        if optimizer and self._sharded():  # the anchor and outer momentum whole (collectives: every rank)
            outer = self._whole_outer()
        elif state is not None and optimizer:
            assert self.outer is not None
            outer = {"anchor": [a.detach().clone() for a in self._anchor], "optimizer": self.outer.state_dict()}
        if state is not None and optimizer:
            state["outer"] = outer
            if self.exchange is not None and self.exchange.errors:
                state["outer"]["exchange"] = self.exchange.state()
        return state

    def local_state(self) -> dict[str, Any]:
        assert self.outer is not None
        return {**super().local_state(), "outer": {"anchor": list(self._anchor), "optimizer": self.outer.state_dict()}}

    def _whole_outer(self) -> dict[str, Any]:
        """The anchor and the outer optimizer's state, each shard gathered whole (a collective over dp_shard)."""
        assert self.outer is not None
        params = list(self.module.parameters())
        held = self.outer.state_dict()
        return {"anchor": [full(shard_of(a, p)) for a, p in zip(self._anchor, params)],
                "optimizer": {**held, "state": {i: {k: full(shard_of(v, params[int(i)])) if torch.is_tensor(v) and
                                                     k != "step" else v for k, v in per.items()}
                                                for i, per in held["state"].items()}}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        params = list(self.module.parameters())
        outer = state.get("outer")  # a checkpoint of another strategy: this round starts from its model
        with torch.no_grad():
            for anchor, source, param in zip(self._anchor, outer["anchor"] if outer else params, params):
                anchor.copy_(local(like(source, param)) if outer else local(source))
        if outer:
            assert self.outer is not None
            held = outer["optimizer"]
            self.outer.load_state_dict({**held, "state": {
                i: {k: local(like(v, params[int(i)])) if torch.is_tensor(v) and k != "step" else v
                    for k, v in per.items()} for i, per in held["state"].items()}})
            if self.exchange is not None:
                self.exchange.load(outer.get("exchange"))


def _by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups
