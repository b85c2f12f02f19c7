"""The trainer: builds data, model, strategy and optimizer from a config and runs the loop.

:class:`Trainer` runs inside one worker process (``polytrain.launch`` starts the workers). Each step:
set the scheduled LR → forward/backward on this worker's slice (``forward_backward``) → stop on a NaN/inf
loss → optimizer step → log, evaluate, checkpoint at their intervals. The
compute of each step runs inside the session's device runtime (``s.devices``): the per-operator placement
log on the first step(s) with ``--log-placement``, the CPU fallback with ``--soft-placement``, and errors
naming the device of an operator it lacks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from polytrain.data.base import DataBundle
from polytrain.data.batches import ShardedBatches, eval_batches
from polytrain.distributed.topology import Topology
from polytrain.options import option
from polytrain.train import session
from polytrain.train.checkpoint import atomic_save
from polytrain.train.loggers import RunLog
from polytrain.train.metrics import IntervalMeter, check_finite
from polytrain.train.optim import set_lr
from polytrain.train.step import forward_backward

if TYPE_CHECKING:
    from polytrain.config import RunConfig


@dataclass
class TrainConfig:
    strategy: str = option("sync", "parallel strategy: single | sync", metavar="NAME")
    steps: int | None = option(None, "optimizer steps to train (or --epochs)", minimum=1, metavar="N")
    epochs: int | None = option(10, "passes over the training set (or --steps)", minimum=1, metavar="E")
    accumulate: int = option(1, "split each worker's batch into K micro-batches (gradient accumulation)",
                             minimum=1, metavar="K")
    seed: int = option(0, "random seed (same seed, device and strategy: same loss trajectory)", minimum=0)
    eval_every: int = option(100, "evaluate on the test split every N steps (0: only at the end)", minimum=0,
                             metavar="N")
    eval_batch_size: int = option(256, "examples per evaluation batch per worker", minimum=1, metavar="N")
    save_model: str | None = option(None, "write the trained model's state_dict here (torch.save)",
                                    metavar="FILE")
    deterministic: bool = option(False, "use only deterministic algorithms (slower on GPU)")


class Trainer:
    """Trains one model as ``config`` says, in this worker process."""

    def __init__(self, config: "RunConfig", topology: Topology | None = None, *,
                 model: nn.Module | None = None, data: DataBundle | None = None):
        self.config = config
        self.topology = topology or Topology()
        self.s = session.build(config, self.topology, model=model, data=data)

    def fit(self) -> dict[str, Any]:
        s, cfg = self.s, self.config
        started = time.perf_counter()
        run_log = RunLog(cfg.log, s.total_steps, enabled=self.topology.is_main)
        try:
            run_log.start(s.config_flat, s.config_toml, s.start_step)
            run_log.info(s.describe())
            summary = self._loop(run_log)
            summary["wall_s"] = round(time.perf_counter() - started, 3)
            run_log.end(summary)
            return summary
        finally:
            run_log.close()

    def _loop(self, run_log: RunLog) -> dict[str, Any]:
        s, cfg, topo = self.s, self.config, self.topology
        batches = iter(ShardedBatches(s.data.train, s.plan, s.step_shards, topo.device, s.start_step,
                                      cfg.data.data_workers))
        equal_slice = s.plan.global_batch // s.shard.count
        meter, totals = IntervalMeter(), IntervalMeter()
        self._loop_started = time.perf_counter()
        last_eval: tuple[float, float | None] | None = None
        last_interval_loss: float | None = None
        step = s.start_step
        while step < s.total_steps:
            lr = s.schedule(step)
            set_lr(s.optimizer, lr)
            tick = time.perf_counter()
            _, inputs, targets = next(batches)
            s.optimizer.zero_grad(set_to_none=True)
            with s.devices.step_context(step):
                local_loss = forward_backward(s.model, inputs, targets, s.task, s.strategy, cfg.train.accumulate,
                                              equal_slice)
                with s.devices.phase("loss"):
                    # checked here, on each rank, without a collective: the averaged gradients carry a NaN
                    # to every rank, and the first rank to see one stops the job. The average over ranks
                    # is taken when the loss is logged (a per-step all-reduce cost ~5% of a CPU step)
                    loss = local_loss.item()
                    check_finite(loss, step + 1)
                with s.devices.phase("optimizer"):
                    s.strategy.optimizer_step(s.optimizer)
            done = step + 1
            elapsed = time.perf_counter() - tick
            waited = s.strategy.take_wait_seconds()
            meter.add(len(inputs), elapsed, waited, loss)
            totals.add(len(inputs), elapsed, waited, loss)
            run_log.advance()
            step = done
            if done % cfg.log.log_every == 0 or done == s.total_steps:
                record = self._step_record(done, lr, meter)
                run_log.step(record)
                last_interval_loss = record["loss"]
                meter = IntervalMeter()
            if cfg.log.histogram_every and done % cfg.log.histogram_every == 0:
                run_log.histograms(s.strategy.unwrap(s.model), done)
            if s.data.test is not None and cfg.train.eval_every and done % cfg.train.eval_every == 0 \
                    and done != s.total_steps:
                last_eval = self._evaluate(run_log, done)
            if s.checkpointer and cfg.checkpoint.checkpoint_every and done % cfg.checkpoint.checkpoint_every == 0 \
                    and done != s.total_steps:
                self._checkpoint(done)
        if s.data.test is not None:
            last_eval = self._evaluate(run_log, step)
        if s.checkpointer:
            self._checkpoint(step)
        self._save_model()
        return self._summary(step, totals, last_interval_loss, last_eval)

    def _step_record(self, step: int, lr: float, meter: IntervalMeter) -> dict[str, Any]:
        s, topo = self.s, self.topology
        # one collective per log point for all three: each rank's rate, slice and loss (to average)
        per_rank = topo.all_gather_object((round(meter.busy_examples_per_sec(), 2), meter.mean_examples,
                                           meter.mean_loss))
        return {
            "step": step,
            "epoch": round(step / s.plan.steps_per_epoch, 4),
            # every rank ran the interval's steps; a slice's loss is already weighed by its size
            "loss": sum(loss for _, _, loss in per_rank) / len(per_rank),
            "lr": lr,
            "examples_per_sec": round(meter.steps_per_sec() * s.plan.global_batch, 2),
            "sec_per_batch": round(meter.sec_per_batch, 6),
            "rank_examples_per_sec": [rate for rate, _, _ in per_rank],
            "rank_batch": [round(examples, 2) for _, examples, _ in per_rank],
            # wall clock since the loop began, all overhead included: rates between two records are end to end
            "time_s": round(time.perf_counter() - self._loop_started, 4),
        }

    @torch.no_grad()
    def _evaluate(self, run_log: RunLog, step: int) -> tuple[float, float | None]:
        s, topo = self.s, self.topology
        model = s.model
        was_training = model.training
        model.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=topo.device)  # loss, correct, count
        for x, y in eval_batches(s.data.test, self.config.train.eval_batch_size, s.shard, topo.device):
            with s.devices.context():
                loss_sum, correct = s.task.score(model(x), y)
            sums += torch.stack([loss_sum.double().to(topo.device), correct.double().to(topo.device),
                                 torch.tensor(float(len(y)), dtype=torch.float64, device=topo.device)])
        topo.all_reduce_sum(sums)
        model.train(was_training)
        loss_sum, correct, count = sums.tolist()
        result = (loss_sum / max(count, 1), correct / max(count, 1))
        run_log.evaluation(step, *result)
        return result

    def _checkpoint(self, step: int) -> None:
        s, topo = self.s, self.topology
        state = s.state_dict(step)  # every rank: it gathers the RNG states of all ranks
        if topo.is_main:
            path = s.checkpointer.save(state, step)
            s.log.info(f"checkpoint: {path}")

    def _save_model(self) -> None:
        path = self.config.train.save_model
        if path and self.topology.is_main:
            weights = {k: v.detach().cpu() for k, v in self.s.strategy.unwrap(self.s.model).state_dict().items()}
            atomic_save(weights, path)
            self.s.log.info(f"model saved to {path}")

    def _summary(self, step: int, totals: IntervalMeter, train_loss: float | None,
                 last_eval: tuple[float, float | None] | None) -> dict[str, Any]:
        s = self.s
        eval_loss, eval_accuracy = last_eval if last_eval else (None, None)
        return {
            "steps": step,
            "train_loss": train_loss,
            "eval_loss": eval_loss,
            "eval_accuracy": eval_accuracy,
            "examples_per_sec": round(totals.steps_per_sec() * s.plan.global_batch, 2),
            "rank_examples_per_sec": self.topology.all_gather_object(round(totals.busy_examples_per_sec(), 2)),
            "strategy": self.config.train.strategy,
            "workers": self.topology.world_size,
            "global_batch": s.plan.global_batch,
        }


def train_worker(ctx: Any, config: "RunConfig", model: nn.Module | None = None,
                 data: DataBundle | None = None) -> dict[str, Any]:
    """The function ``polytrain train`` launches in every worker."""
    return Trainer(config, ctx.topology, model=model, data=data).fit()
