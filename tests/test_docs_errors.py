"""docs/errors.md names, for each message, the tests that check it: every one it names must exist (a renamed or
deleted test would otherwise leave a row that claims a check nobody makes)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_test_the_error_catalogue_names_exists():
    text = (ROOT / "docs" / "errors.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`([\w/]+\.py)::(\w+)`", text))
    assert len(named) > 100, "the catalogue's test column was not found"
    missing = sorted(f"{path}::{name}" for path, name in named
                     if not (ROOT / "tests" / path).is_file()
                     or not re.search(rf"^def {name}\(", (ROOT / "tests" / path).read_text(encoding="utf-8"), re.M))
    assert not missing, f"docs/errors.md names tests that do not exist: {missing}"
