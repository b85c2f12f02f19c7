"""The compact spec grammar (``NAME:key=value,...``) and user factories: each malformed spec is one line naming
the flag and the part that is wrong."""

import re

import pytest

from polytrain.errors import ConfigError
from polytrain.models.registry import build_model
from polytrain.specs import call_with_accepted, load_factory, parse_spec


@pytest.mark.parametrize("text, message", [
    ("  ", "--model: empty value; expected NAME or NAME:key=value,..."),
    (":hidden=8", "--model: ':hidden=8' has no name before ':'"),
    ("mlp:hidden=8,,act=tanh", "--model: empty item in 'mlp:hidden=8,,act=tanh' (two commas in a row?)"),
    ("mlp:2x=8", "--model: '2x' in 'mlp:2x=8' is not a valid argument name"),
    ("mlp:hidden=8,hidden=4", "--model: 'hidden' is given twice in 'mlp:hidden=8,hidden=4'"),
])
def test_malformed_specs_name_the_flag_and_the_part(text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_spec(text, what="--model")


@pytest.mark.parametrize("path, message", [
    ("polytrain.specs:no_such_factory", "--model: module 'polytrain.specs' has no attribute 'no_such_factory'"),
    ("polytrain.specs:_INT", "--model: 'polytrain.specs:_INT' is not callable"),  # a compiled regex
])
def test_a_factory_path_must_name_a_callable(path, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_factory(path, what="--model")
    with pytest.raises(ConfigError, match=re.escape(message)):  # and so through --model itself
        build_model(path, input_shape=(4,), num_classes=2)


def test_a_factory_that_refuses_its_arguments_is_one_line():
    def factory(width: int, depth: int):
        return width * depth

    with pytest.raises(ConfigError, match=r"^--model mine: .*missing 1 required positional argument: 'depth' "
                                          r"\(given width=3\)$"):
        call_with_accepted(factory, "--model mine", width=3)


def test_model_argument_errors_list_only_what_the_user_may_give_and_echo_a_bad_value():
    from polytrain.models.registry import build_model

    with pytest.raises(ConfigError, match=r"^--model mlp:foo=1: unknown argument\(s\) foo; accepted: hidden, "
                                          r"activation$"):
        build_model("mlp:foo=1", input_shape=(64,), num_classes=10)  # input_shape/num_classes are polytrain's
    with pytest.raises(ConfigError, match=r"^--model mlp:hidden=0.5: .* \(given hidden=0.5\)$"):
        build_model("mlp:hidden=0.5", input_shape=(64,), num_classes=10)


def test_text_where_a_factory_takes_numbers_is_one_line_before_launch(capsys):
    from polytrain.cli.main import main

    assert main(["train", "--model", "mlp:hidden=abc", "--steps", "1"]) == 2  # checked before any worker starts
    assert capsys.readouterr().err.strip() == (
        "polytrain: error: --model mlp:hidden=abc: hidden='abc' is not a value hidden takes (int | Sequence[int]); "
        "write e.g. hidden=64 or hidden=64x32")
    with pytest.raises(ConfigError, match=r"^--model transformer_lm:dropout=x: dropout='x' is not a value dropout "
                                          r"takes \(float\); write e.g. dropout=0.1$"):
        build_model("transformer_lm:dropout=x", input_shape=(16,), num_classes=8)
    with pytest.raises(ConfigError, match=r"^--data synthetic:size=many: size='many' .*write e.g. size=64$"):
        from polytrain.data.registry import check_data
        check_data("synthetic:size=many")
