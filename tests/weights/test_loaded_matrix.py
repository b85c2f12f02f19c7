"""A user's loaded weights are the weights trained, under every strategy, for models no one here wrote
(:mod:`tests.weights.loaded_matrix`): one step at lr 0 saves exactly the weights the model's own code loaded,
and eight Adam steps end as ``single`` does, within ``sync``'s own distance from it. A bounded set of the
matrix: every model and every strategy at least once (each model in turn), and a model that has no
tensor-parallel plan refused under tp with its one line. ``python benchmarks/loaded_weights.py`` runs the
whole matrix and prints each cell's difference."""

from __future__ import annotations

import pytest

from tests.helpers.threads import one_thread
from tests.weights.loaded_matrix import MODELS, STRATEGIES, adam_bound, largest_difference, loaded_weights, \
    run_cells, saved_path, write_models

pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

LR0 = [("unit_gpt", "single"), ("gpt2", "sync-2"), ("unit_gpt", "fsdp-2"), ("nanogpt", "pipeline-2"),
       ("llama", "tp-2"), ("gpt2", "hybrid-2x2"), ("llama", "hsdp-2x2"), ("nanogpt", "hsdp-2x2")]
REFUSED = [("nanogpt", "tp-2")]  # fused qkv, no plan of its own: refused, not split wrong
ADAM = ["single", "sync-2", "tp-2"]  # tp: the largest distance from single in the whole matrix (llama)
NO_PLAN = ("--tp: --model the model has no tensor-parallel plan; give one with --tp-plan FILE.toml (module name = "
           "\"colwise\" or \"rowwise\"; see docs/tensor-parallel.md)")


def test_the_bounded_set_has_every_model_and_every_strategy():
    assert {m for m, _ in LR0} == set(MODELS)
    assert {s for _, s in LR0} == set(STRATEGIES) - {"hybrid-shard-2x2"}  # (tests/parallel/test_model_shapes.py)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("loaded")
    cells = [(m, s, "lr0") for m, s in LR0 + REFUSED] + [("llama", s, "adam") for s in ADAM]
    with pytest.MonkeyPatch.context() as patch, one_thread():
        patch.setenv("POLYTRAIN_START_METHOD", "fork")  # the workers inherit transformers, imported here
        results = run_cells(root, cells)
        return root, results, write_models(root)


@pytest.mark.parametrize("model, strategy", LR0, ids=[f"{m}-{s}" for m, s in LR0])
def test_one_step_at_lr_0_saves_exactly_the_loaded_weights(matrix, model, strategy):
    root, results, files = matrix
    summary = results[(model, strategy, "lr0")]
    assert isinstance(summary, dict) and summary["steps"] == 1, summary
    assert largest_difference(root, (model, strategy, "lr0"), loaded_weights(model, files[model])) <= 1e-7


def test_a_model_without_a_tensor_parallel_plan_is_refused_in_one_line(matrix):
    root, results, _ = matrix
    for model, strategy in REFUSED:
        assert results[(model, strategy, "lr0")] == NO_PLAN
        assert not saved_path(root, (model, strategy, "lr0")).exists()


def test_eight_adam_steps_equal_single_within_syncs_own_distance(matrix):
    import torch

    root, results, files = matrix
    assert all(isinstance(results[("llama", s, "adam")], dict) for s in ADAM), results
    single = torch.load(saved_path(root, ("llama", "single", "adam")), weights_only=True)
    assert largest_difference(root, ("llama", "single", "adam"), loaded_weights("llama", files["llama"])) > 1e-3
    sync = largest_difference(root, ("llama", "sync-2", "adam"), single)
    assert largest_difference(root, ("llama", "tp-2", "adam"), single) <= adam_bound(sync)
