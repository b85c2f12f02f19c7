"""What a run gives back at its end: the trained model where ``--save-model`` says, and the summary (the last
losses, the steady rate, the strategy's numbers and the run's own)."""

from __future__ import annotations

from typing import Any

from polytrain.config import RunConfig
from polytrain.data.base import DataBundle
from polytrain.devices.memory_limit import parse_size
from polytrain.distributed.topology import Topology
from polytrain.log import get_logger
from polytrain.models.lora import export as lora_export, lora_of
from polytrain.precision import to_float32
from polytrain.strategies import Strategy
from polytrain.train.files import atomic_save
from polytrain.weights.export import is_directory_target
from polytrain.weights.save import save_model


def save_trained_model(strategy: Strategy, config: RunConfig, topology: Topology) -> list[str]:
    """``--save-model PATH`` written from the trained model (after the run's last step, its loss checked
    finite): the LoRA adapters in PEFT's format, a directory or ``.safetensors`` file one tensor at a time, or
    one ``torch.save`` file. Every trainer rank calls it (a strategy may gather the model's parts); what was
    written, on the trainers' rank 0."""
    path = config.train.save_model
    adapters = lora_of(strategy.module)
    if adapters is not None:  # --lora: the adapters in PEFT's format (--merge-lora: and the merged model)
        state = strategy.state_dict(optimizer=False)  # every rank: a strategy may gather the model's parts
        if not topology.is_main:
            return []
        lora_export(to_float32({k: v.detach().cpu() for k, v in state["model"].items()}), adapters, path,
                    config.lora.merge_lora)
        get_logger().info(f"LoRA adapters saved to {path} (PEFT's format)")
        return [f"--save-model {path}"]
    if is_directory_target(path) or path.endswith(".safetensors"):  # one tensor at a time, never the whole
        save_model(strategy, path, parse_size(config.train.save_shard_size))
        if not topology.is_main:
            return []
        get_logger().info(f"model saved to {path}")
        return [f"--save-model {path}"]
    state = strategy.state_dict(optimizer=False)  # every rank: a strategy may gather the model's parts
    if not topology.is_main:
        return []
    # float32 whatever --precision (bf16-true's bfloat16 widened, exactly), as checkpoints hold
    atomic_save(to_float32({k: v.detach().cpu() for k, v in state["model"].items()}), path)
    get_logger().info(f"model saved to {path}")
    return [f"--save-model {path}"]


def summary(trainer: Any, step: int, train_loss: float | None,
            last_eval: tuple[float, float | None] | None) -> dict[str, Any]:
    """The run's summary on a trainer rank: the last losses, the steady rate, the strategy's numbers and the
    run's own (memory, checkpoint writes). Collective over the trainer ranks."""
    s = trainer.session
    eval_loss, eval_accuracy = last_eval if last_eval else (None, None)
    eval_extra = {f"eval_{k}": v for k, v in s.task.metrics(*last_eval).items()} if last_eval else {}
    strategy_numbers = trainer.strategy.summary_metrics()  # collective over the trainers
    meter, batch = trainer.meter, s.plan.global_batch
    # the steady rate: the steps after the warm-up (every step's in a run no longer than it), each step's own
    # seconds (not the log points', evaluations' and checkpoints' work between steps)
    steady = meter.steady_steps_per_sec() or 0.0
    warmup = meter.warmup_steps_per_sec()
    busy = meter.steady_busy_examples_per_sec()
    return {
        "steps": step,
        "train_loss": train_loss,
        "eval_loss": eval_loss,
        "eval_accuracy": eval_accuracy,
        **eval_extra,
        "examples_per_sec": round(steady * batch, 2),
        "warmup_steps": meter.warmup_steps,
        "warmup_s": round(meter.warmup_s, 4),
        "warmup_examples_per_sec": None if warmup is None else round(warmup * batch, 2),
        "startup_s": None if trainer.startup_s is None else round(trainer.startup_s, 3),
        "rank_examples_per_sec": trainer.topology.all_gather_object(round(busy, 2)),
        "strategy": trainer.config.train.strategy,
        "workers": trainer.topology.world_size,
        "global_batch": s.plan.global_batch,
        **packed_efficiency(s.data),
        **strategy_numbers,
        **trainer.straggler.summary(trainer.topology),
        **trainer.memory.summary(trainer.strategy, trainer.topology),  # collective over the trainers
        **trainer.writes.summary(),
        **trainer.snapshot_writes.summary(),
    }


def packed_efficiency(data: DataBundle) -> dict[str, float]:
    """``packed_efficiency``: of the token positions the packed training sequences hold, the share that are
    real target tokens (the rest padding, or a target after a document's end); {} for unpacked data."""
    efficiency = getattr(data.train, "efficiency", None)
    return {"packed_efficiency": round(efficiency(), 4)} if data.document_end is not None and efficiency else {}
