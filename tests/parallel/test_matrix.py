"""The whole parity matrix of degrees (:mod:`.combinations`): every combination ends within 1e-5 of ``single``;
each one's largest difference is printed. Minutes on 2 cores, so left out of the suite: run it with
``POLYTRAIN_MATRIX=1 python -m pytest -s tests/parallel/test_matrix.py``."""

from __future__ import annotations

import os

import pytest

from tests.helpers.resume import assert_same_state
from tests.parallel.combinations import CASES, LAYOUTS, largest_difference, moved, reference, train

pytestmark = pytest.mark.skipif(not os.environ.get("POLYTRAIN_MATRIX"),
                                reason="the whole matrix takes minutes: POLYTRAIN_MATRIX=1 runs it")


@pytest.fixture(scope="module")
def singles(tmp_path_factory):
    """The single runs, by their settings (made once each)."""
    tmp, made = tmp_path_factory.mktemp("matrix"), {}

    def single(settings):
        key = tuple(sorted(reference(settings).items()))
        if key not in made:
            made[key] = train(tmp, f"single-{len(made)}", **dict(key))
        return made[key]

    return single


@pytest.mark.parametrize("name", list(CASES))
def test_each_combination_equals_single(tmp_path, singles, name):
    summary, model = train(tmp_path, name, **CASES[name])
    single = singles(CASES[name])
    difference, where = largest_difference(model, single[1])
    print(f"\n{name}: largest difference {difference:.3g} ({where}); train loss {summary['train_loss']:.7f} "
          f"(single {single[0]['train_loss']:.7f})")
    assert difference <= 1e-5, where


@pytest.mark.parametrize("source, target", [(s, t) for s in LAYOUTS for t in LAYOUTS if s != t])
def test_a_checkpoint_moves_between_layouts_bit_for_bit(tmp_path, source, target):
    held, saved = moved(tmp_path, LAYOUTS[source], LAYOUTS[target])
    assert_same_state(held, saved)
