"""polytrain.environ: variables set for a block are put back as they were, however the block ends."""

import os

import pytest

from polytrain.environ import environment


def test_set_names_and_named_ones_are_put_back_as_they_were_even_after_an_error(monkeypatch):
    monkeypatch.setenv("POLYTRAIN_T_OLD", "before")
    monkeypatch.delenv("POLYTRAIN_T_NEW", raising=False)
    monkeypatch.delenv("POLYTRAIN_T_INSIDE", raising=False)
    with pytest.raises(RuntimeError, match="boom"):
        with environment({"POLYTRAIN_T_OLD": "during", "POLYTRAIN_T_NEW": "1"}, restore=["POLYTRAIN_T_INSIDE"]):
            assert os.environ["POLYTRAIN_T_OLD"] == "during" and os.environ["POLYTRAIN_T_NEW"] == "1"
            os.environ["POLYTRAIN_T_INSIDE"] = "set by the block"
            raise RuntimeError("boom")
    assert os.environ["POLYTRAIN_T_OLD"] == "before"
    assert "POLYTRAIN_T_NEW" not in os.environ and "POLYTRAIN_T_INSIDE" not in os.environ
