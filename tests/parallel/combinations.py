"""The parity matrix of degrees: each combination trains ``transformer_lm`` 8 steps with SGD and momentum (and
clipping) and must end where ``single`` ends on the whole batch; so does a tiny transformers Llama (rotary
embeddings, grouped-query attention; split by its own ``base_model_tp_plan``) where a degree applies to it. :mod:`.test_combinations` runs a subset in the
suite, :mod:`.test_matrix` all of them (``POLYTRAIN_MATRIX=1``), reporting the largest difference of each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import polytrain
from polytrain.models.transformer_lm import Block, Embed, Head, TransformerLM

LM = dict(model="transformer_lm:layers=2,dim=32,heads=2", data="text:seq_len=16", batch_size=16)
COMMON = dict(steps=8, seed=5, progress="off", eval_every=0, log_every=4, optimizer="sgd", lr=0.05, momentum=0.9,
              clip_grad_norm=0.5, timeout=300, **LM)
#: name: the settings of each combination (with COMMON); the traced ones take --loss model (the labels reach the
#: model's own loss on the last stage, which makes the tracer cut it)
CASES: dict[str, dict[str, Any]] = {
    "hsdp": dict(strategy="sync", workers=4, dp_replicate=2, dp_shard=2),
    "dp_shard2_tp2": dict(strategy="fsdp", workers=4, tp=2),
    "hsdp_tp": dict(strategy="sync", workers=8, dp_replicate=2, dp_shard=2, tp=2),
    "dp_shard2_tp2_accumulate": dict(strategy="fsdp", workers=4, tp=2, accumulate=2),
    # H = 1, outer lr 1, no outer momentum: the replicas' average each step, which is sync's step (SGD's
    # momentum is linear in the gradients); no clipping (each replica would clip its own gradient)
    "diloco_over_dp_shard2": dict(strategy="diloco", workers=4, dp_shard=2, sync_every=1, outer_lr=1,
                                  outer_momentum=0, clip_grad_norm=None),
    "local_sgd_over_dp_shard2": dict(strategy="local-sgd", workers=4, dp_shard=2, sync_every=1,
                                     clip_grad_norm=None),
    "pp2_tp2": dict(strategy="pipeline", pp=2, tp=2, microbatches=2, split_at="blocks.1"),
    # a split point inside a block: the tracer cuts the model, and the plan splits the stages' graph modules
    "pp2_tp2_traced": dict(strategy="pipeline", pp=2, tp=2, microbatches=2, split_at="blocks.1.attn"),
    "pp2_dp_shard2_tp2_traced": dict(strategy="sync", workers=8, pp=2, dp_shard=2, tp=2, microbatches=2,
                                     split_at="blocks.1.attn"),
    "pp2_dp_shard2_tp2": dict(strategy="sync", workers=8, pp=2, dp_shard=2, tp=2, microbatches=2,
                              split_at="blocks.1"),
    "pp2_hsdp": dict(strategy="hybrid", workers=8, pp=2, dp_replicate=2, dp_shard=2, microbatches=2,
                     split_at="blocks.1"),
}
#: a tiny transformers LlamaForCausalLM (4 heads, 2 key/value heads, width 32, 2 layers: tests/helpers/zoo.py)
LLAMA = dict(model="tests.helpers.zoo:llama")
CASES.update({
    "llama_dp_shard2_tp2": dict(**CASES["dp_shard2_tp2"], **LLAMA),
    "llama_hsdp": dict(**CASES["hsdp"], **LLAMA),
    # a Hugging Face model is always cut by the tracer; its rotary cos and sin meet the split heads as plain tensors
    "llama_pp2_tp2": dict(strategy="pipeline", pp=2, tp=2, microbatches=2, split_at="model.layers.1", **LLAMA),
})
#: the layouts a checkpoint must move between bit for bit (each saves at step 4, each other resumes it)
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp_shard2_tp2": CASES["dp_shard2_tp2"],
    "pp2_tp2": CASES["pp2_tp2"],
    "pp2_tp2_traced": CASES["pp2_tp2_traced"],
    "single": dict(strategy="single"),
    "sync4": dict(strategy="sync", workers=4),
}


def reference(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings of the ``single`` run a combination must equal: its clipping and accumulation."""
    return dict(strategy="single", **{k: settings[k] for k in ("clip_grad_norm", "accumulate", "model") if k in settings})


def processes(settings: dict[str, Any]) -> int:
    """How many processes a run of ``settings`` starts (single: none besides this one)."""
    from polytrain.config import make_config
    from polytrain.train.run import layout_of

    return layout_of(make_config(**{**COMMON, **settings})).processes


def train(tmp: Path, name: str, **settings: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(summary, the saved model) of one run of ``COMMON`` with ``settings``."""
    path = tmp / f"{name}.pt"
    summary = polytrain.fit(**{**COMMON, **settings}, save_model=str(path))
    return summary, torch.load(path, weights_only=True)


def largest_difference(model: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest absolute difference of any element, and the tensor it is in."""
    assert model.keys() == reference.keys()
    return max(((model[k].double() - reference[k].double()).abs().max().item(), k) for k in reference)


class SkipLM(nn.Module):
    """transformer_lm's blocks with the embedding added again before the head: its forward is not its units in
    order, so a pipeline is cut by the tracer; ``tp_plan`` is transformer_lm's."""

    tp_plan = TransformerLM.tp_plan

    def __init__(self, vocab: int, seq_len: int, layers: int = 2, dim: int = 32, heads: int = 2):
        super().__init__()
        self.embed = Embed(vocab, dim, seq_len, 0.0)
        self.blocks = nn.ModuleList(Block(dim, heads, 0.0) for _ in range(layers))
        self.head = Head(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        first = self.embed(tokens)
        x = first
        for block in self.blocks:
            x = block(x)
        return self.head(x + first)


def skip_lm(input_shape: tuple[int, ...] = (16,), num_classes: int = 256) -> nn.Module:
    """``--model tests.parallel.combinations:skip_lm``."""
    return SkipLM(num_classes, input_shape[0])


def moved(tmp: Path, source: dict[str, Any], target: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A run of ``source`` to step 4 with a checkpoint, resumed by ``target``: (what the target holds before its
    first step, the checkpoint it resumed)."""
    ckpt = tmp / "ck"
    polytrain.fit(**{**COMMON, **source, "steps": 4}, checkpoint_dir=str(ckpt))
    return resumed(ckpt, 4, target)


def resumed(ckpt: Path, step: int, target: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checkpoint of step ``step`` in ``ckpt`` resumed by a run of ``target`` (with ``COMMON``): (what the
    target holds before its first step, the checkpoint)."""
    from polytrain.config import make_config
    from polytrain.train.checkpoint import load_checkpoint
    from tests.helpers.resume import resume_and_read_back
    from tests.helpers.spawn import spawn

    saved = load_checkpoint(ckpt / f"step-{step:08d}.pt")
    config = make_config(**{**COMMON, **target, "steps": step + 2}, checkpoint_dir=str(ckpt), resume=True)
    n = processes(target)
    held, _ = (spawn(resume_and_read_back, n, config) if n > 1 else
               polytrain.launch(resume_and_read_back, config, workers=1))[0]
    return held, saved
