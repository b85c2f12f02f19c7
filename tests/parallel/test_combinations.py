"""Degrees that combine, in real gloo processes (a subset of the parity matrix, :mod:`.combinations`): one
8-process run of dp_replicate 2 x dp_shard 2 x tp 2 (HSDP, each replica fsdp x tp) ends where ``single`` ends,
with clipping over parameters placed on two meshes; one 4-process run of pp 2 x tp 2 on a model the tracer
cuts (the plan applied to the stages' graph modules) does too. The last checkpoint of each resumes into
``single`` bit for bit.

The workers are forked from the test's process (``POLYTRAIN_START_METHOD=fork``), which has imported what they
run already: a worker from the forkserver imports the strategies' modules (DTensor, FSDP, tensor parallel) anew,
which took half of this module's CPU with its 8 + 4 workers (62 -> 31 s). The test split is 1/20 of the default:
the final evaluation of a traced pipeline runs its graphs through torch.fx's interpreter, one micro-batch at a
time (with the default split, two thirds of that run's CPU)."""

from __future__ import annotations

import pytest

from tests.helpers.resume import assert_same_state
from tests.helpers.threads import one_thread
from tests.parallel.combinations import CASES, largest_difference, resumed, train

SMALL_TEST = dict(data="text:seq_len=16,test_fraction=0.005")
NAMES = ("hsdp_tp", "pp2_tp2_traced")


@pytest.fixture(scope="module", autouse=True)
def _forked():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("POLYTRAIN_START_METHOD", "fork")
        yield


@pytest.fixture(scope="module")
def runs(tmp_path_factory, _forked):
    tmp = tmp_path_factory.mktemp("combinations")
    with one_thread():  # (single runs in this process)
        single = {"single": train(tmp, "single", strategy="single", **SMALL_TEST)}
        return {**single, **{name: train(tmp, name, **CASES[name], **SMALL_TEST, checkpoint_dir=str(tmp / name))
                             for name in NAMES}}, tmp


@pytest.mark.parametrize("name", NAMES)
def test_each_combination_equals_single(runs, name):
    (single, reference), (combined, model) = runs[0]["single"], runs[0][name]
    difference, where = largest_difference(model, reference)
    assert difference <= 1e-5, where
    assert combined["train_loss"] == pytest.approx(single["train_loss"], rel=1e-6)
    assert combined["bytes_sent"] > 0  # the gathers, reduce-scatters, all-reduces and activations are counted


@pytest.mark.parametrize("name", NAMES)
def test_the_last_checkpoint_of_each_resumes_into_single_bit_for_bit(runs, name):
    held, saved = resumed(runs[1] / name, 8, dict(strategy="single", **SMALL_TEST))
    assert_same_state(held, saved)
