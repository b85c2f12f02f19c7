"""Resume without a gather: a checkpoint written in parts by fsdp on 2 workers is resumed by fsdp on 3 and by tp,
each rank reading only the rows it holds (nothing broadcast), to exactly the checkpoint's model and optimizer
state; and a run that fits ``--memory-limit`` only sharded resumes and saves within it (reading the whole
checkpoint on rank 0, as before, does not)."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

import polytrain
from polytrain.config import make_config
from polytrain.train.checkpoint import load_checkpoint
from tests.helpers.resume import assert_same_state
from tests.helpers.spawn import spawn
from tests.weights.conftest import LM


def _resumed(ctx, config):
    """What this rank read resuming, of the checkpoint's tensors, and (rank 0) the whole state it then holds."""
    from polytrain.train.trainer import Trainer

    trainer = Trainer(config, ctx.topology)
    held = copy.deepcopy(trainer.session.state_dict(trainer.session.start_step))
    return trainer.strategy.held_state.read, held


@pytest.mark.parametrize("target", [dict(strategy="fsdp", workers=3), dict(strategy="tp", workers=2, tp=2)],
                         ids=["fsdp-3", "tp-2"])
def test_parts_resume_at_another_world_size_and_strategy_reading_only_rows(lm_parts, tmp_path, target):
    ckpt = tmp_path / "ck"
    shutil.copytree(lm_parts, ckpt)
    config = make_config(**LM, **target, steps=4, lr=0.01, checkpoint_dir=str(ckpt), resume=True)
    ranks = spawn(_resumed, target["workers"], config)
    saved = load_checkpoint(ckpt / "step-00000002.pt")  # its parts put together: single's layout
    assert_same_state(ranks[0][1], saved)  # before the first step: exactly the checkpoint's, bit for bit
    for (read, whole), _ in ranks:
        assert 0 < read < whole
    if target["strategy"] == "fsdp":  # each its third of the rows (and the 0-dim step counts whole)
        assert all(read < 0.4 * whole for (read, whole), _ in ranks)


#: test_fraction 0.005: each run's final evaluation (4 examples a batch, to stay within the limit) is 15 batches a
#: rank over 119 windows, not 299 over 2,391
MEMORY = dict(strategy="fsdp", workers=2, model="transformer_lm:layers=2,dim=256,heads=4",
              data="text:seq_len=16,test_fraction=0.005", batch_size=4, optimizer="adam", lr=0.001, seed=3,
              eval_every=0, eval_batch_size=4, progress="off", threads_per_worker=1, timeout=180, memory_limit="48MiB")


@pytest.mark.slow
def test_a_sharded_run_resumes_and_saves_within_its_memory_limit(tmp_path):
    """1.6 M parameters, Adam: a checkpoint of 19.6 MiB of model and optimizer tensors. Under 48 MiB a worker
    (and under 64), reading it whole on rank 0 and broadcasting it stopped at 41.5 MiB in use, allocating the
    pickled state; each rank reading its rows (9.8 MiB) resumes, and --save-model DIR writes one tensor at a
    time."""
    ckpt, saved = tmp_path / "ck", tmp_path / "saved"
    polytrain.fit(**MEMORY, steps=1, checkpoint_dir=str(ckpt))
    summary = polytrain.fit(**MEMORY, steps=2, checkpoint_dir=str(ckpt), resume=True, save_model=str(saved))
    assert summary["steps"] == 2
    from safetensors.torch import load_file

    written = {}
    for shard in saved.glob("model-*-of-*.safetensors"):
        written.update(load_file(shard))
    at_2 = load_checkpoint(ckpt / "step-00000002.pt")["model"]
    assert written.keys() == at_2.keys() and all(torch.equal(written[k], at_2[k]) for k in at_2)
