"""A user's data checked before any worker starts (polytrain/train/data_check.py): each mistake in a factory's
datasets is one line naming the factory, the set, the example and what was expected, with exit 2; data that is
right, with models no one here wrote (a transformers Llama and GPT-2), passes."""

import sys
import types

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from polytrain.cli.main import main
from polytrain.data.base import DataBundle, TensorData
from polytrain.errors import DataError
from polytrain.train import run as run_module
from polytrain.train.data_check import check_user_data


def _pair(n, features=5, classes=3, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, features, generator=g).to(dtype), torch.randint(0, classes, (n,), generator=g))


class Items(Dataset):
    """Four examples, each ``item``."""

    def __init__(self, item):
        self.item = item

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return self.item


class FloatLength(Items):
    def __len__(self):
        return 4.0


@pytest.fixture
def factories(monkeypatch):
    """A real importable module of data and model factories, as `--data user_facs:NAME` names them; launching is
    made to fail loudly, so that every line below is shown to come before any worker starts."""
    module = types.ModuleType("user_facs")
    module.mismatch = lambda: (_pair(50), _pair(13, features=7))
    module.string_test = lambda: (_pair(50), "not a dataset")
    module.float_labels = lambda: (TensorDataset(torch.randn(50, 5), torch.randn(50)), None)
    module.empty_test = lambda: (_pair(50), _pair(0))
    module.dtypes = lambda: (_pair(50), _pair(13, dtype=torch.float64))
    module.label_past_the_classes = lambda: (_pair(50), TensorDataset(torch.randn(2, 5), torch.tensor([1, 5])))
    module.not_pairs = lambda: (Items("text"), None)
    module.float_length = lambda: (_pair(50), FloatLength((torch.zeros(5), 0)))
    module.text_inputs = lambda: (Items(("text", 0)), None)
    module.label_shapes = lambda: (TensorDataset(torch.randn(50, 5), torch.randint(0, 3, (50, 1))), None)
    module.negative_test_label = lambda: (_pair(50), TensorDataset(torch.randn(2, 5), torch.tensor([0, -1])))
    module.binary = lambda: (TensorDataset(torch.randn(50, 5), (torch.arange(50) % 2).float()), None)
    module.three_outputs = lambda: nn.Linear(5, 3)
    module.good = lambda: (_pair(50), _pair(13))
    module.eight_inputs = lambda: nn.Linear(8, 3)  # a model factory that ignores the data's shape
    monkeypatch.setitem(sys.modules, "user_facs", module)

    def no_launch(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(run_module, "launch", no_launch)
    return module


@pytest.mark.parametrize("factory, args, line", [
    ("mismatch", [], "test example 0 has inputs of shape 7, but train example 0's are 5; every example of both "
                     "sets needs inputs of one shape"),
    ("string_test", [], "the test set is a str, not a torch.utils.data.Dataset; return (train, test) datasets "
                        "(test may be None: no evaluation)"),
    ("float_labels", [], "train example 0 has target "),  # a float that is neither 0. nor 1.
    ("empty_test", [], "the test set is empty; give it examples, or return None as the test set (no evaluation)"),
    ("dtypes", [], "test example 0 has torch.float64 inputs, but train example 0's are torch.float32; give both "
                   "sets inputs of one dtype"),
    ("label_past_the_classes", [], "test example 1 has label 5, but the model (mlp) gives 3 scores per example "
                                   "(0..2); labels must be below 3; pass --data-arg num_classes=N"),
    ("not_pairs", [], "train example 0 is a str, not an (input, target) pair"),
    ("float_length", [], "the test set has no length ('float' object cannot be interpreted as an integer); its "
                         "__len__ must return an int"),
    ("text_inputs", [], "train example 0 has an input of type str, which is not a tensor"),
    ("label_shapes", [], "train example 0 has a target of shape 1; a classifier takes one integer label per example"),
    ("negative_test_label", [], "test example 1 has label -1; labels start at 0"),
    ("binary", ["--model", "user_facs:three_outputs"], "the model (user_facs:three_outputs) gives outputs of shape "
                                                       "2x3 for the train set's targets of shape 2 (examples 0, 49), "
                                                       "which the binary loss cannot take: "),
    ("good", ["--model", "user_facs:eight_inputs"], "the model (user_facs:eight_inputs) cannot take the train "
                                                    "set's inputs (examples 0, 49, shape 5, torch.float32): a and b "
                                                    "must have same reduction dim, but got [2, 5] X [8, 3]"),
])
def test_each_mistake_in_a_factory_is_one_line_before_any_worker_starts(factories, capsys, factory, args, line):
    # the default batch (64) is larger than these 50 examples: the data's own mistake is said first
    assert main(["train", "--data", f"user_facs:{factory}", *args]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith(f"polytrain: error: --data user_facs:{factory}: {line}"), err


def test_a_factorys_float_labels_name_the_binary_task_and_a_good_factory_meets_only_the_batch_size(factories, capsys):
    assert main(["train", "--data", "user_facs:float_labels"]) == 2
    assert "float targets mean a binary task, whose targets are 0. or 1.: return integer class labels" \
        in capsys.readouterr().err
    assert main(["train", "--data", "user_facs:good"]) == 2  # no longer "the global batch (64) is larger ..."
    assert capsys.readouterr().err.strip() == ("polytrain: error: --batch-size 64: larger than the training set "
                                               "(50 examples); use a smaller batch")


def test_data_given_from_python_is_checked_and_a_classifier_takes_integer_labels():
    train = TensorData(torch.randn(8, 4), torch.rand(8))
    bundle = DataBundle("mine", train, None, (4,), 3, task="classification")
    with pytest.raises(DataError, match=r"^data=mine: train example 0 has a torch.float32 target \([\d.]+\); a "
                                        r"classifier takes integer class labels \(0./1. float targets: a binary "
                                        r"task\)$"):
        check_user_data(bundle, "data=mine")
    bundle = DataBundle("mine", TensorData(torch.randn(8, 4), torch.arange(8) % 3), None, (6,), 3)
    with pytest.raises(DataError, match=r"^data=mine: train example 0 has inputs of shape 4, but the data says "
                                        r"input_shape 6; make them agree$"):
        check_user_data(bundle, "data=mine")


def _lm_bundle(vocab=64, top=None, seq=16):
    tokens = torch.randint(0, vocab, (10, seq + 1), generator=torch.Generator().manual_seed(0))
    if top is not None:
        tokens[-1, -1] = top  # the last example's last target
    train = TensorData(tokens[:8, :-1], tokens[:8, 1:])
    test = TensorData(tokens[8:, :-1], tokens[8:, 1:])
    return DataBundle("tokens", train, test, (seq,), vocab, task="lm", default_model="transformer_lm",
                      vocab_size=vocab, seq_len=seq)


def test_models_no_one_here_wrote_take_right_data_and_refuse_tokens_past_their_vocabulary():
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32))  # rotary embeddings, grouped-query attention
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                                                n_positions=32, bos_token_id=0, eos_token_id=0))
    before = {k: v.clone() for k, v in llama.state_dict().items()}
    for model in (llama, gpt2):
        check_user_data(_lm_bundle(), "--data tokens", model)  # one forward on the meta device: nothing to say
        check_user_data(_lm_bundle(), "--data tokens", model, own_loss=True)
        model.train()
        with pytest.raises(DataError, match=r"^--data tokens: test example 1 has token id 70, but the model \(given "
                                            r"as a module\) gives 64 scores per token \(0..63\); token ids must be "
                                            r"below 64$"):
            check_user_data(_lm_bundle(top=70), "--data tokens", model)
        assert model.training  # its mode as it was
    assert all(torch.equal(before[k], v) for k, v in llama.state_dict().items())  # its weights untouched
    check_user_data(_lm_bundle(), "--data tokens", model_name="transformer_lm")  # polytrain's own, built on meta
    with pytest.raises(DataError, match=r"^--data tokens: train example 0 has torch.float32 inputs; a language model "
                                        r"takes integer token ids$"):
        bundle = _lm_bundle()
        bundle.train = TensorData(bundle.train.inputs.float(), bundle.train.targets)
        bundle.test = TensorData(bundle.test.inputs.float(), bundle.test.targets)
        check_user_data(bundle, "--data tokens", model_name="transformer_lm")
