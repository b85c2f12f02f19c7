"""Placement plans as data: parsing from flags, TOML and dicts, and matching against module names."""

from __future__ import annotations

import pytest
import torch

from polytrain.devices.plan import PlacementPlan
from polytrain.errors import DeviceError

NAMES = ["", "features", "features.0", "features.1", "classifier", "classifier.0", "classifier.0.norm"]


def test_from_flag_keeps_order_and_prints_back():
    plan = PlacementPlan.from_flag("features=cuda:0, classifier=/gpu:1")
    assert plan.entries == (("features", "cuda:0"), ("classifier", "/gpu:1"))
    assert str(plan) == "features=cuda:0,classifier=/gpu:1"
    assert plan.devices() == ["cuda:0", "/gpu:1"]


@pytest.mark.parametrize("flag,message", [
    ("features", "'features' is not MODULE=DEVICE; write e.g. features=cuda:0,classifier=cuda:1"),
    ("features=cuda:0,1", "'1' is not MODULE=DEVICE (a module goes on one device)"),
    ("=cuda:0", "has no module name; use '*' for the whole model"),
    ("features=tpu:0", "bad device 'tpu:0'"),
    ("features=", "bad device ''"),
    ("features=cpu:4", "'features=cpu:4' is a CPU worker count"),
    ("features=cuda:0;classifier=cuda:1", "bad device"),
    ("my layer=cpu", "not a module name or pattern"),
])
def test_bad_flags(flag, message):
    with pytest.raises(DeviceError) as info:
        PlacementPlan.from_flag(flag)
    assert message in str(info.value)
    assert str(info.value).startswith("--place: ") or "bad device" in str(info.value)


def test_a_list_of_devices_for_one_module_is_refused_from_python():
    with pytest.raises(DeviceError, match="names several devices; a module goes on one device"):
        PlacementPlan.from_mapping({"features": "cuda:0,1"})


def test_a_module_name_that_is_not_text_is_refused_from_python():
    with pytest.raises(DeviceError, match="^placement: module name 0 must be text$"):
        PlacementPlan.from_mapping({0: "cpu"})


def test_from_toml_top_level_nested_and_quoted(tmp_path):
    path = tmp_path / "plan.toml"
    path.write_text('"*" = "cpu"\nclassifier = "gpu:1"\n"layers.*" = "cuda:2"\n[features]\n0 = "/gpu:0"\n')
    plan = PlacementPlan.from_toml(path)
    assert plan.entries == (("*", "cpu"), ("classifier", "gpu:1"), ("layers.*", "cuda:2"), ("features.0", "/gpu:0"))
    assert plan.source == str(path)


def test_from_toml_under_a_placement_table(tmp_path):
    path = tmp_path / "plan.toml"
    path.write_text('[placement]\nfeatures = "cuda:0"\nclassifier = "cuda:1"\n')
    assert PlacementPlan.from_toml(path).entries == (("features", "cuda:0"), ("classifier", "cuda:1"))


@pytest.mark.parametrize("content,message", [
    ("features = 1\n", "'features' must be a device name in quotes"),
    ("features = \n", "is not valid TOML"),
    ('features = "tpu"\n', "bad device 'tpu'"),
])
def test_bad_toml(tmp_path, content, message):
    path = tmp_path / "plan.toml"
    path.write_text(content)
    with pytest.raises(DeviceError, match=message):
        PlacementPlan.from_toml(path)


def test_missing_toml(tmp_path):
    with pytest.raises(DeviceError, match="placement file .*nope.toml' does not exist"):
        PlacementPlan.from_toml(tmp_path / "nope.toml")


def test_from_options_puts_flag_entries_last(tmp_path):
    path = tmp_path / "plan.toml"
    path.write_text('features = "cuda:0"\nclassifier = "cuda:0"\n')
    plan = PlacementPlan.from_options(place="classifier=cuda:1", placement=str(path))
    assert plan.entries[-1] == ("classifier", "cuda:1")
    assert plan.assign(NAMES)["classifier"] == "cuda:1"
    assert PlacementPlan.from_options(None, None) is None


def test_coerce():
    plan = PlacementPlan.coerce({"features": "cpu"})
    assert PlacementPlan.coerce(plan) is plan
    assert PlacementPlan.coerce("features=cpu").entries == plan.entries
    with pytest.raises(TypeError):
        PlacementPlan.coerce(["features=cpu"])  # type: ignore[arg-type]


def test_a_module_takes_its_subtree():
    assigned = PlacementPlan.from_flag("features=cuda:0,classifier=cuda:1").assign(NAMES)
    assert assigned == {"features": "cuda:0", "features.0": "cuda:0", "features.1": "cuda:0",
                        "classifier": "cuda:1", "classifier.0": "cuda:1", "classifier.0.norm": "cuda:1"}


def test_the_last_matching_entry_wins():
    assigned = PlacementPlan.from_flag("*=cuda:0,classifier=cuda:1").assign(NAMES)
    assert assigned[""] == "cuda:0" and assigned["features.1"] == "cuda:0"
    # classifier.0 is matched by '*' itself and by 'classifier' through its parent: the later entry wins
    assert assigned["classifier.0"] == "cuda:1" and assigned["classifier.0.norm"] == "cuda:1"
    reversed_order = PlacementPlan.from_flag("classifier=cuda:1,*=cuda:0").assign(NAMES)
    assert set(reversed_order.values()) == {"cuda:0"}


def test_a_deeper_exception_after_a_broad_entry():
    assigned = PlacementPlan.from_flag("classifier=cuda:1,classifier.0.norm=cpu").assign(NAMES)
    assert assigned["classifier.0"] == "cuda:1" and assigned["classifier.0.norm"] == "cpu"


def test_globs_and_unmatched_modules_stay_out():
    assigned = PlacementPlan.from_flag("features.?=cuda:1").assign(NAMES)
    assert assigned == {"features.0": "cuda:1", "features.1": "cuda:1"}


def test_a_pattern_matching_nothing_lists_the_module_names():
    with pytest.raises(DeviceError) as info:
        PlacementPlan.from_flag("features=cuda:0,clasifier=cuda:1").assign(NAMES)
    message = str(info.value)
    assert "--place: 'clasifier' matches no module of the model" in message
    assert "module names: features, classifier, features.0" in message


def test_torch_devices_are_accepted_from_python():
    plan = PlacementPlan.from_mapping({"classifier": torch.device("meta")})
    assert plan.assign(NAMES)["classifier.0"] == torch.device("meta")
    assert str(plan) == "classifier=meta"
