"""Batch normalisation over the global batch, on any device.

PyTorch's ``nn.SyncBatchNorm`` runs only on GPUs. :class:`SyncBatchNorm` here computes the batch
statistics with autograd-aware all-reduces (``torch.distributed.nn.functional.all_reduce``), so it works
on CPU/gloo too and its backward includes every rank's contribution through the shared statistics: N
workers on slices give the same forward, gradients and running statistics as one BatchNorm on the whole
global batch. ``convert_sync_batchnorm`` uses PyTorch's fused version on CUDA and this one elsewhere.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class SyncBatchNorm(_BatchNorm):
    """BatchNorm for inputs (N, C, ...) whose training statistics span all ranks of ``process_group``."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: Any = None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not (self.training and dist.is_initialized()):
            return super().forward(input)
        dims = [0, *range(2, input.dim())]
        shape = [1, -1] + [1] * (input.dim() - 2)
        # two passes (mean, then squared deviations) match single-device BatchNorm's accuracy
        count = self._all_reduce(torch.tensor([input.numel() // input.size(1)], dtype=input.dtype))
        mean = self._all_reduce(input.sum(dims)) / count
        centred = input - mean.view(shape)
        var = self._all_reduce((centred * centred).sum(dims)) / count
        self._update_running_stats(mean, var, count)
        out = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        # torch 2.13 deprecates this autograd-aware all-reduce in favour of _functional_collectives, whose
        # all_reduce aborts the process on gloo/CPU in 2.13; keep the working one, without the warning
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning, message=".*all_reduce is deprecated")
            return dist_fn.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.process_group or dist.group.WORLD)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor) -> None:
        if not self.track_running_stats:
            return
        self.num_batches_tracked += 1
        momentum = (1.0 / float(self.num_batches_tracked)) if self.momentum is None else self.momentum
        unbiased = var * (count / (count - 1).clamp(min=1))
        self.running_mean.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
        self.running_var.mul_(1 - momentum).add_(unbiased.detach(), alpha=momentum)


def convert_sync_batchnorm(module: nn.Module, process_group: Any = None, *, cuda: bool = False) -> nn.Module:
    """Replace every ``BatchNorm*d`` in ``module`` with a synchronised one (PyTorch's on CUDA)."""
    if cuda:
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    if isinstance(module, _BatchNorm) and not isinstance(module, (SyncBatchNorm, nn.SyncBatchNorm)):
        converted = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                  module.track_running_stats, process_group)
        if module.affine:
            converted.weight, converted.bias = module.weight, module.bias
        if module.track_running_stats:
            converted.running_mean, converted.running_var = module.running_mean, module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
        return converted
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child, process_group))
    return module
