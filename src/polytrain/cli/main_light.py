"""The command line's parser class, and a light command (``polytrain devices``) run without importing every
component (:mod:`polytrain.cli.entry`): its own parser, as ``polytrain COMMAND`` parses it, and the same
handling of errors as :mod:`polytrain.cli.main`."""

from __future__ import annotations

import argparse
import sys
from types import ModuleType
from typing import Sequence


class Parser(argparse.ArgumentParser):
    """Reports usage errors as one line that names the fix, instead of a usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def run_light(module: ModuleType, argv: Sequence[str]) -> int:
    from polytrain.errors import PolytrainError

    from polytrain.cli.starting import starting_done

    parser = Parser(prog="polytrain")
    module.add_parser(parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser))
    try:
        args = parser.parse_args(list(argv))
    finally:
        starting_done()  # the stop signals' own handlers again (cli/starting.py)
    try:
        return args.handler(args)
    except PolytrainError as exc:
        print(f"polytrain: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("polytrain: interrupted", file=sys.stderr)
        return 130
