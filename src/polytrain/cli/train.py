"""``polytrain train``: every setting is a flag, and can also come from ``--config FILE.toml``."""

from __future__ import annotations

import argparse
from typing import Any

from polytrain.config import all_options, options_by_section, read_toml, resolve, section_titles, to_toml

DESCRIPTION = """\
Train a model. Settings come from built-in defaults, then --config FILE.toml (keys named like the flags,
e.g. batch_size = 64), then the flags given here. With no flags: the digits CNN on the embedded digits
data, strategy sync on 2 local CPU worker processes."""

EXAMPLES = """\
examples:
  polytrain train
  polytrain train --strategy single --model mlp:hidden=256x128 --steps 500
  polytrain train --workers 4 --data cifar10:~/data/cifar-10-batches-py --lr 0.1 \\
      --lr-schedule exponential:rate=0.1,decay_steps=10000,staircase=true --checkpoint-dir runs/c10
  torchrun --nnodes 2 --nproc-per-node 4 ... -m polytrain train --strategy sync   (see README)

This help shows the settings most runs use; polytrain train --help-all shows every one (each strategy's own,
devices, launcher, restarts, logging, profiling).
"""


#: the settings ``--help`` shows, those most runs set; ``--help-all`` shows every one
COMMON = ("strategy", "workers", "device", "model", "model_args", "data", "data_args", "batch_size", "steps", "epochs",
          "optimizer", "lr", "lr_schedule", "precision", "seed", "eval_every", "checkpoint_dir", "checkpoint_every",
          "resume", "save_model", "metrics_file", "log_dir", "tracker")


