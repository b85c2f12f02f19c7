"""The training loop's own settings (the ``training`` flags)."""

from __future__ import annotations

from dataclasses import dataclass

from polytrain.options import option, register_section
from polytrain.precision import DEFAULT_LOSS_SCALE, DEFAULT_PRECISION, PRECISIONS
from polytrain.tasks import LOSSES


from polytrain.strategies import DEFAULT_STRATEGY


def _strategy_help() -> str:
    from polytrain.strategies import available_strategies  # the registry fills as strategies are imported
    return f"parallel strategy: {' | '.join(available_strategies())} | package.module:Class"


@register_section("train", "training", order=10)
@dataclass
class TrainConfig:
    strategy: str = option(DEFAULT_STRATEGY, _strategy_help, metavar="NAME")
    steps: int | None = option(None, "optimizer steps to train (or --epochs)", minimum=1, metavar="N")
    epochs: int | None = option(10, "passes over the training set (or --steps)", minimum=1, metavar="E")
    accumulate: int = option(1, "split each worker's batch into K micro-batches (gradient accumulation)",
                             minimum=1, metavar="K")
    loss: str = option("task", "what is minimised: task (the task's loss on the model's outputs or .logits) or "
                       "model (the model's own .loss, given labels=: the Hugging Face convention)", choices=LOSSES)
    precision: str = option(DEFAULT_PRECISION, "numeric precision (Lightning's names): 32-true (float32), bf16-mixed "
                            "or 16-mixed (forward and loss under autocast to bfloat16 or float16, float32 parameters "
                            "and optimizer state; 16-mixed scales the loss and skips steps whose gradients "
                            "overflow), bf16-true (parameters, gradients and optimizer state in bfloat16)",
                            choices=PRECISIONS)
    initial_loss_scale: float = option(DEFAULT_LOSS_SCALE, "16-mixed: the loss scaler's first scale (halved after "
                                       "each step whose gradients overflow, doubled after 2000 good ones)",
                                       minimum=1, metavar="S")
    seed: int = option(0, "random seed (same seed, device and strategy: same loss trajectory)", minimum=0)
    eval_every: int = option(100, "evaluate on the test split every N steps (0: only at the end)", minimum=0,
                             metavar="N")
    eval_batch_size: int | None = option(None, "examples per evaluation batch per worker (default 256; under "
                                         "--memory-limit at most training's batch per worker, which fits)",
                                         minimum=1, metavar="N")
    save_model: str | None = option(None, "write the trained model here: FILE.pt (its state_dict, torch.save), "
                                          "FILE.safetensors, or a directory (a path without a suffix, ending in /, "
                                          "or an existing one): Hugging Face's layout, config.json of a transformers "
                                          "model and safetensors shards, written one tensor at a time",
                                    metavar="FILE|DIR")
    save_shard_size: str = option("5GB", "--save-model DIR: the most bytes of tensors per safetensors shard",
                                  metavar="SIZE")
    deterministic: bool = option(False, "use only deterministic algorithms (slower on GPU)")
