import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from polytrain.errors import ConfigError
from polytrain.tasks import IGNORE_INDEX, get_task, model_loss_of, outputs_of

GEN = torch.Generator().manual_seed(0)


def test_classification_and_binary_keep_their_exact_numerics():
    outputs, targets = torch.randn(16, 10, generator=GEN), torch.randint(0, 10, (16,), generator=GEN)
    task = get_task("classification")
    assert torch.equal(task.loss(outputs, targets), F.cross_entropy(outputs, targets))
    summed, correct, units = task.score(outputs, targets)
    assert torch.equal(summed, F.cross_entropy(outputs, targets, reduction="sum"))
    assert correct == (outputs.argmax(1) == targets).sum() and units == 16 == task.units(targets)
    assert task.metrics(0.5, 0.9) == {}

    logits, labels = torch.randn(16, 1, generator=GEN), torch.randint(0, 2, (16,), generator=GEN).float()
    binary = get_task("binary")
    assert torch.equal(binary.loss(logits, labels), F.binary_cross_entropy_with_logits(logits, labels.view(16, 1)))
    assert binary.score(logits, labels).units == 16


def _lm_batch():
    outputs = torch.randn(3, 5, 7, generator=GEN)
    targets = torch.randint(0, 7, (3, 5), generator=GEN)
    targets[1, 2:] = IGNORE_INDEX
    targets[2, 4:] = IGNORE_INDEX
    return outputs, targets


def test_lm_loss_is_the_mean_over_real_tokens_only():
    outputs, targets = _lm_batch()
    task = get_task("lm")
    real = targets != IGNORE_INDEX
    expected = F.cross_entropy(outputs[real], targets[real])
    assert torch.allclose(task.loss(outputs, targets), expected, rtol=0, atol=1e-6)
    assert task.units(targets) == 5 + 2 + 4 == int(real.sum())
    changed = outputs.clone()
    changed[~real] = 1e3  # what a model predicts at padded positions counts nowhere
    assert torch.equal(task.loss(changed, targets), task.loss(outputs, targets))
    assert [t.item() for t in task.score(changed, targets)] == \
           [t.item() for t in task.score(outputs, targets)]


def test_lm_score_sums_loss_and_correct_tokens_over_real_positions():
    outputs, targets = _lm_batch()
    real = targets != IGNORE_INDEX
    outputs[0, 0] = 0
    outputs[0, 0, targets[0, 0]] = 10  # certainly right
    summed, correct, units = get_task("lm").score(outputs, targets)
    assert units == 11
    assert torch.allclose(summed, F.cross_entropy(outputs[real], targets[real], reduction="sum"))
    assert correct == ((outputs.argmax(-1) == targets) & real).sum() and correct >= 1


def test_lm_metrics_and_shape_errors():
    task = get_task("lm")
    assert task.metrics(math.log(5.0), 0.3) == {"perplexity": pytest.approx(5.0)}
    assert task.metrics(1e6, 0.0) == {"perplexity": math.inf}
    with pytest.raises(ConfigError, match=r"outputs have shape \(3, 7\) for targets of shape \(3, 5\)"):
        task.loss(torch.randn(3, 7), torch.zeros(3, 5, dtype=torch.long))


def test_output_objects_give_their_logits_and_loss():
    logits = torch.randn(2, 4)
    assert outputs_of(logits) is logits
    assert outputs_of({"logits": logits, "loss": None}) is logits
    assert outputs_of(SimpleNamespace(logits=logits, loss=torch.tensor(1.0))) is logits
    assert model_loss_of(SimpleNamespace(logits=logits, loss=torch.tensor(1.5))).item() == 1.5
    task = get_task("classification")
    labels = torch.tensor([0, 3])
    assert torch.equal(task.loss(SimpleNamespace(logits=logits), labels), task.loss(logits, labels))
    with pytest.raises(ConfigError, match="returned list, not a tensor or an object with .logits"):
        outputs_of([logits])
    for no_loss in (logits, {"logits": logits}, SimpleNamespace(logits=logits, loss=None)):
        with pytest.raises(ConfigError, match="^--loss model: the model returned no loss"):
            model_loss_of(no_loss)


def test_a_bundle_naming_an_unknown_task_is_one_line():
    import polytrain
    from polytrain.data.base import DataBundle, TensorData

    data = TensorData(torch.randn(8, 3), torch.tensor([0, 1] * 4))
    bundle = DataBundle(name="t", train=data, test=None, input_shape=(3,), num_classes=2, task="regression")
    with pytest.raises(ConfigError, match=r"^unknown task 'regression'; accepted: classification, binary, lm$"):
        polytrain.fit(data=bundle, model="mlp:hidden=4", strategy="single", batch_size=4, steps=1, progress="off",
                      eval_every=0)
