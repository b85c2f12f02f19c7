"""Your own training loop with a strategy (README's "your own loop"): the same slices as the trainer, and
``sync`` ends equal to ``single`` on the whole batch."""

import torch
import torch.nn.functional as F

import polytrain
from tests.helpers.spawn import spawn

STEPS, BATCH = 12, 64


def _own_loop(ctx, name):
    strategy = polytrain.strategy(name, ctx)
    data = polytrain.build_data("digits")
    # the initial weights polytrain.fit starts from with seed 0
    model = polytrain.models.build_model("mlp:hidden=32", input_shape=data.input_shape,
                                         num_classes=data.num_classes, seed=0)
    model = strategy.prepare_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for x, y in strategy.batches(data.train, batch_size=BATCH, steps=STEPS):
        seen.append(y.clone())
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    weights = {k: v.detach().clone() for k, v in strategy.unwrap(model).state_dict().items()}
    return weights, seen


def test_an_own_loop_with_sync_equals_single_and_the_trainer(tmp_path):
    (single, single_seen), = polytrain.launch(_own_loop, "single", workers=1)
    ranks = spawn(_own_loop, 2, "sync")
    # each step the two ranks' slices are the single run's whole batch, in order
    for step in range(STEPS):
        assert torch.equal(torch.cat([ranks[0][1][step], ranks[1][1][step]]), single_seen[step])
    for rank_weights, _ in ranks:
        for key, value in single.items():
            torch.testing.assert_close(rank_weights[key], value, rtol=1e-5, atol=1e-6)
    # and polytrain.fit, whose trainer draws batches through the same path, ends at the same weights
    path = tmp_path / "fit.pt"
    polytrain.fit(model="mlp:hidden=32", data="digits", strategy="single", steps=STEPS, batch_size=BATCH,
                  lr=0.1, momentum=0.0, seed=0, eval_every=0, progress="off", save_model=str(path))
    fitted = torch.load(path, weights_only=True)
    for key, value in single.items():
        assert torch.equal(fitted[key], value), key
