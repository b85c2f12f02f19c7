"""local-sgd and diloco on real gloo workers: with H = 1 they are sync, with H > 1 they still learn digits,
exchange H times fewer bytes, and their checkpoints hold the whole model (and diloco's outer state)."""

import pytest
import torch

from polytrain.config import make_config
from polytrain.data.base import DataBundle, TensorData
from polytrain.errors import ConfigError
from polytrain.train.run import check
from polytrain.train.trainer import Trainer
from tests.helpers.spawn import spawn

PARITY = dict(model="mlp:hidden=32", optimizer="sgd", momentum=0.0, lr=0.05, batch_size=16, steps=12, seed=3,
              progress="off", eval_every=0, log_every=4)


def _bundle() -> DataBundle:
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(120, 20, generator=gen)
    y = (x[:, :10].sum(1) > 0).long() + 2 * (x[:, 10:].sum(1) > 0).long()
    return DataBundle("parity", TensorData(x[:96], y[:96]), TensorData(x[96:], y[96:]), (20,), 4)


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.strategy.module.state_dict().items()}


def _relative_error(a: dict, b: dict) -> float:
    diff = torch.sqrt(sum(((a[k] - b[k]).double() ** 2).sum() for k in a))
    return (diff / torch.sqrt(sum((b[k].double() ** 2).sum() for k in b))).item()


def _parity_runs(ctx, bundle):
    out = {}
    for name, extra in (("sync", dict(strategy="sync", comm="backend")),
                        ("local-sgd", dict(strategy="local-sgd", sync_every=1)),
                        ("diloco", dict(strategy="diloco", sync_every=1, outer_lr=1.0, outer_momentum=0.0)),
                        ("local-sgd-4", dict(strategy="local-sgd", sync_every=4))):
        trainer = Trainer(make_config(**PARITY, **extra), ctx.topology, data=bundle)
        summary = trainer.fit()
        out[name] = (_params(trainer), summary)
    return out


def test_sync_every_1_equals_sync_and_bytes_scale_with_h():
    bundle = _bundle()
    ranks = spawn(_parity_runs, 2, bundle)
    for rank in ranks:
        reference = rank["sync"][0]
        for name in ("local-sgd", "diloco"):
            error = _relative_error(rank[name][0], reference)
            assert error < 1e-5, f"{name} --sync-every 1 is {error:.2e} from sync"
        # H = 4 really trains apart between meetings (else the test above proves nothing about averaging)
        assert _relative_error(rank["local-sgd-4"][0], reference) > 1e-4
    summaries = {name: ranks[0][name][1] for name in ranks[0]}
    payload = sum(p.numel() * 4 for p in reference.values())  # float32: the gradients sync all-reduces
    # ring model on 2 ranks: each sends and receives 2 (N-1)/N = 1 x the payload per all-reduce
    assert summaries["sync"]["rank_bytes_sent"] == [payload * 12] * 2
    assert summaries["local-sgd"]["bytes_sent"] == summaries["sync"]["bytes_sent"]
    assert summaries["local-sgd-4"]["rank_bytes_received"] == [payload * 3] * 2  # steps 4, 8, 12
    assert summaries["local-sgd-4"]["bytes_sent_per_example"] == pytest.approx(2 * payload * 3 / (12 * 16))


def _digits_runs(ctx):
    accuracy = {}
    # DiLoCo's own outer momentum (0.9) needs more outer steps than 30 rounds give; 0.5 suits short runs
    for extra in (dict(strategy="local-sgd", sync_every=4),
                  dict(strategy="diloco", sync_every=4, outer_lr=0.7, outer_momentum=0.5)):
        config = make_config(data="digits", model="mlp:hidden=64", optimizer="sgd", momentum=0.9, lr=0.05,
                             batch_size=64, steps=120, eval_every=0, progress="off", seed=0, **extra)
        accuracy[extra["strategy"]] = Trainer(config, ctx.topology).fit()["eval_accuracy"]
    return accuracy


def test_local_sgd_and_diloco_learn_digits():
    accuracy = spawn(_digits_runs, 2)[0]
    assert accuracy["local-sgd"] >= 0.93, accuracy
    assert accuracy["diloco"] >= 0.93, accuracy


def _resume_runs(ctx, bundle, ckpt):
    # outer momentum 0.9: the resumed run matches only if the anchor and the momentum came back
    common = dict(PARITY, strategy="diloco", sync_every=4, outer_lr=0.7, outer_momentum=0.9)
    whole = Trainer(make_config(**dict(common, steps=12)), ctx.topology, data=bundle)
    whole.fit()
    Trainer(make_config(**dict(common, steps=8), checkpoint_dir=ckpt), ctx.topology, data=bundle).fit()
    resumed = Trainer(make_config(**dict(common, steps=12), checkpoint_dir=ckpt, resume=True), ctx.topology,
                      data=bundle)
    resumed.fit()
    # mid-round (step 6 of a 4-step round): the saved model is the replicas' average, the replicas stay apart
    mid = Trainer(make_config(**dict(common, steps=6)), ctx.topology, data=bundle)
    mid.fit()
    own = _params(mid)
    # a collective, like every call the trainer makes
    saved = (mid.strategy.state_dict(optimizer=False) or {}).get("model")
    replicas = ctx.topology.all_gather_object(own)
    return _params(whole), _params(resumed), own, _params(mid), saved, replicas


def test_diloco_resumes_at_a_sync_point_and_saves_the_average_mid_round(tmp_path):
    ranks = spawn(_resume_runs, 2, _bundle(), str(tmp_path / "ckpt"))
    for whole, resumed, own, after, _, _ in ranks:
        assert _relative_error(resumed, whole) < 1e-6
        assert all(torch.equal(own[k], after[k]) for k in own), "saving mid-round left the replica alone"
    saved, replicas = ranks[0][4], ranks[0][5]
    assert _relative_error(replicas[0], replicas[1]) > 1e-4  # mid-round the replicas differ
    mean = {k: (replicas[0][k] + replicas[1][k]) / 2 for k in replicas[0]}
    assert _relative_error(saved, mean) < 1e-6
    assert ranks[1][4] is None


def test_bad_periodic_settings_are_one_clear_error_before_start():
    with pytest.raises(ConfigError, match=r"--sync-every: must be >= 1, got 0"):
        make_config(strategy="diloco", sync_every=0)
    with pytest.raises(ConfigError, match=r"--outer-momentum: must be below 1"):
        make_config(strategy="diloco", outer_momentum=1.0)
    with pytest.raises(ConfigError, match=r"--outer-lr sets the outer step of --strategy diloco"):
        check(make_config(strategy="local-sgd", outer_lr=0.5, workers=2, data="digits"))
