"""``polytrain``: the command-line entry point. Each subcommand lives in its own module."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

import polytrain.components  # noqa: F401  (every setting, strategy, model and data set registered)
from polytrain import __version__
from polytrain.cli import advise as advise_cmd
from polytrain.cli import bench as bench_cmd
from polytrain.cli import compare as compare_cmd
from polytrain.cli import checkpoint as checkpoint_cmd
from polytrain.cli import devices as devices_cmd
from polytrain.cli import generate as generate_cmd
from polytrain.cli import plan as plan_cmd
from polytrain.cli import tokenize as tokenize_cmd
from polytrain.cli import train as train_cmd
from polytrain.cli.main_light import Parser
from polytrain.cli.starting import starting_done
from polytrain.distributed.prestart import prestarted_pids
from polytrain.distributed.mp_helpers import helper_processes
from polytrain.distributed.processes import stop_helper_processes
from polytrain.train.startup import run_environment
from polytrain.distributed.stop import StopNow, exit_code
from polytrain.errors import PolytrainError, RunStopped
from polytrain.strategies import available_strategies


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="polytrain",
        description="Train one PyTorch model on many devices and machines. The parallel strategy is a "
                    f"setting: {', '.join(available_strategies())}.",
        epilog="Run 'polytrain COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"polytrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    train_cmd.add_parser(sub)
    devices_cmd.add_parser(sub)
    bench_cmd.add_parser(sub)
    compare_cmd.add_parser(sub)
    advise_cmd.add_parser(sub)
    generate_cmd.add_parser(sub)
    tokenize_cmd.add_parser(sub)
    plan_cmd.add_parser(sub)
    checkpoint_cmd.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # (called inside a longer program: its own helpers are left running; not the forkserver this command started)
    found = helper_processes() - prestarted_pids()
    parser = build_parser()
    args = None
    try:
        args = parser.parse_args(argv)
    except BaseException:  # (a usage error: argparse's SystemExit)
        stop_helper_processes(keep=found)
        raise
    finally:  # a command that answers stop signals itself takes them over from the entry point's handlers
        if not getattr(args, "answers_stop_signals", False):
            starting_done()
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        with run_environment():  # (inside a longer program, the run's environment is not left behind)
            return args.handler(args)
    except RunStopped as exc:  # a signal stopped the run in order: not an error
        print(f"polytrain: {exc}", file=sys.stderr)
        return exc.exit_code
    except PolytrainError as exc:
        print(f"polytrain: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except StopNow as exc:
        print(f"polytrain: {exc}; the checkpoints written before are intact", file=sys.stderr)
        return exit_code(exc.signum)
    except KeyboardInterrupt:
        print("polytrain: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of our output went away (`polytrain checkpoint inspect DIR | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 141  # 128 + SIGPIPE, as a shell reports a command whose output pipe closed
    finally:
        starting_done()
        stop_helper_processes(keep=found)


if __name__ == "__main__":
    sys.exit(main())
