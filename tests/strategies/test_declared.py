"""A command imports only what it runs: parsing, ``--help-all``, the refusals and ``polytrain plan`` read each
strategy as declared (its light module: name, section, traits, layout), never the strategy's own module, whose
imports (DTensor, pipelining, the tracer) cost seconds of CPU in every command that spawned ``python -m
polytrain``; and the strategy class of each name is its declared class's subclass, with the same traits."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from polytrain.strategies import available_strategies, get_strategy
from polytrain.strategies.registry import BUILTIN_STRATEGIES, get_declared

SRC = Path(__file__).resolve().parents[2] / "src"

#: torch's modules that only a strategy's run needs: DTensor, pipelining, FSDP2
HEAVY = ("torch.distributed.tensor", "torch.distributed.pipelining", "torch.distributed.fsdp", "torch._dynamo")

PROGRAM = textwrap.dedent("""
    import contextlib, io, json, sys
    from polytrain.cli.main import main

    def run(*argvs):
        out, err, codes = io.StringIO(), io.StringIO(), []
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            for argv in argvs:
                try:
                    codes.append(main(argv))
                except SystemExit as exc:
                    codes.append(exc.code)
        return {"codes": codes, "err": err.getvalue(), "out": out.getvalue(), "modules": sorted(sys.modules)}

    parsed = run(["train", "--help-all"], ["train", "--staleness", "x"], ["train", "--strategy", "sync", "--servers", "2"])
    planned = run(["plan", "--strategy", "async", "--workers", "2", "--servers", "2"],
                  ["plan", "--strategy", "diloco", "--outer-lr", "0.5"], ["plan", "--strategy", "fsdp", "--json"])
    print(json.dumps({"parsed": parsed, "planned": planned}))
""")


def test_a_command_that_runs_no_strategy_imports_none():
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(SRC)})
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    parsed, planned = found["parsed"], found["planned"]
    assert parsed["codes"] == [0, 2, 2]
    assert "--staleness K" in parsed["out"] and "--microbatches M" in parsed["out"]  # every strategy's flags
    assert "--staleness: expected an integer, got 'x'" in parsed["err"]
    assert "--servers 2 is a setting of --strategy async, which --strategy sync does not read" in parsed["err"]
    assert planned["codes"] == [0, 0, 0], planned["err"]
    assert "parameter server rank 3" in planned["out"] and '"strategy": "fsdp"' in planned["out"]
    strategies = set(BUILTIN_STRATEGIES.values())
    for what in (parsed, planned):
        assert sorted(strategies & set(what["modules"])) == []
    assert not [m for m in parsed["modules"] if m.startswith(HEAVY)]  # (plan builds an optimizer: torch._dynamo)


def test_each_strategy_is_its_declared_class():
    for name in available_strategies():
        declared, cls = get_declared(name), get_strategy(name)
        assert issubclass(cls, declared) and cls is not declared and cls.__module__ == BUILTIN_STRATEGIES[name]
        assert (cls.name, cls.traits, cls.config_section) == (declared.name, declared.traits, declared.config_section)
        assert cls.layout.__func__ is declared.layout.__func__  # the layout, written once
