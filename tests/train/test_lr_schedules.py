import math

import pytest

from polytrain.errors import ConfigError
from polytrain.train.lr_schedules import parse_lr_schedule, scaled_lr


def test_constant_is_constant():
    s = parse_lr_schedule("constant", 0.1, 100)
    assert [s(i) for i in (0, 50, 99)] == [0.1, 0.1, 0.1]


@pytest.mark.parametrize("step", [0, 1, 999, 1000, 1500, 2500, 10_000])
def test_exponential_matches_tensorflow_formula(step):
    s = parse_lr_schedule("exponential:rate=0.1,decay_steps=1000", 0.5, 20_000)
    assert s(step) == pytest.approx(0.5 * 0.1 ** (step / 1000), rel=1e-12)


def test_staircase_decays_in_whole_steps():
    s = parse_lr_schedule("exponential:rate=0.5,decay_steps=100,staircase=true", 1.0, 1000)
    assert [s(i) for i in (0, 99, 100, 199, 200, 350)] == [1.0, 1.0, 0.5, 0.5, 0.25, 0.125]
    smooth = parse_lr_schedule("exponential:rate=0.5,decay_steps=100", 1.0, 1000)
    assert smooth(99) < 1.0  # without staircase the decay is continuous


def test_cosine_with_warmup_follows_formula():
    base, total, warm, floor = 0.4, 1100, 100, 0.01
    s = parse_lr_schedule(f"cosine:warmup={warm},min_lr={floor}", base, total)
    for step in (0, 49, 99):
        assert s(step) == pytest.approx(base * (step + 1) / warm)
    for step in (100, 350, 600, 1099):
        progress = (step - warm) / (total - 1 - warm)
        assert s(step) == pytest.approx(floor + (base - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
    assert s(100) == pytest.approx(base) and s(total - 1) == pytest.approx(floor)


def test_linear_reaches_min_lr_at_the_end():
    s = parse_lr_schedule("linear:min_lr=0.0", 1.0, 11)
    assert s(0) == pytest.approx(1.0) and s(10) == pytest.approx(0.0) and s(5) == pytest.approx(0.5)


def test_schedule_prints_its_spec():
    assert str(parse_lr_schedule("exponential:decay_steps=10,rate=0.5,warmup=3", 1, 10)) == \
        "exponential:rate=0.5,decay_steps=10,staircase=false,warmup=3"


@pytest.mark.parametrize("spec, needle", [
    ("expo", "unknown schedule 'expo'; accepted: constant, exponential, cosine, linear"),
    ("exponential:rate=0.1", "missing decay_steps"),
    ("exponential:rate=0.1,decay_steps=0", "decay_steps must be > 0"),
    ("exponential:rate=0.1,decay_steps=10,staircase=maybe", "staircase must be true or false"),
    ("cosine:floor=0.1", "unknown argument(s) floor; accepted: min_lr, warmup"),
    ("cosine:warmup=-5", "warmup must be an integer >= 0"),
    ("cosine:5", "--lr-schedule: write arguments as key=value, e.g. exponential:rate=0.1,decay_steps=1000"),
    ("exponential:rate=0,decay_steps=10", "--lr-schedule exponential: rate must be a number > 0, got 0"),
    ("linear:min_lr=-0.1", "--lr-schedule linear: min_lr must be a number >= 0, got -0.1"),
    ("cosine:min_lr=true", "--lr-schedule cosine: min_lr must be a number >= 0, got True"),
    ("linear:min_lr=1e400", "--lr-schedule linear: min_lr must be a number >= 0, got inf"),
    ("exponential:rate=1e400,decay_steps=10", "--lr-schedule exponential: rate must be a number > 0, got inf"),
])
def test_bad_specs_name_the_problem(spec, needle):
    with pytest.raises(ConfigError, match=None) as err:
        parse_lr_schedule(spec, 0.1, 100)
    assert needle in str(err.value)


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_a_floor_above_the_learning_rate_is_refused(kind):
    with pytest.raises(ConfigError) as err:
        parse_lr_schedule(f"{kind}:min_lr=1,warmup=5", 0.1, 100)
    assert str(err.value) == (f"--lr-schedule {kind}: min_lr 1 is above the learning rate 0.1 it decays from (--lr, "
                              "scaled if --lr-scaling is set); give a min_lr <= 0.1, or a higher --lr")
    flat = parse_lr_schedule(f"{kind}:min_lr=0.1", 0.1, 100)  # a floor at the learning rate: constant
    assert flat(0) == pytest.approx(0.1) and flat(99) == pytest.approx(0.1)


def test_train_refuses_a_floor_above_the_learning_rate_before_any_worker_starts(capsys):
    from polytrain.cli.main import main

    code = main(["train", "--strategy", "sync", "--workers", "2", "--lr", "0.1", "--lr-schedule", "cosine:min_lr=1",
                 "--steps", "5", "--progress", "off"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")  # no worker's line: refused in this process
    assert err == ("polytrain: error: --lr-schedule cosine: min_lr 1 is above the learning rate 0.1 it decays from "
                   "(--lr, scaled if --lr-scaling is set); give a min_lr <= 0.1, or a higher --lr\n")


def test_large_batch_scaling():
    assert scaled_lr(0.1, "linear", 1024, 256) == pytest.approx(0.4)
    assert scaled_lr(0.1, "sqrt", 1024, 256) == pytest.approx(0.2)
    assert scaled_lr(0.1, "none", 1024, None) == 0.1
    with pytest.raises(ConfigError, match="needs --base-batch-size"):
        scaled_lr(0.1, "linear", 1024, None)
