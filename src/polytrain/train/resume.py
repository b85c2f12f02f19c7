"""A run resumed from its checkpoint: the newest good one chosen, the settings that shape the state compared,
the model and optimizer loaded (each rank its rows where it holds them), and the data position, the steps left
and the learning rate continued, at the checkpoint's global batch or another (:mod:`.reshard`)."""

from __future__ import annotations

from typing import Any

from polytrain.config import RunConfig
from polytrain.data.stream import StreamPlan
from polytrain.errors import ConfigError
from polytrain.precision import file_signature, resume_note
from polytrain.train import reshard
from polytrain.train.checkpoint import restore_rng, warn_choice
from polytrain.train.integrity import signature
from polytrain.train.lazy import open_verified
from polytrain.train.lr_schedules import parse_lr_schedule
from polytrain.train.reshard import DataPosition

#: settings that must match to resume a checkpoint (they shape the model, the data or the optimizer state)
RESUME_MUST_MATCH = ("model", "model_args", "data", "data_args", "tokenizer", "pack", "optimizer")


def resume(s: Any) -> None:
    """Load ``--resume``'s checkpoint into ``s``, the :class:`~polytrain.train.session.Session` built for it (or
    warn that there is none yet)."""
    if s.checkpointer is None:
        raise ConfigError("--resume needs --checkpoint-dir DIR (where the checkpoints are)")
    trainers = s.strategy.trainers
    # a rank whose holdings are the run's state reads only its rows of the checkpoint, itself (held_state);
    # any other gets the whole state from the trainers' rank 0
    held = s.strategy.held_state if s.strategy.held_state is not None and s.strategy.held_state.by_rows else None
    found: tuple[dict[str, Any] | None, str | None, str | None] = (None, None, None)  # state, its file, error
    if trainers.is_main:
        # a damaged file, or one of another model, is skipped for the previous one (see docs/errors.md);
        # the model's own state_dict says which tensors a checkpoint of it holds
        choice = s.checkpointer.choose(file_signature(signature(s.strategy.module.state_dict()),
                                                      s.strategy.amp.precision), lazy=held is not None)
        warn_choice(choice, s.log.warning, "--resume: ")
        if choice.good is not None:
            found = (choice.good.state if held is None else {}, str(choice.good.path), None)
        elif choice.rejected:
            found = (None, None, f"--resume: {choice.no_good_message(s.checkpointer.directory)}")
    # every trainer raises the same error, rather than the others waiting for rank 0's end
    state, path, error = trainers.broadcast_object(found)
    if error:
        raise ConfigError(error)
    if state is None:
        s.log.warning(f"--resume: no checkpoint in {s.checkpointer.directory} yet; starting from step 0")
        return
    checkpoint = open_verified(path) if held is not None else None  # (verified by rank 0: mapped, not read)
    if checkpoint is not None:
        state = checkpoint.run
    saved = state["config"]
    current = s.config.flat()
    defaults = RunConfig().flat()  # what a key that a checkpoint of an older polytrain lacks was then
    clash = [k for k in RESUME_MUST_MATCH if saved.get(k, defaults.get(k)) != current.get(k)]
    if clash:
        raise ConfigError(f"--resume: the checkpoint in {s.checkpointer.directory} was made with a different "
                          f"{', '.join(clash)}; use the same settings or another --checkpoint-dir")
    note = resume_note(saved, s.strategy.amp.precision)
    if note and trainers.is_main:
        s.log.info(note)
    if checkpoint is not None:
        held.load(checkpoint)
    else:
        s.strategy.load_state_dict(state)
    s.strategy.amp.load_state_dict(state)
    s.start_step = int(state["step"])
    s.weights = f"weights from the checkpoint of step {s.start_step}"
    _continue_data(s, state)
    if len(state["rng"]) == trainers.world_size:
        restore_rng(state["rng"][trainers.rank])
    else:
        s.log.warning(f"--resume: checkpoint made by {len(state['rng'])} workers, now {trainers.world_size}: "
                      "random streams restart from the seed (the data order is unaffected)")
    read = f"; rank 0 read {held.read[0] / 2**20:.1f} of the checkpoint's {held.read[1] / 2**20:.1f} MiB of tensors " \
        "(the rows it holds)" if checkpoint is not None and held.read[0] < held.read[1] else ""
    s.log.info(f"resumed from step {s.start_step} ({path}){read}")
    if s.start_step >= s.total_steps and trainers.is_main:
        s.log.warning(_nothing_left_message(s))


