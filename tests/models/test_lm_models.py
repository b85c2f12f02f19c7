from types import SimpleNamespace

import pytest
import torch
from torch import nn

from polytrain.data import build_data
from polytrain.data.sentences import Sentences
from polytrain.errors import ConfigError
from polytrain.models import build_model
from polytrain.models.lm import check_lm_compat

SMALL = {"transformer_lm": {"layers": 2, "dim": 32, "heads": 4}, "rnn_lm": {"hidden": 32}}


def _model(name, seq_len=16, **args):
    torch.manual_seed(0)
    return build_model(name, {**SMALL[name], **args}, input_shape=(seq_len,), num_classes=256).eval()


@pytest.mark.parametrize("name", ["transformer_lm", "rnn_lm"])
def test_logits_per_position_and_causal(name):
    model = _model(name)
    tokens = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(1))
    logits = model(tokens)
    assert logits.shape == (3, 16, 256)
    changed = tokens.clone()
    changed[:, 9:] = (changed[:, 9:] + 1) % 256  # the future changes ...
    after = model(changed)
    assert torch.allclose(after[:, :9], logits[:, :9], rtol=0, atol=1e-6)  # ... the past does not see it
    assert not torch.allclose(after[:, 9:], logits[:, 9:])


@pytest.mark.parametrize("name", ["transformer_lm", "rnn_lm"])
def test_padding_after_a_sentence_leaves_its_outputs_alone(name):
    model = _model(name, seq_len=64)
    data = Sentences([b"a much longer sentence than the other", b"short one"])
    x, y = data.get_batch(torch.tensor([0, 1]))
    alone, _ = data.get_batch(torch.tensor([1]))
    real = int(data.lengths[1])
    assert x.shape[1] > real
    assert torch.allclose(model(x)[1, :real], model(alone)[0], atol=1e-5)


def test_transformer_blocks_are_named_for_placement_and_pipelines():
    model = _model("transformer_lm", layers=3)
    top = [name for name, _ in model.named_children()]
    assert top == ["embed", "blocks", "head"] and isinstance(model.blocks, nn.ModuleList)
    assert {name for name, _ in model.named_modules()} >= {"blocks.0", "blocks.1", "blocks.2", "embed.tokens",
                                                           "embed.positions", "head.out"}
    x = model.embed(torch.zeros(1, 4, dtype=torch.long))  # stages compose to the whole model
    for block in model.blocks:
        x = block(x)
    assert torch.equal(model.head(x), model(torch.zeros(1, 4, dtype=torch.long)))


def test_transformer_defaults_and_limits():
    model = build_model("transformer_lm", input_shape=(128,), num_classes=256)
    assert len(model.blocks) == 4 and model.embed.tokens.embedding_dim == 128
    assert model.blocks[0].attn.heads == 4 and model.max_seq_len == 128 and model.vocab_size == 256
    with pytest.raises(ValueError, match="17 tokens is longer than the model's seq_len 16"):
        _model("transformer_lm")(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ConfigError, match="dim 30 does not split into 4 heads"):
        build_model("transformer_lm:dim=30", input_shape=(8,), num_classes=256)


def test_rnn_defaults_are_the_ptb_small_configuration_and_tying_shares_weights():
    model = build_model("rnn_lm", input_shape=(20,), num_classes=256)
    lstm = model.rnn
    assert (lstm.num_layers, lstm.hidden_size, lstm.dropout, model.drop.p) == (2, 200, 0.0, 0.0)
    assert all(p.abs().max() <= 0.1 for p in model.parameters())
    assert model.head.weight is not model.embed.weight
    tied = build_model("rnn_lm:tied=true", input_shape=(20,), num_classes=256)
    assert tied.head.weight is tied.embed.weight
    assert sum(p.numel() for p in tied.parameters()) == sum(p.numel() for p in model.parameters()) - 256 * 200


def test_data_and_model_must_fit_together():
    bundle = build_data("text:seq_len=64")
    check_lm_compat(bundle, _model("transformer_lm", seq_len=64))
    check_lm_compat(bundle, _model("rnn_lm"))  # an RNN takes any length
    with pytest.raises(ConfigError, match=r"^--data text: sequences of up to 64 tokens are longer than the model's "
                                          r"seq_len 32; use --model-arg seq_len=64"):
        check_lm_compat(bundle, _model("transformer_lm", seq_len=32))
    with pytest.raises(ConfigError, match=r"vocabulary of 100 tokens is smaller than the data's token ids "
                                          r"\(up to 125 in text\)"):
        check_lm_compat(bundle, _model("rnn_lm", vocab=100), "rnn_lm")
    check_lm_compat(build_data("digits"), _model("rnn_lm", vocab=2))  # other tasks: nothing to check


def test_hugging_face_style_models_are_read_from_their_config():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = SimpleNamespace(vocab_size=120, n_positions=512)
            self.wte = nn.Embedding(120, 4)

    with pytest.raises(ConfigError, match="vocabulary of 120 tokens"):
        check_lm_compat(build_data("text:seq_len=64"), Tiny())
