"""Models as users bring them, under the strategies that keep a part of the model, in real gloo processes:
nanoGPT's shape (blocks in an ``nn.ModuleDict``, ``lm_head`` tied to ``transformer.wte``) loaded with
``load_state_dict``, and a transformers Llama (rotary embeddings, grouped-query attention) loaded with
``from_pretrained``; fsdp 2, a traced pipeline of 2 stages, tp 2 with the plan transformers ships, and
hybrid 2 x 2 with ``--shard-dp`` (also a tied GPT-2, its tied tensor on both stages). Each equals ``single`` after 3 SGD steps, and keeps a tie tied.

The cases of one world size run in the same worker processes, one after the other, forked from the test's
process (``POLYTRAIN_START_METHOD=fork``), which has imported transformers and built every model already: a
worker from the forkserver imported transformers anew (about 2 s of CPU each, 6 workers)."""

from __future__ import annotations

import random

import pytest
import torch

import polytrain
from polytrain.config import make_config
from polytrain.distributed.launch import launch
from polytrain.train.run import layout_of
from polytrain.train.trainer import Trainer
from tests.helpers import zoo
from tests.helpers.threads import one_thread

pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

CASES = {  # name: (model, world size, settings)
    "fsdp-nanogpt": ("nanogpt", 2, dict(strategy="fsdp", workers=2)),
    "fsdp-llama": ("llama", 2, dict(strategy="fsdp", workers=2)),
    "pipeline-llama": ("llama", 2, dict(strategy="pipeline", stages=2, microbatches=2)),
    "tp-llama": ("llama", 2, dict(strategy="tp", workers=2, tp=2)),
    "hybrid-shard-llama": ("llama", 4, dict(strategy="hybrid", workers=4, dp=2, pp=2, microbatches=2,
                                            shard_dp=True)),
    "hybrid-shard-gpt2": ("gpt2", 4, dict(strategy="hybrid", workers=4, dp=2, pp=2, microbatches=2,
                                          shard_dp=True)),  # wte and lm_head tied across the two stages
}


def _cases(ctx, runs):
    """Each case in turn in these workers, under its own layout: its summary."""
    return {name: Trainer(config, ctx.topology, stop=ctx.stop, layout=layout_of(config)).fit()
            for name, config in runs}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("POLYTRAIN_START_METHOD", "fork")
        return _runs(tmp_path_factory)


def _runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    rng = random.Random(0)
    text = root / "words.txt"
    text.write_text(" ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat", "dog", "ran"]) for _ in range(700)))
    args = {"nanogpt": {"path": str(zoo.write_state(root / "nanogpt.pt", seed=4))},
            "llama": {"path": str(zoo.write_pretrained("llama", root / "llama", seed=7))},
            "gpt2": {"path": str(zoo.write_pretrained("gpt2", root / "gpt2", seed=8))}}
    common = dict(data=f"text:file={text},seq_len=16", batch_size=8, steps=3, optimizer="sgd", lr=0.5, seed=3,
                  progress="off", eval_every=0, log_every=3, timeout=120)
    with one_thread():
        for model in args:
            polytrain.fit(**common, model=f"tests.helpers.zoo:{model}", model_args=args[model], strategy="single",
                          save_model=str(root / f"single-{model}.pt"))
    summaries = {}
    for world in (2, 4):
        cases = [(name, make_config(**common, **settings, model=f"tests.helpers.zoo:{model}",
                                    model_args=args[model], save_model=str(root / f"{name}.pt")))
                 for name, (model, size, settings) in CASES.items() if size == world]
        summaries.update(launch(_cases, cases, workers=world, layout=layout_of(cases[0][1]), device="cpu",
                                backend="gloo", timeout=120, threads_per_worker=1)[0])
    return root, summaries


@pytest.mark.parametrize("name", list(CASES))
def test_each_model_under_each_strategy_equals_single(runs, name):
    root, summaries = runs
    model = CASES[name][0]
    single = torch.load(root / f"single-{model}.pt", weights_only=True)
    got = torch.load(root / f"{name}.pt", weights_only=True)
    assert got.keys() == single.keys() and summaries[name]["steps"] == 3
    for key, value in single.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-5, msg=key)
    if model == "nanogpt":
        loaded = torch.load(root / "nanogpt.pt", weights_only=True)
        assert max((single[k] - v).abs().max().item() for k, v in loaded.items()) > 1e-4  # the steps moved them
    if model in ("nanogpt", "gpt2"):  # the tied tensor is one tensor in what is saved, as single saves it
        assert got["lm_head.weight"].data_ptr() == got["transformer.wte.weight"].data_ptr()
