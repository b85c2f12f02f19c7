"""diloco's outer exchange: one fragment, no overlap, no quantisation is plain DiLoCo bit for bit; fragments
meet on their staggered steps; quantised outer gradients send int8/int4 and still train (real gloo workers)."""

import pytest
import torch

from polytrain.config import make_config
from polytrain.errors import ConfigError
from polytrain.strategies.periodic import Diloco, LocalSGD
from polytrain.strategies.streaming import (BLOCK, dequantize, meets, quantize, quantized_bytes,
                                            split_fragments)
from polytrain.train.run import check
from polytrain.train.trainer import Trainer
from tests.helpers.spawn import spawn
from tests.strategies.test_periodic import _bundle, _relative_error

BASE = dict(strategy="diloco", model="mlp:hidden=32", optimizer="sgd", momentum=0.9, lr=0.05, batch_size=16,
            steps=12, seed=3, progress="off", eval_every=0, log_every=4, sync_every=4)


class PlainDiloco(Diloco):
    """DiLoCo as it was written before the outer exchange: every H steps, _meet (average, outer step)."""

    train_step = LocalSGD.train_step


def test_quantize_round_trip_and_sizes():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    for bits, top in ((8, 127), (4, 7)):
        data = quantize(x, bits)
        assert data.dtype == torch.uint8 and data.numel() == quantized_bytes(1000, bits)
        back = dequantize(data, 1000, bits)
        for block in range(0, 1000, BLOCK):  # within half a step of each block's scale
            part = x[block:block + BLOCK]
            assert (back[block:block + BLOCK] - part).abs().max() <= part.abs().max() / top / 2 + 1e-7
    assert quantized_bytes(1000, 8) == 1024 + 16 and quantized_bytes(1000, 4) == 512 + 16
    assert torch.equal(dequantize(quantize(torch.zeros(5), 4), 5, 4), torch.zeros(5))


def test_fragments_and_their_schedule():
    assert split_fragments([10, 10, 10, 10], 1) == [[0, 1, 2, 3]]
    assert split_fragments([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert split_fragments([100, 1, 1, 1], 3) == [[0], [1], [2, 3]]  # none empty
    assert split_fragments([1, 1, 100], 3) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="cannot cut 2 parameter tensor"):
        split_fragments([1, 1], 3)
    # H = 8, F = 4: fragment p at steps 2p + 8k; fragment 0 where plain DiLoCo meets
    assert [s for s in range(1, 17) if meets(0, 4, 8, s)] == [8, 16]
    assert [s for s in range(1, 17) if meets(1, 4, 8, s)] == [2, 10]
    assert [s for s in range(1, 17) if meets(3, 4, 8, s)] == [6, 14]


def test_bad_streaming_settings_are_one_line_before_start():
    for extra, message in ((dict(fragments=5), "--fragments 5 is more than --sync-every 4"),
                           (dict(overlap_steps=4), "--overlap-steps 4 must be below --sync-every 4"),
                           (dict(outer_error_feedback=True), "--outer-error-feedback keeps what --outer-quantize"),
                           (dict(overlap_mix=1.5), "--overlap-mix: must be between 0 and 1")):
        with pytest.raises(ConfigError, match=message):
            check(make_config(**{**BASE, "workers": 2, **extra}))
    with pytest.raises(ConfigError, match="--fragments sets the outer step of --strategy diloco; --strategy "
                                          "local-sgd averages"):
        check(make_config(**{**BASE, "strategy": "local-sgd", "workers": 2, "fragments": 2}))


def test_more_fragments_than_parameter_tensors_is_one_line():
    from polytrain.distributed.topology import Topology

    config = make_config(**{**BASE, "workers": 1, "sync_every": 8, "fragments": 5})  # mlp:hidden=32: 4 tensors
    with pytest.raises(ConfigError, match=r"--fragments 5: cannot cut 4 parameter tensor\(s\) into 5 "
                                          r"fragment\(s\); give fewer fragments"):
        Trainer(config, Topology(), data=_bundle())


def _runs(ctx, bundle):
    out = {}
    for name, extra in (("plain", dict(strategy=f"{__name__}:PlainDiloco")),
                        ("f1", {}),
                        ("f2", dict(fragments=2)),
                        ("f2-overlap", dict(fragments=2, overlap_steps=1)),
                        ("int8", dict(outer_quantize="int8")),
                        ("int4-ef", dict(outer_quantize="int4", outer_error_feedback=True))):
        trainer = Trainer(make_config(**{**BASE, **extra}), ctx.topology, data=bundle)
        summary = trainer.fit()
        strategy = trainer.strategy
        module = {k: v.detach().clone() for k, v in strategy.module.state_dict().items()}
        out[name] = (module, summary["rank_bytes_sent"][0], summary["train_loss"], strategy.describe(),
                     [g[:] for g in strategy.exchange.groups] if name != "plain" else None)
    return out


def test_outer_exchange_on_two_workers():
    ranks = spawn(_runs, 2, _bundle())
    zero, one = ranks
    plain, plain_sent = zero["plain"][0], zero["plain"][1]
    # one fragment, no overlap, no quantisation: plain DiLoCo, bit for bit, on every rank
    for rank in ranks:
        for key, value in rank["f1"][0].items():
            assert torch.equal(value, rank["plain"][0][key]), key
    assert zero["f1"][1] == plain_sent

    # two fragments: the same bytes over the run, and at the end (step 12) fragment 0 has just met (equal on
    # both workers) while fragment 1 met at step 10 and has trained apart since
    module, sent, loss, described, groups = zero["f2"]
    assert "2 fragments staggered by 2 step(s)" in described
    assert sent == plain_sent and groups == [[0], [1, 2, 3]]  # 640 of 804 values in the first layer
    keys = list(module)
    assert all(torch.equal(module[keys[i]], one["f2"][0][keys[i]]) for i in groups[0])
    assert all(not torch.equal(module[keys[i]], one["f2"][0][keys[i]]) for i in groups[1])
    assert abs(loss - zero["plain"][2]) < 0.2

    # overlapped: the same bytes, trains as well
    _, sent, loss, described, _ = zero["f2-overlap"]
    assert "overlapped with 1 inner step(s) (mix 0.5)" in described
    assert sent == plain_sent and abs(loss - zero["plain"][2]) < 0.2

    # quantised outer gradients: about a quarter (int8) or an eighth (int4) of the bytes, close to plain
    numel = sum(v.numel() for v in plain.values())
    for name, bits in (("int8", 8), ("int4-ef", 4)):
        module, sent, loss, described, _ = zero[name]
        assert f"outer gradients sent as int{bits}" in described
        assert sent == 3 * quantized_bytes(numel, bits)  # 3 meetings, all-gather of 2: one payload each
        assert abs(loss - zero["plain"][2]) < 0.2
        assert _relative_error(module, plain) < (0.02 if bits == 8 else 0.1)
        assert all(torch.equal(module[k], one[name][0][k]) for k in module)  # every rank the same outer step
