"""The trainer: builds data, model, strategy and optimizer from a config and runs the loop.

:class:`Trainer` runs inside one worker process (``polytrain.launch`` starts the workers). A rank whose
strategy gives it a loop of its own (the ``own_loop`` capability: a parameter server, an async helper) runs
that instead. Every other rank, each step: the strategy's step on this rank's slice of the global batch at
the scheduled LR (forward, backward, exchange, update: ``strategy.train_step``) → note a NaN/inf loss on the
device → log, evaluate, checkpoint at their intervals. The trainer never asks which strategy it has, nor
what a rank is for: it asks for capabilities (:mod:`polytrain.strategies.base`).

A stop signal (SIGTERM, SIGINT, SIGHUP, SIGUSR1, to the launcher or any rank: ``ctx.stop``) ends the loop at
a step every trainer rank agrees on (:mod:`polytrain.distributed.stop`), after a checkpoint there when the run
has a checkpoint directory; the summary says so (``stopped``). A step pays one attribute read for it.

Nothing in a step waits for the device: losses are read at log points. A non-finite loss is found there
(or before anything is written: evaluation, checkpoint, saved model), over every trainer rank at once, and
the run stops naming the first bad step; no checkpoint or saved model ever holds a diverged step's
parameters. The compute of each step runs inside the session's device runtime (``session.devices``): the
per-operator placement log, the CPU fallback with ``--soft-placement``, and errors naming the device.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
from torch import nn

import polytrain.components  # noqa: F401  (a worker unpickles the config of every registered section)
from polytrain.config import RunConfig
from polytrain.data.base import DataBundle
from polytrain.data.batches import SlicedBatches
from polytrain.data.stream import StreamBatches, StreamPlan
from polytrain.distributed.layout import Layout
from polytrain.distributed.stop import StopSignal
from polytrain.distributed.topology import Topology
from polytrain.devices.soft import operator_errors
from polytrain.errors import DivergedError, RunStopped
from polytrain.strategies.step import RunSource
from polytrain.train import elastic, elastic_build, outputs, session
from polytrain.train.background import CheckpointWrites
from polytrain.train.snapshot import snapshot_due, snapshots_of
from polytrain.train.evaluation import EvalBatchSize, evaluate, saved_first
from polytrain.train.example_ids import example_ids
from polytrain.train.loggers import RunLog
from polytrain.train.memory import MemoryMeter
from polytrain.train.metrics import RATE_WINDOW, DivergenceGuard, IntervalMeter, StepMeter, first_divergence
from polytrain.train.faults import InjectedKill, TimedCheckpoints, agree_with_rank0, attempt_number
from polytrain.train.recovery import StepProgress
from polytrain.train.straggler import StragglerInjector
from polytrain.phases import phase
from polytrain.train.profile import StepProfiler
from polytrain.train.startup import seconds_since_mark

_NOTHING = contextlib.nullcontext()


#: a first step this slow is said when it ends (a long one: a large model, --compile, activation checkpointing),
#: rather than nothing until the first log point
_SLOW_FIRST_STEP_S = 5.0


class Trainer:
    """Trains one model as ``config`` says, in this worker process."""

    def __init__(self, config: RunConfig, topology: Topology | None = None, *,
                 model: nn.Module | None = None, data: DataBundle | None = None, stop: StopSignal | None = None,
                 layout: Layout | None = None, membership: Any = None):
        config, layout = elastic_build.before_build(config, layout, membership)  # --on-failure continue: a replacement
        self.config = config
        self.memory = MemoryMeter((topology or Topology()).device)  # this rank's peak from here; docs/devices.md
        ready = membership.ready_to_build if membership is not None else None
        self.session = elastic_build.build_session(config, layout, membership, lambda layout, members: session.build(
            config, members or topology or Topology(), model=model, data=data, layout=layout, before_strategy=ready))
        self.strategy = self.session.strategy
        #: the ranks that train: metrics, evaluation and the NaN guard are reduced over them
        self.topology = self.strategy.trainers
        # --straggler names global ranks (a helper's or a server's own too)
        self.straggler = StragglerInjector(config.straggler.straggler, self.strategy.topology.rank, config.train.seed)
        self.timed = TimedCheckpoints(config.restart.checkpoint_every_seconds, self.topology.is_main)
        self.kill = InjectedKill.from_env(self.strategy.topology.rank)  # tests and benchmarks only
        # --max-restarts: the attempt's progress, where the launcher reads what a restart cost (train/recovery.py)
        self.progress = StepProgress.from_env(attempt_number(), self.topology.is_main)
        self.stop = stop if stop is not None else StopSignal()
        self.stopping = self.stop.agreement(self.topology.rank, self.topology.world_size, self.topology.timeout)
        s = self.session  # --profile A-B: a trace and a summary of those steps on every trainer rank
        self.profiler = StepProfiler(config, self.topology, s.start_step, s.total_steps) \
            if config.profile.profile else None
        self.eval_batch = EvalBatchSize(config, s.plan.global_batch, s.slice.count,  # under --memory-limit: fits
                                        len(s.data.test) if s.data.test is not None else 0)
        self.writes = CheckpointWrites(config.checkpoint.checkpoint_background)  # train/background.py
        self.snapshots = snapshots_of(config)  # --snapshot-every: in memory, in the background (train/snapshot.py)
        self.snapshot_writes = CheckpointWrites(self.snapshots is not None, "snapshot", agree=False)  # (they warn)
        self._agreed: tuple[int | None, bool] = (None, False)  # the last log point's step, and its timed flag
        self.elastic = elastic.attach(self, membership)  # --on-failure continue (train/elastic.py); else None

    def fit(self) -> dict[str, Any]:
        source = self._run_source()
        if self.strategy.out_of_order is not None:  # work handed out at run time, of any step
            self.strategy.out_of_order.bind(source)
        if self.strategy.own_loop is not None:  # a rank with a loop of its own (a server, a helper)
            return self.strategy.own_loop.run(source)
        s, cfg = self.session, self.config
        started = time.perf_counter()
        run_log = RunLog(cfg.log, s.total_steps, enabled=self.topology.is_main, tracking=cfg.tracking)
        try:
            run_log.start(s.config_flat, s.config_toml, s.start_step)
            if self.elastic is not None:  # a rank that takes reporting over continues the trackers' runs
                self.elastic.started(run_log)
            run_log.info(s.describe())
            summary = self._loop(run_log) if self.elastic is None else \
                self.elastic.run(lambda: self._loop(run_log), run_log)  # --on-failure continue: survives a loss
            self.strategy.finish()
            summary["wall_s"] = round(time.perf_counter() - started, 3)
            run_log.end(summary)
            return summary
        finally:
            self.writes.close()  # a checkpoint in flight is whole before the process goes on or ends
            self.snapshot_writes.close()
            run_log.close()
            if self.progress is not None:
                self.progress.close()
            if self.session.stream is not None:  # its reading thread
                self.session.stream.close()

    def _run_source(self) -> RunSource:
        s = self.session
        batches = SlicedBatches(s.data.train, s.plan, s.step_slices, self.strategy.topology.device, s.start_step)

        def after_slice(compute_s: float, step: int) -> None:
            self.straggler.after_step(compute_s)
            self.kill.after_slice(step + 1)

        return RunSource(batches.at, s.lr_schedule, s.total_steps, after_slice, s.plan.global_batch)

    def _loop(self, run_log: RunLog) -> dict[str, Any]:
        s, cfg, strategy = self.session, self.config, self.strategy
        if isinstance(s.plan, StreamPlan):  # read ahead by a thread; the session asks it where the lanes are
            s.stream = batches = StreamBatches(s.plan, s.slice.index, s.slice.count, strategy.topology.device,
                                               s.start_step, self.topology)
        else:
            batches = iter(SlicedBatches(s.data.train, s.plan, s.step_slices, strategy.topology.device, s.start_step,
                                         cfg.data.data_workers))
        meter = self.meter = StepMeter(window=max(cfg.log.log_every, RATE_WINDOW))
        ids = self.ids = example_ids(s, self.topology)  # (self.ids: --on-failure continue writes what it noted)
        guard = self.guard = DivergenceGuard(self.topology.device)
        self._loop_started, self._loop_cpu = time.perf_counter(), time.process_time()
        last_eval: tuple[float, float | None] | None = None
        last_interval_loss: float | None = None
        step = s.start_step
        if self.topology.is_main and not self.stop.begin():  # the launcher, asked to stop, is ending every worker
            raise RunStopped("stopped before training began", signal_name="", signum=0, resumable=True)
        self.startup_s = seconds_since_mark()  # the command (or fit()) to the first step
        # A step's own work (the stop check, the NaN guard, the meters) is a few calls and list appends and no
        # tensor op; the contexts that label, log or count the step are entered only while they are active (a
        # step of a tiny model takes a millisecond: every call shows). The reads are at log points.
        profiler, devices, memory, straggler, kill = self.profiler, s.devices, self.memory, self.straggler, self.kill
        progress = self.progress
        log_every, total, histogram_every = cfg.log.log_every, s.total_steps, cfg.log.histogram_every
        eval_every = cfg.train.eval_every if s.data.test is not None else 0
        unwatched = profiler is None and devices.plain  # (then only the memory meter's first steps are watched)
        errors = operator_errors()
        while step < total:
            if self._stop_after(step):
                return self._stopped(step, last_interval_loss, last_eval)
            lr = s.lr_schedule(step)
            tick = time.perf_counter()
            if unwatched and memory.done:
                batch = next(batches)
                with errors:
                    result = strategy.train_step(batch, lr)
                guard.observe(result.loss, step + 1)
            else:
                batch, result = self._watched_step(batches, step, lr)
            ids.observe(batch)
            done = step + 1
            elapsed = time.perf_counter() - tick
            if profiler is not None:
                profiler.measured(done, elapsed)
            waited = result.wait_s
            if straggler.enabled:
                elapsed += straggler.after_step(elapsed - waited)  # --straggler: this rank made slower
            meter.add(result.examples, elapsed, waited)
            run_log.advance()
            if step == s.start_step and elapsed >= _SLOW_FIRST_STEP_S and 1 < cfg.log.log_every \
                    and done < s.total_steps:
                run_log.info(f"first step done in {elapsed:.1f} s; the next line at step "
                             f"{min(s.total_steps, (done // cfg.log.log_every + 1) * cfg.log.log_every)} "
                             f"(--log-every {cfg.log.log_every})")
            step = done
            kill.after_step(done)
            if progress is not None:
                progress.after_step(done)
            if done % log_every == 0 or done == total:
                record = self._step_record(done, lr, meter.take_interval())
                run_log.step(record)
                ids.flush()
                last_interval_loss = record["loss"]
            if histogram_every and done % histogram_every == 0:
                run_log.histograms(strategy.module, done)
            if eval_every and done % eval_every == 0 and done != total:
                last_eval = self._evaluate(run_log, done)
            if s.checkpointer and done != total and self._checkpoint_due(done):
                self._checkpoint(done, periodic=True)
            elif self.snapshots is not None and snapshot_due(cfg, done, s.total_steps):
                self._checkpoint(done, periodic=True, snapshot=True)
        if self._stop_at_the_end():
            return self._stopped(step, last_interval_loss, last_eval)
        saved = []  # the result first (train/evaluation.py): an evaluation that fails loses nothing
        if s.checkpointer:
            saved += self._checkpoint(step)
        saved += self._save_model()
        if s.data.test is not None:
            last_eval = self._final_evaluation(run_log, step, saved)
        return outputs.summary(self, step, last_interval_loss, last_eval)

    def _watched_step(self, batches: Any, step: int, lr: float) -> tuple[Any, Any]:
        """One step inside what watches it: the profiler (--profile), the device runtime (per-operator log,
        soft placement) and the memory meter (the first steps' activations); (batch, result)."""
        s, profiler = self.session, self.profiler
        with profiler.step(step + 1) if profiler is not None else _NOTHING:
            with phase("data"):
                batch = next(batches)
            with s.devices.step_context(step), self.memory.step():
                result = self.strategy.train_step(batch, lr)
                if s.devices.recording:  # a logged step's operators show the NaN check's, labelled "loss"
                    with s.devices.phase("loss"):
                        self.guard.observe(result.loss, step + 1, now=True)
                else:
                    self.guard.observe(result.loss, step + 1)
        return batch, result

    def _stop_after(self, done: int) -> bool:
        """Whether to stop now, ``done`` steps done: a stop was requested and the trainer ranks agreed on this
        step (every rank asks at every step; nothing is read but a flag until a stop is requested)."""
        if self.stop.requested is None:
            return False
        target = self.stopping.stop_step(done, self._ends_with_collective, self.session.total_steps)
        return target is not None and done >= target

    def _stop_at_the_end(self) -> bool:
        """After the last step: whether any trainer rank was asked to stop by then (one all-reduce, so that all
        agree): a stop that lands on the last step ends as a stop does, without the final evaluation."""
        asked = torch.tensor([0.0 if self.stop.requested is None else 1.0], device=self.topology.device)
        return self.topology.all_reduce_sum(asked).item() > 0

    def _ends_with_collective(self, step: int) -> bool:
        """Whether every trainer rank takes part in a collective within step ``step``: the strategy's own
        (sync's all-reduce, a pipeline step, an averaging step) or a log point's."""
        return self.strategy.layout.meets_at(step) or step % self.config.log.log_every == 0

    def _stopped(self, step: int, train_loss: float | None,
                 last_eval: tuple[float, float | None] | None) -> dict[str, Any]:
        """End the run at ``step`` after a stop request: a checkpoint there (if the run has a directory), no
        evaluation, no saved model but at the last step; the summary's ``stopped`` says where it can resume."""
        s, name = self.session, self.stop.requested
        path, last = None, step == s.total_steps  # (at the last step every step is trained: --save-model too)
        if s.checkpointer and step > s.start_step:  # (nothing trained by this run: its start is what it had)
            self._checkpoint(step)
            written = s.checkpointer.latest() if self.topology.is_main else None  # (not with a write error warned)
            path = str(written) if written == s.checkpointer.path(step) else None
        model = self._save_model() if last and step > s.start_step else []
        if not s.checkpointer and not model and self.topology.is_main and step > s.start_step:
            s.log.warning(f"{name}: stopped after step {step} without --checkpoint-dir: the "
                          f"{step - s.start_step} step(s) trained are not saved (give --checkpoint-dir DIR to make "
                          "a stopped run resumable)")
        summary = outputs.summary(self, step, train_loss, last_eval)
        summary["stopped"] = {"signal": name, "step": step, "checkpoint": path, "trained": step - s.start_step,
                              "last": last, "model": model, **self.stopping.record()}
        return summary

    def _checkpoint_due(self, done: int) -> bool:
        """Every --checkpoint-every steps, or at a log point once --checkpoint-every-seconds have passed
        (rank 0's clock; agreed by every trainer there, so they all save the same step)."""
        every = self.config.checkpoint.checkpoint_every
        if every and done % every == 0:
            return True
        if done % self.config.log.log_every or not self.timed.enabled:
            return False
        if self._agreed[0] == done:  # this log point's record carried the main rank's clock: no collective more
            return self._agreed[1]
        return self.timed.due(agree_with_rank0(self.topology))

    def _check_finite(self, step: int | None = None) -> None:
        """Stop at the first non-finite loss any trainer rank saw (a collective: every rank calls it); nothing
        after ``step``'s log point, which checked it (not under --on-failure continue: a rank that joined since
        has not seen that record)."""
        if step is not None and self._agreed[0] == step and self.elastic is None:
            return
        self._stop_if_diverged(self.topology.all_gather_object(self.guard.first_bad()))

    def _stop_if_diverged(self, found: list[tuple[int, float] | None]) -> None:
        first = first_divergence(found)
        if first is None:
            return
        step, loss, rank = first
        if rank != self.topology.rank:
            # the rank that saw it reports first, so the job's error names it; once it has exited this wait
            # ends (its connections close), bounded by the timeout in any case
            with contextlib.suppress(Exception):
                self.topology.barrier()
        raise DivergedError(step, loss)

    def _step_record(self, step: int, lr: float, meter: IntervalMeter) -> dict[str, Any]:
        s = self.session
        # one collective per log point for all: each rank's rate, slice, loss, first bad step, strategy numbers,
        # and whether --checkpoint-every-seconds have passed (the main rank's clock: _checkpoint_due reads it)
        per_rank = self.topology.all_gather_object((round(meter.busy_examples_per_sec(), 2), meter.mean_examples,
                                                    self.guard.take_mean(), self.guard.first_bad(),
                                                    {**self.strategy.take_metrics(),
                                                     **self.straggler.take_metrics()}, self.timed.mine()))
        self._stop_if_diverged([bad for _, _, _, bad, _, _ in per_rank])
        self._agreed = (step, any(timed for *_, timed in per_rank))  # every rank finite at `step`; timed due
        losses = [loss for _, _, loss, _, _, _ in per_rank if loss is not None]  # the ranks that hold the loss
        keys = sorted({key for *_, extra, _ in per_rank for key in extra})
        loss = sum(losses) / len(losses) if losses else None
        # the latest steps after the warm-up (the interval's while warming up), each step's own seconds
        rate = self.meter.window_steps_per_sec() or meter.steps_per_sec()
        left = self.meter.seconds_left(s.total_steps - step, self._loop_started)
        return {
            "step": step,
            "epoch": round(s.plan.epochs_done(step), 4),
            # a slice's loss is already weighed by its share of the global batch
            "loss": loss,
            **(s.task.metrics(loss, None) if loss is not None else {}),
            "lr": lr,
            "examples_per_sec": round(rate * s.plan.global_batch, 2),
            "sec_per_batch": round(1 / rate if rate > 0 else 0.0, 6),
            "rank_examples_per_sec": [rate for rate, *_ in per_rank],
            "rank_batch": [round(examples, 2) for _, examples, *_ in per_rank],
            **{f"rank_{key}": [extra.get(key) for *_, extra, _ in per_rank] for key in keys},
            # wall clock since the loop began, all overhead included: rates between two records are end to end
            "time_s": round(time.perf_counter() - self._loop_started, 4),
            # this process's CPU seconds since then (every thread's): what a step costs whatever else shares the cores
            "cpu_s": round(time.process_time() - self._loop_cpu, 4),
            "eta_s": None if left is None else round(left, 1),  # the wall seconds the steps left should take
        }

    def _evaluate(self, run_log: RunLog, step: int) -> tuple[float, float | None]:
        self._check_finite()
        result = evaluate(self.session, self.topology, self.eval_batch, self.memory.apart)
        run_log.evaluation(step, *result, self.session.task.metrics(*result))
        return result

    def _final_evaluation(self, run_log: RunLog, step: int, saved: list[str]) -> tuple[float, float | None]:
        """The evaluation after the last step, once the result is written: its error says where that is."""
        saved = self.topology.broadcast_object(saved)  # (what the trainers' rank 0 wrote, for any rank's error)
        try:
            return self._evaluate(run_log, step)
        except Exception as exc:
            error = saved_first(exc, step, saved)
            if error is exc:
                raise
            raise error from exc

    def _checkpoint(self, step: int, periodic: bool = False, snapshot: bool = False) -> list[str]:
        """Write step ``step``'s checkpoint (every trainer rank), after the one in flight; a ``periodic`` one in
        the background with --checkpoint-background (train/background.py); a ``snapshot`` in memory, in the
        background (train/snapshot.py). What was written, on the trainers' rank 0 (a background write: once it
        is settled, at the next checkpoint)."""
        self._check_finite(step)
        s, started = self.session, time.perf_counter()
        writes = self.snapshot_writes if snapshot else self.writes
        if not snapshot:
            self.timed.reset()
        if not periodic:  # the last: the snapshot in flight settled too (a sharded one's commit is collective)
            self.snapshot_writes.settle(self.topology)
        written = [self._settled(writes.settle(self.topology), snapshot)]  # the previous one, if still in flight
        s.save_checkpoint(step, writes, background=periodic, checkpointer=self.snapshots if snapshot else None)
        if not (periodic and writes.background):
            written.append(self._settled(writes.settle(self.topology)))
        if periodic:
            writes.stalls.append(time.perf_counter() - started)
        path = written[-1] if len(written) == 2 else None  # (this checkpoint's, written in the foreground)
        return [f"checkpoint {path}"] if path is not None else []

    def _settled(self, path: Any, snapshot: bool = False) -> Any:
        """A checkpoint written (None: none, or warned: --on-checkpoint-error warn; or not the trainers' rank 0)."""
        if self.topology.is_main and path is not None and not snapshot:
            self.session.log.info(f"checkpoint: {path}")
        return path

    def _save_model(self) -> list[str]:
        if not self.config.train.save_model:
            return []
        self._check_finite()
        return outputs.save_trained_model(self.strategy, self.config, self.topology)


def train_worker(ctx: Any, config: RunConfig, model: nn.Module | None = None,
                 data: DataBundle | None = None) -> dict[str, Any]:
    """The function ``polytrain train`` launches in every worker."""
    trainer = Trainer(config, ctx.topology, model=model, data=data, stop=ctx.stop, layout=ctx.layout,
                      membership=getattr(ctx, "membership", None))
    summary = trainer.fit()
    # --on-failure continue: the job's summary is its last members' main rank's (the launcher takes the one
    # result that is not None; a rank that was not main at the end may not have seen every change)
    return summary if trainer.elastic is None or trainer.topology.is_main else None
