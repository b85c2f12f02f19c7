"""sync --compress: fp16/bf16/PowerSGD hooks on real gloo workers; bytes counted as the hooks send them."""

import pytest
import torch

from polytrain.config import make_config
from polytrain.data.base import DataBundle, TensorData
from polytrain.errors import ConfigError
from polytrain.strategies.compress import Compression, parse_compress, steady_ratio
from polytrain.strategies.traffic import ring_all_reduce_bytes
from polytrain.train.trainer import Trainer
from tests.helpers.spawn import spawn

STEPS = 12


def _bundle() -> DataBundle:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(96, 64, generator=gen)
    y = (x[:, :10].argmax(1)).long()  # learnable labels
    return DataBundle("compress", TensorData(x[:80], y[:80]), TensorData(x[80:], y[80:]), (64,), 10)


def _config(compress: str, **extra):
    return make_config(strategy="sync", model="mlp:hidden=96x48", optimizer="sgd", lr=0.05, momentum=0.9,
                       batch_size=16, steps=STEPS, seed=5, progress="off", eval_every=0, comm="backend",
                       compress=compress, **extra)


def _train(ctx, bundle, settings):
    out = {}
    for compress in settings:
        trainer = Trainer(_config(compress), ctx.topology, data=bundle)
        summary = trainer.fit()
        strategy = trainer.session.strategy
        power = None
        if compress.startswith("powersgd"):  # torch's own count of what PowerSGD all-reduced
            power = strategy.compression_state.power.compression_stats()[1:]
        params = {k: v.detach().clone() for k, v in strategy.module.state_dict().items()}
        out[compress] = (params, summary["rank_bytes_sent"], strategy.describe(), power, summary["train_loss"])
    return out


def test_parse_compress():
    assert parse_compress("off") == Compression("off")
    assert parse_compress("bf16") == Compression("bf16")
    assert parse_compress("powersgd:rank=4") == Compression("powersgd", 4, 2)
    assert parse_compress("powersgd:rank=2:start=10") == Compression("powersgd", 2, 10)
    for bad, why in (("gzip", "accepted: off, fp16"), ("powersgd", "needs rank=R"), ("powersgd:rank=x", "whole"),
                     ("powersgd:rank=4:start=1", "start must be >= 2"), ("powersgd:r=4", "expected powersgd")):
        with pytest.raises(ValueError, match=why):
            parse_compress(bad)
    with pytest.raises(ConfigError, match="--compress: unknown value 'gzip'"):
        make_config(compress="gzip")
    # the shapes the digits CNN has: PowerSGD rank 4 all-reduces 21x fewer elements once it starts
    digits = [(32, 1, 3, 3), (32,), (64, 32, 3, 3), (64,), (128, 1024), (128,), (10, 128), (10,)]
    assert steady_ratio(digits, 4) == pytest.approx(151306 / 7090)


def test_compress_with_shared_memory_is_refused_before_launch():
    from polytrain.train.run import check

    with pytest.raises(ConfigError, match="--compress fp16 compresses what the process group's all-reduce "
                                          "sends, and --comm shm"):
        check(make_config(strategy="sync", workers=2, compress="fp16", comm="shm"))


def test_compressed_gradients_train_like_sync_and_count_what_they_send():
    bundle = _bundle()
    settings = ["off", "fp16", "bf16", "powersgd:rank=2"]
    results = spawn(_train, 2, bundle, settings)
    for rank in results:  # every replica holds the same model
        for compress in settings:
            for key, value in rank[compress][0].items():
                assert torch.equal(value, results[0][compress][0][key]), (compress, key)
    ranks = results[0]
    plain, plain_sent, described, _, _ = ranks["off"]
    assert "compressed" not in described and "all-reduced in" not in described
    payload = sum(v.numel() for v in plain.values()) * 4
    assert plain_sent == [round(STEPS * ring_all_reduce_bytes(payload, 2))] * 2  # one bucket a step

    def distance(compress):
        got = ranks[compress][0]
        return max(((got[k] - plain[k]).abs().max() / plain[k].abs().max()).item() for k in plain)

    for half in ("fp16", "bf16"):
        _, sent, described, _, _ = ranks[half]
        assert f"gradients all-reduced in {half}" in described
        assert sent == [plain_sent[0] // 2] * 2
        assert 0 < distance(half) < (2e-3 if half == "fp16" else 2e-2)  # rounding, not a different update

    params, sent, described, (before, after), loss = ranks["powersgd:rank=2"]
    assert "PowerSGD (rank 2, error feedback, from step 2)" in described
    # the first two steps whole, then what torch's own statistics say PowerSGD all-reduced
    assert after < before / 3
    assert sent[0] == pytest.approx(2 * ring_all_reduce_bytes(payload, 2) + ring_all_reduce_bytes(4 * after, 2),
                                    abs=4)
    assert abs(loss - ranks["off"][4]) < 0.15  # it learns as sync does (1.97 against 2.03 measured)
    assert distance("powersgd:rank=2") > 1e-3  # and is a different update from sync's
