"""Optimizer settings and construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from polytrain.options import option, register_section

OPTIMIZERS = ("sgd", "adam", "adamw", "rmsprop", "adagrad")


@register_section("optim", "optimizer and learning rate", order=40)
@dataclass
class OptimConfig:
    optimizer: str = option("sgd", "optimizer", choices=OPTIMIZERS)
    lr: float = option(0.05, "learning rate (for --base-batch-size when --lr-scaling is set)", minimum=0.0)
    momentum: float = option(0.9, "momentum for sgd and rmsprop", minimum=0.0)
    nesterov: bool = option(False, "Nesterov momentum (sgd)")
    weight_decay: float = option(0.0, "L2 weight decay (decoupled for adamw)", minimum=0.0)
    lr_schedule: str = option(
        "constant", "LR schedule: constant | exponential:rate=R,decay_steps=N[,staircase=true] | "
        "cosine[:min_lr=X] | linear[:min_lr=X]; any of them with warmup=N", metavar="SPEC")
    lr_scaling: str = option("none", "rescale --lr for the global batch: linear (Goyal et al.) or sqrt",
                             choices=("none", "linear", "sqrt"))
    base_batch_size: int | None = option(None, "the batch size --lr was tuned for (with --lr-scaling)", minimum=1)
    rescale_warmup_steps: int = option(10, "--resume with another global batch: steps over which the LR moves "
                                       "from the checkpoint's to this batch's (0: at once)", minimum=0, metavar="N")
    clip_grad_norm: float | None = option(None, "clip the norm of the global (averaged) gradient to C before each "
                                                "update", minimum=1e-12, metavar="C")


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig, lr: float) -> torch.optim.Optimizer:
    """The optimizer for ``params`` at learning rate ``lr`` (the schedule updates it each step): those that
    train (a frozen parameter, ``requires_grad`` off, as ``--lora`` leaves the model's own, is not held)."""
    params = [p for p in params if p.requires_grad]
    name = cfg.optimizer
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=cfg.weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.Adagrad(params, lr=lr, weight_decay=cfg.weight_decay)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