class _HelpAll(argparse.Action):
    """``--help-all``: the help with every setting, the ones ``--help`` leaves out given back their lines."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, hidden: Any = (), **kwargs: Any):
        kwargs.pop("default", None)  # (the parser's argument_default)
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kwargs)
        self.hidden = hidden  # (action, its help) of each setting left out of --help

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: Any = None) -> None:
        for action, text in self.hidden:
            action.help = text
        parser.print_help()
        parser.exit()


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("train", help="train a model", description=DESCRIPTION, epilog=EXAMPLES,
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            argument_default=argparse.SUPPRESS)
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved settings as TOML (a valid --config file) and exit")
    add_settings(parser)
    parser.set_defaults(handler=run, answers_stop_signals=True)  # (from train/restart.py's StopSignal on)


def add_settings(parser: argparse.ArgumentParser) -> None:
    """``--config FILE.toml`` and every setting's flag, grouped by section (``train`` and ``plan`` share them);
    ``--help`` shows the :data:`COMMON` ones, ``--help-all`` every one."""
    parser.add_argument("--config", metavar="FILE.toml", help="read settings from a TOML file (flags win)")
    hidden: list[tuple[argparse.Action, str]] = []
    parser.add_argument("--help-all", action=_HelpAll, hidden=hidden,
                        help="show every setting, grouped (this help shows those most runs use)")
    for section, infos in options_by_section():
        group = parser.add_argument_group(section_titles()[section])
        for info in infos:
            action = group.add_argument(info.flag, dest=info.key, **_argument_kwargs(info))
            if info.key not in COMMON:
                hidden.append((action, action.help))
                action.help = argparse.SUPPRESS


def config_from(args: argparse.Namespace) -> Any:
    """The resolved config of the parsed settings: defaults < ``--config`` file < flags."""
    given = vars(args)
    file_values = read_toml(given["config"]) if "config" in given else {}
    flags = {info.key: given[info.key] for info in all_options() if info.key in given}
    return resolve(file_values, flags, file_name=given.get("config", "config file"))


def _argument_kwargs(info: Any) -> dict[str, Any]:
    meta = info.meta
    default = "" if info.default in (None, {}, []) else f" (default: {str(info.default).lower() if isinstance(info.default, bool) else info.default})"
    if info.type == "bool":
        return {"action": argparse.BooleanOptionalAction, "help": info.help + default}
    kwargs: dict[str, Any] = {"help": info.help + default, "metavar": meta["metavar"] or info.key.upper()}
    if meta["choices"]:
        kwargs["metavar"] = "{" + ",".join(meta["choices"]) + "}"
    if meta["repeat"]:
        kwargs["action"] = "append"
    return kwargs


def run(args: argparse.Namespace) -> int:
    from polytrain.train.restart import run as run_training  # restarted after a failure (--max-restarts)
    from polytrain.distributed.hangs import use_run_directory

    config = config_from(args)
    if vars(args).get("print_config"):
        print(to_toml(config), end="")
        return 0
    use_run_directory(config)  # where a hang report is written (distributed/hangs.py)
    summary = run_training(config)
    if summary is not None:  # None: a non-main rank of a torchrun job
        print(format_summary(summary))
    return 0


def format_summary(summary: dict[str, Any]) -> str:
    from polytrain.train.memory import memory_line

    def num(key: str, spec: str = ".4f") -> str:
        value = summary.get(key)
        return "n/a" if value is None else format(value, spec)

    ranks = summary.get("rank_examples_per_sec") or []
    per_rank = f" (per rank {' / '.join(f'{v:.0f}' for v in ranks)})" if len(ranks) > 1 else ""
    where = f"{summary['wall_s']:.1f} s with {summary['strategy']} on {summary['workers']} worker(s)"
    evaluation = (f"eval loss {num('eval_loss')}  eval accuracy {num('eval_accuracy')}"
                  + (f"  eval perplexity {num('eval_perplexity', '.2f')}" if "eval_perplexity" in summary else ""))
    if _nothing_trained(summary):
        return (f"done: nothing trained: the run was already at step {summary['steps']} when it resumed "
                f"(raise --steps or --epochs to train further); {where}"
                + (f"\n  {evaluation}" if summary.get("eval_loss") is not None else ""))
    return (f"done: {summary['steps']} steps in {where}\n"
            f"  train loss {num('train_loss')}  {evaluation}\n"
            f"  {num('examples_per_sec', '.1f')} examples/sec{per_rank}{_warmup_text(summary)}" + memory_line(summary)
            + (f"\n  packed documents: {summary['packed_efficiency']:.1%} of the token positions are real tokens"
               if summary.get("packed_efficiency") is not None else "")
            + _restarts_line(summary) + _lost_line(summary) + _membership_line(summary))


def _warmup_text(summary: dict[str, Any]) -> str:
    """After the steady rate: the warm-up steps apart, and the start-up (the command to the first step)."""
    parts = []
    if summary.get("warmup_steps") and summary.get("warmup_examples_per_sec") and summary.get("examples_per_sec"):
        parts.append(f"after {summary['warmup_steps']} warm-up steps at {summary['warmup_examples_per_sec']:.1f}")
    if summary.get("startup_s") is not None:
        parts.append(f"first step {summary['startup_s']:.1f} s after the start")
    return f" ({'; '.join(parts)})" if parts else ""


def _nothing_trained(summary: dict[str, Any]) -> bool:
    """No step in this run (a resume at or past its last step): no train loss, no examples. After a
    restart the attempts before the last one trained, so that summary is the usual one."""
    return summary.get("train_loss") is None and not summary.get("examples_per_sec") \
        and not summary.get("restarts")


def _lost_line(summary: dict[str, Any]) -> str:
    lost = summary.get("workers_lost")
    if not lost:
        return ""
    return (f"\n  workers lost: rank(s) {', '.join(map(str, lost))}; the run went on without them "
            "(--tolerate-worker-loss)")


def _membership_line(summary: dict[str, Any]) -> str:
    """--on-failure continue: each change of the workers that train, where and how long it took."""
    changes = summary.get("membership_changes")
    if not changes:
        return ""
    listed = "; ".join(
        f"step {c['step']}: " + ", ".join([f"slot {s} lost" for s in c["lost"]] + [f"slot {s} joined" for s in c["joined"]])
        + f" -> {c['workers']} workers ({c['seconds']:.2f} s)" for c in changes)
    return f"\n  membership: {listed} (--on-failure continue: no restart, nothing read from disk)"


def _restarts_line(summary: dict[str, Any]) -> str:
    causes = summary.get("restart_causes") or []
    if not summary.get("restarts"):
        return ""
    listed = "; ".join(f"{c['cause']} (after {c['after_s']:.0f} s{_restart_cost(c)})" for c in causes)
    total = f"; {summary['total_wall_s']:.1f} s in all" if "total_wall_s" in summary else ""
    return f"\n  restarts: {summary['restarts']}" + (f" ({listed})" if listed else "") + total


def _restart_cost(cause: dict[str, Any]) -> str:
    """What one restart cost (train/recovery.py): the failure to the next completed step, and to the step the
    job had reached."""
    if cause.get("first_step_s") is None:
        return ""
    back = "" if cause.get("back_s") is None else \
        f", back at step {cause['reached_step']} after {cause['back_s']:.1f} s, {cause['redone_steps']} steps redone"
    return f"; next step after {cause['first_step_s']:.1f} s{back}"
