"""Every strategy's checkpoint is single's format, and every strategy resumes single's exactly; together
these cover every ordered pair of strategies (a checkpoint of A is one of single's, which B resumes).

One single run writes the canonical checkpoint at step 4 (Adam: moments and a step count per parameter)
and its own continuation to step 6. Each strategy, in real gloo processes, resumes the step-4 checkpoint,
reads back what it holds before any step (bit for bit the file's model and optimizer state), trains to
step 6 and checkpoints (fsdp: each rank its part, put together on reading): the same tensor names, shapes and dtypes as single's step 6, model and optimizer;
the strategies that equal single (sync, async with one worker, pipeline, hybrid, fsdp) hold its values too. The
examples of steps 5 and 6 (``--log-example-ids``) are single's."""

import shutil

import pytest
import torch

import polytrain
from polytrain.config import make_config
from polytrain.train import example_ids
from polytrain.train.checkpoint import load_checkpoint
from tests.helpers.resume import assert_same_state, resume_and_read_back
from tests.helpers.spawn import spawn

RUN = dict(data="digits", model="mlp:hidden=32", batch_size=64, optimizer="adam", lr=0.003, progress="off",
           log_every=2, eval_every=0, seed=2, timeout=60)

STRATEGIES = [  # (strategy, processes, settings, equals single)
    ("single", 1, {}, True),
    ("sync", 2, dict(workers=2), True),
    ("async", 3, dict(workers=1, servers=2, staleness=0), True),
    ("local-sgd", 2, dict(workers=2, sync_every=2), False),
    ("diloco", 2, dict(workers=2, sync_every=2), False),
    ("pipeline", 2, dict(stages=2, microbatches=2), True),
    ("hybrid", 4, dict(workers=4, dp=2, pp=2, microbatches=2), True),
    ("fsdp", 2, dict(workers=2), True),
]


@pytest.fixture(scope="module")
def canonical(tmp_path_factory):
    root = tmp_path_factory.mktemp("canonical")
    polytrain.fit(**RUN, strategy="single", steps=4, checkpoint_dir=str(root / "four"))
    shutil.copytree(root / "four", root / "six")
    polytrain.fit(**RUN, strategy="single", steps=6, checkpoint_dir=str(root / "six"), resume=True,
                  log_example_ids=str(root / "six.ids"))
    load = lambda name, step: torch.load(root / name / f"step-{step:08d}.pt", weights_only=True)  # noqa: E731
    return root, load("four", 4), load("six", 6)


def _layout(state):
    """What a checkpoint's model and optimizer hold: names, shapes, dtypes (not values)."""
    def describe(t):
        return (tuple(t.shape), t.dtype) if torch.is_tensor(t) else type(t)
    optimizer = state["optimizer"]
    return ({k: describe(v) for k, v in state["model"].items()},
            {i: {k: describe(v) for k, v in s.items()} for i, s in optimizer["state"].items()},
            [sorted(group) for group in optimizer["param_groups"]])


def _close(ours, theirs):
    for name, value in theirs["model"].items():
        torch.testing.assert_close(ours["model"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    for index, state in theirs["optimizer"]["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(ours["optimizer"]["state"][index][key], value, rtol=1e-5, atol=1e-6,
                                       msg=f"optimizer state {index} {key}")


@pytest.mark.parametrize("strategy, processes, settings, equals_single", STRATEGIES, ids=[s[0] for s in STRATEGIES])
def test_resumes_singles_checkpoint_exactly_and_writes_its_format(tmp_path, canonical, strategy, processes,
                                                                  settings, equals_single):
    root, four, six = canonical
    directory = tmp_path / "c"
    directory.mkdir()
    for suffix in (".pt", ".json"):
        shutil.copy(root / "four" / f"step-00000004{suffix}", directory)
    config = make_config(**{**RUN, **settings}, strategy=strategy, steps=6, checkpoint_dir=str(directory), resume=True,
                         log_example_ids=str(tmp_path / "ids"))
    (held, summary), *_ = spawn(resume_and_read_back, processes, config, timeout=60)
    assert_same_state(held, four)
    # steps 5 and 6 trained on single's examples, each once, whichever ranks drew them
    assert example_ids.read(tmp_path / "ids") == example_ids.read(root / "six.ids")
    written = load_checkpoint(directory / "step-00000006.pt")  # fsdp's: put together from its ranks' parts
    assert written["strategy"] == strategy and summary["steps"] == 6
    assert written.get("written_in_parts", 1) == (processes if strategy == "fsdp" else 1)
    assert _layout(written) == _layout(six)
    if equals_single:
        _close(written, six)