def _nothing_left_message(s: Any) -> str:
    """The warning of a resume at or past the run's end: which setting ends it, and what to raise."""
    steps, epochs = s.config.train.steps, s.config.train.epochs
    end = f"--steps {steps}" if steps else f"the end of --epochs {epochs or 1} (step {s.total_steps})"
    return (f"--resume: the checkpoint in {s.checkpointer.directory} is at step {s.start_step}, at or past {end}: "
            f"nothing left to train (the model stays at step {s.start_step}); raise "
            f"{'--steps' if steps else '--epochs'} to train further")


def _continue_data(s: Any, state: dict[str, Any]) -> None:
    """Continue the checkpoint's data position (at its global batch or another, see :mod:`.reshard`), with
    the steps left and the LR that follow; a stream's lanes where they were."""
    saved = state.get("data_position") or {}
    if isinstance(s.plan, StreamPlan) or saved.get("stream"):
        if not (isinstance(s.plan, StreamPlan) and saved.get("stream")):
            raise ConfigError(f"--resume: the checkpoint in {s.checkpointer.directory} was made with "
                              f"{'a stream' if saved.get('stream') else 'map-style data'}; resume with the data it "
                              "was made with, or use another --checkpoint-dir")
        s.plan = StreamPlan.make(s.plan.stream, s.plan.global_batch, s.slice.count, saved)
        return
    position = DataPosition.saved(state, s.plan.num_examples)
    try:
        s.plan = reshard.continue_plan(s.plan, position, s.start_step)
    except ValueError as exc:  # a bucketed plan continues only at its own global batch
        raise ConfigError(f"--resume: the checkpoint was made with global batch {position.global_batch}: {exc}; "
                          f"resume with that batch size") from None
    if s.plan.resumed is None:
        return
    cfg = s.config
    s.total_steps = reshard.total_steps(s.plan, cfg.train.steps, cfg.train.epochs)
    schedule = parse_lr_schedule(cfg.optim.lr_schedule, s.lr_schedule.base_lr, s.total_steps)
    s.lr_schedule = schedule
    r, old_batch = s.plan.resumed, position.global_batch
    s.log.info(f"--resume: global batch {old_batch} -> {s.plan.global_batch}: epoch {r.epoch} continues from "
               f"example {r.offset} of its {r.end} in {s.plan.resumed_steps} step(s) of the new batch")
    skipped = reshard.skipped_examples(s.plan)
    if skipped:
        s.log.warning(f"--resume: the {r.end - r.offset} examples left in epoch {r.epoch} are not a multiple of the "
                      f"global batch {s.plan.global_batch}: its last {skipped} are skipped (a global batch that "
                      "divides them takes every one)")
    old_lr, warmup = reshard.saved_lr(state), cfg.optim.rescale_warmup_steps
    new_lr = schedule(s.start_step)
    if old_batch != s.plan.global_batch and old_lr is not None and old_lr != new_lr:
        how = "at once" if not warmup else f"linearly over {warmup} step(s) (--rescale-warmup-steps)"
        s.log.info(f"--resume: learning rate {old_lr:g} -> {new_lr:g} for global batch {s.plan.global_batch} "
                   f"(--lr-scaling {cfg.optim.lr_scaling}), {how}")
        if warmup:
            s.lr_schedule = reshard.Rescaled(schedule, s.start_step, old_lr, warmup)
