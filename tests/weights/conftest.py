"""Runs the weights tests share: a checkpoint written in parts by a 2-worker fsdp run."""

from __future__ import annotations

import pytest

import polytrain

#: a tiny transformer_lm; global batch 12 divides over 2, 3 and 4 workers
LM = dict(model="transformer_lm:layers=2,dim=32,heads=2", data="text:seq_len=16", batch_size=12, eval_every=0,
          progress="off", timeout=120, optimizer="adam", seed=3)


@pytest.fixture(scope="package")
def lm_parts(tmp_path_factory):
    """A 2-worker fsdp run of :data:`LM` (Adam) that checkpointed in parts at step 2."""
    directory = tmp_path_factory.mktemp("fsdp") / "ck"
    polytrain.fit(**LM, strategy="fsdp", workers=2, steps=2, lr=0.01, checkpoint_dir=str(directory))
    return directory
