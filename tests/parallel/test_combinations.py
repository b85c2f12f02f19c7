"""Degrees that combine, in real gloo processes (a subset of the parity matrix, :mod:`.combinations`): one
8-process run of dp_replicate 2 x dp_shard 2 x tp 2 (HSDP, each replica fsdp x tp) ends where ``single`` ends,
with clipping over parameters placed on two meshes.

The workers are forked from the test's process (``POLYTRAIN_START_METHOD=fork``), which has imported what they
run already: a worker from the forkserver imports the strategies' modules (DTensor, FSDP, tensor parallel) anew,
which took half of this module's CPU with its 8 + 4 workers (62 -> 31 s)."""

from __future__ import annotations

import pytest

from tests.helpers.resume import assert_same_state
from tests.helpers.threads import one_thread
from tests.parallel.combinations import CASES, LAYOUTS, largest_difference, moved, train


@pytest.fixture(scope="module", autouse=True)
def _forked():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("POLYTRAIN_START_METHOD", "fork")
        yield


@pytest.fixture(scope="module")
def runs(tmp_path_factory, _forked):
    tmp = tmp_path_factory.mktemp("combinations")
    with one_thread():  # (single runs in this process)
        return {name: train(tmp, name, **settings) for name, settings in
                (("single", dict(strategy="single")), ("hsdp_tp", CASES["hsdp_tp"]))}


def test_hsdp_over_fsdp_by_tp_replicas_equals_single(runs):
    (single, reference), (combined, model) = runs["single"], runs["hsdp_tp"]
    difference, where = largest_difference(model, reference)
    assert difference <= 1e-5, where
    assert combined["train_loss"] == pytest.approx(single["train_loss"], rel=1e-6)
    assert combined["bytes_sent"] > 0  # the gathers, reduce-scatters and the replicas' all-reduce are counted


def test_a_checkpoint_of_fsdp_by_tp_resumes_into_single_bit_for_bit(tmp_path):
    held, saved = moved(tmp_path, LAYOUTS["dp_shard2_tp2"], LAYOUTS["single"])
    assert_same_state(held, saved)
