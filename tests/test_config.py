import pytest

from polytrain.config import make_config, read_toml, resolve, to_toml
from polytrain.errors import ConfigError


def _write(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def test_defaults_file_and_flags_in_that_order(tmp_path):
    path = _write(tmp_path, 'lr = 0.2\nbatch-size = 32\nmodel = "mlp"\nmodel_args = { hidden = [16, 8] }\n')
    config = resolve(read_toml(path), {"lr": "0.3"}, file_name=path)
    assert config.optim.lr == 0.3  # flag beats file
    assert config.data.batch_size == 32  # file beats default (dash or underscore keys)
    assert config.model.model == "mlp" and config.model.model_args == {"hidden": [16, 8]}
    assert config.optim.optimizer == "sgd"  # untouched default


def test_steps_from_a_flag_override_epochs_from_the_file(tmp_path):
    path = _write(tmp_path, "epochs = 3\n")
    config = resolve(read_toml(path), {"steps": "7"}, file_name=path)
    assert (config.train.steps, config.train.epochs) == (7, None)
    config = resolve(read_toml(path), {}, file_name=path)
    assert (config.train.steps, config.train.epochs) == (None, 3)


def test_both_of_an_exclusive_pair_in_one_place_is_an_error(tmp_path):
    path = _write(tmp_path, "steps = 3\nepochs = 2\n")
    with pytest.raises(ConfigError, match="steps in .* and epochs in .*: give only one of them"):
        resolve(read_toml(path), {}, file_name=path)


def test_a_bad_member_of_an_exclusive_pair_is_named_before_the_clash():
    with pytest.raises(ConfigError, match="^--epochs: must be >= 1, got 0$"):
        resolve({}, {"steps": "1", "epochs": "0"})


@pytest.mark.parametrize("key, value", [("lr", "nan"), ("momentum", "inf"), ("weight_decay", "-inf"),
                                        ("lr", float("nan"))])
def test_float_settings_must_be_finite(key, value):
    with pytest.raises(ConfigError, match=r"must be a finite number, got -?(nan|inf)$"):
        resolve({}, {key: value})


def test_worker_batch_size_replaces_the_global_batch():
    config = make_config(worker_batch_size=16)
    assert config.data.batch_size is None and config.global_batch(4) == 64


def test_unknown_key_names_it_and_suggests(tmp_path):
    path = _write(tmp_path, "learning_rate = 0.1\n")
    with pytest.raises(ConfigError, match="unknown key 'learning_rate'"):
        read_toml(path)
    path = _write(tmp_path, "bach_size = 3\n")
    with pytest.raises(ConfigError, match="did you mean 'batch_size'"):
        read_toml(path)


@pytest.mark.parametrize("flags, message", [
    ({"batch_size": "0"}, "--batch-size: must be >= 1, got 0"),
    ({"batch_size": "many"}, "--batch-size: expected an integer, got 'many'"),
    ({"optimizer": "lion"}, "--optimizer: unknown value 'lion'; accepted: sgd, adam, adamw, rmsprop, adagrad"),
    ({"progress": "fancy"}, "--progress: unknown value 'fancy'; accepted: auto, bar, lines, off"),
    ({"workers": "two"}, "--workers: must be a whole number >= 1 or 'auto', got 'two'"),
    ({"gpu_memory_fraction": "1.5"}, "--gpu-memory-fraction: must be in (0, 1], got 1.5"),
    ({"resume": "perhaps"}, "--resume: expected true or false"),
    ({"model_args": ["hidden"]}, "--model-arg: expected key=value, got 'hidden'"),
])
def test_bad_values_name_the_flag_and_what_is_accepted(flags, message):
    with pytest.raises(ConfigError) as err:
        resolve({}, flags)
    assert message in str(err.value)


def test_bad_value_in_file_names_the_file_key(tmp_path):
    path = _write(tmp_path, 'lr = "fast"\n')
    with pytest.raises(ConfigError, match=r"lr in .*run.toml: expected a number, got 'fast'"):
        resolve(read_toml(path), {}, file_name=path)


def test_invalid_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        read_toml(_write(tmp_path, "lr = = 1\n"))
    with pytest.raises(ConfigError, match="does not exist"):
        read_toml(str(tmp_path / "nope.toml"))


def test_written_config_reads_back_to_the_same_run(tmp_path):
    config = make_config(model="mlp:hidden=32", model_args={"activation": "tanh"}, steps=12, lr=0.125,
                         lr_schedule="exponential:rate=0.5,decay_steps=10", resume=True, checkpoint_dir="ck")
    path = _write(tmp_path, to_toml(config))
    assert resolve(read_toml(path), {}, file_name=path) == config
