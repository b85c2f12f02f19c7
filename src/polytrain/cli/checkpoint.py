"""``polytrain checkpoint inspect|export``: what a run's checkpoints hold, and their model as a plain state_dict.

Both check every file the way ``--resume`` does (size and SHA-256 against its manifest, a polytrain checkpoint
of the step its name says) and use the newest good one unless ``--step`` names another.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

DESCRIPTION = """\
inspect: list every checkpoint in DIR with its size and checksum status and the one 'latest' points to, then
show what the newest good one (or --step N) holds: step, strategy, world size, data position, the model's
tensors with shapes and sizes, the optimizer state and the total size.
export: write the model of the newest good checkpoint (or --step N) as a plain state_dict, as
'polytrain train --save-model FILE.pt' writes it (torch.load(FILE, weights_only=True) reads it); for a FILE
ending in .safetensors (or --format safetensors), as one safetensors file; for a directory (a path without a
suffix, ending in /, or an empty directory; or --format hf), as a Hugging Face directory: config.json (of a
transformers model), model-0000K-of-0000N.safetensors shards of at most --shard-size and their
model.safetensors.index.json, which transformers' from_pretrained and 'polytrain train --init-from' read.
safetensors and hf are written one tensor at a time, read from the checkpoint (one file, or the parts a
sharded run wrote) as they are written: the whole model is never in memory. pt puts it together first."""

EXAMPLES = """\
examples:
  polytrain checkpoint inspect runs/c10
  polytrain checkpoint inspect runs/c10 --step 1000
  polytrain checkpoint export runs/c10 model.pt
  polytrain checkpoint export runs/c10 model.safetensors
  polytrain checkpoint export runs/lm exported/          # a Hugging Face directory
"""


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("checkpoint", help="inspect a run's checkpoints or export one's model",
                            description=DESCRIPTION, epilog=EXAMPLES,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True,
                                    parser_class=type(parser))
    inspect = actions.add_parser("inspect", help="what the checkpoints in DIR hold, and whether they are intact")
    inspect.add_argument("dir", metavar="DIR", help="a --checkpoint-dir")
    inspect.add_argument("--step", type=int, metavar="N", help="show this step's checkpoint (default: newest good)")
    inspect.set_defaults(handler=run_inspect)
    export = actions.add_parser("export", help="write a checkpoint's model as a plain state_dict")
    export.add_argument("dir", metavar="DIR", help="a --checkpoint-dir")
    export.add_argument("out", metavar="OUT", help="where to write the model: model.pt, model.safetensors, or a "
                                                   "directory (Hugging Face's layout)")
    export.add_argument("--step", type=int, metavar="N", help="export this step (default: the newest good one)")
    export.add_argument("--format", choices=("pt", "safetensors", "hf"), default=None,
                        help="pt: torch.save's (torch.load(FILE, weights_only=True) reads it); safetensors: one "
                             "file; hf: a Hugging Face directory (default: hf for a directory, safetensors for a "
                             "FILE ending in .safetensors, else pt)")
    export.add_argument("--shard-size", default="5GB", metavar="SIZE",
                        help="hf: the most bytes of tensors per safetensors shard (default 5GB, as save_pretrained)")
    export.set_defaults(handler=run_export)


def run_inspect(args: argparse.Namespace) -> int:
    from polytrain.errors import ConfigError

    in_use = _in_use_line(args.dir)
    if in_use:
        print(in_use)
    checkpointer, verdicts = _verdicts(args.dir)
    latest = checkpointer.latest()
    print(f"{args.dir}: {len(verdicts)} checkpoint(s); latest -> {latest.name if latest else '(none)'}")
    for verdict in sorted(verdicts, key=lambda v: v.step):
        print("  " + _status_line(verdict) + ("  <- latest" if verdict.path == latest else ""))
    chosen = _pick(args, verdicts)
    if not chosen.ok:
        raise ConfigError(f"checkpoint {chosen.describe()}")
    print(f"{chosen.path.name}" + ("" if args.step is not None else " (the newest good one)") + ":")
    for line in _contents(chosen.state, chosen.size):
        print("  " + line)
    return 0


def run_export(args: argparse.Namespace) -> int:
    from polytrain.errors import ConfigError
    from polytrain.train.files import atomic_save

    form = _export_format(args)
    _check_export_path(args.out, form)
    _, verdicts = _verdicts(args.dir, lazy=form != "pt")
    chosen = _pick(args, verdicts)
    if not chosen.ok:
        raise ConfigError(f"checkpoint {chosen.describe()}")
    for verdict in verdicts:  # the newer ones passed over, as --resume would report them
        if verdict is chosen:
            break
        if args.step is None:
            print(f"polytrain: warning: checkpoint {verdict.describe()}; skipped for an earlier one",
                  file=sys.stderr)
    if form != "pt":
        return _export_streamed(args, chosen, form)
    model = chosen.state.get("model")
    if not isinstance(model, dict) or not model:
        raise ConfigError(f"checkpoint {chosen.path} holds no model state_dict")
    tensors = {k: v.detach().cpu() for k, v in model.items()}
    try:
        atomic_save(tensors, args.out)
    except OSError as exc:
        raise ConfigError(f"{args.out}: cannot write the model there ({exc.strerror or exc})") from None
    print(f"wrote {args.out}: the model of step {chosen.state['step']} ({len(model)} tensors, {form}) from "
          f"{chosen.path}")
    return 0


def _export_format(args: argparse.Namespace) -> str:
    """--format, else: safetensors for a FILE ending in .safetensors, hf for a directory (a path without a
    suffix or ending in /, or an empty directory or one a Hugging Face model was written into), else pt."""
    import os

    from polytrain.weights.export import is_directory_target

    if args.format:
        return args.format
    if args.out.endswith(".safetensors"):
        return "safetensors"
    if os.path.isdir(args.out):
        listed = os.listdir(args.out)
        return "hf" if not listed or "config.json" in listed or "model.safetensors.index.json" in listed else "pt"
    return "hf" if is_directory_target(args.out) else "pt"


def _export_streamed(args: argparse.Namespace, chosen: Any, form: str) -> int:
    """safetensors and hf: the chosen checkpoint (verified, mapped) written one tensor at a time."""
    from pathlib import Path

    from polytrain.devices.memory_limit import parse_size
    from polytrain.errors import ConfigError
    from polytrain.train.lazy import lazy_checkpoint
    from polytrain.weights.export import export_source

    try:
        shard = parse_size(args.shard_size)
    except ValueError as exc:
        raise ConfigError(f"--shard-size: {exc}") from None
    checkpoint = lazy_checkpoint(chosen)
    names = list(checkpoint.model.tensors())
    if not names:
        raise ConfigError(f"checkpoint {chosen.path} holds no model state_dict")
    config = checkpoint.run.get("hf_config") if form == "hf" else None
    metadata = {"polytrain_step": str(checkpoint.run.get("step")),
                "polytrain_model": str((checkpoint.run.get("config") or {}).get("model", ""))}
    try:
        records = export_source(Path(args.out), checkpoint.model, names, config, shard, metadata,
                                directory=form == "hf")
    except OSError as exc:
        raise ConfigError(f"{args.out}: cannot write the model there ({exc.strerror or exc})") from None
    what = f"{form}, {len(records)} file(s)" if form == "hf" else form
    print(f"wrote {args.out}: the model of step {checkpoint.run['step']} ({len(names)} tensors, {what}) from "
          f"{chosen.path}")
    if form == "hf" and config is None:
        print(f"polytrain: warning: {args.out}: no config.json: the checkpoint's model is not a transformers model "
              "(from_pretrained needs one); 'polytrain train --init-from' reads the directory", file=sys.stderr)
    return 0


def _check_export_path(out: str, form: str = "pt") -> None:
    """One ConfigError line if ``out`` is a directory where a file is expected, or its directory is missing
    (export creates none but a Hugging Face directory itself)."""
    import os

    from polytrain.errors import ConfigError

    parent = os.path.dirname(out.rstrip(os.sep)) or "."
    if form == "hf":
        if os.path.exists(out) and not os.path.isdir(out):
            raise ConfigError(f"{out}: is a file; give a directory to write the Hugging Face model into")
    elif os.path.isdir(out):
        raise ConfigError(f"{out}: is a directory; give the path of the file to write (e.g. "
                          f"{os.path.join(out, 'model.pt')}), or --format hf for a Hugging Face directory there")
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise ConfigError(f"{out}: {parent} is a file, not a directory; give a path in an existing directory")
    if not os.path.isdir(parent):
        raise ConfigError(f"{out}: its directory {parent} does not exist; create it first, or give a path in an "
                          "existing directory")


def _in_use_line(directory: str) -> str | None:
    """Who is writing ``directory`` now (None: no live run), asked without taking its lock."""
    from polytrain.train.dirlock import describe, live_owner

    owner = live_owner(directory)
    if owner is None:
        return None
    who = describe(owner) if owner else "starting"
    return f"{directory}: in use by a live run ({who}); it may write a newer checkpoint at any time"


def _verdicts(directory: str, lazy: bool = False) -> tuple[Any, list[Any]]:
    """The directory's checkpoints, each verified, in the order --resume tries them (``lazy``: mapped, parts
    not put together)."""
    from polytrain.errors import ConfigError
    from polytrain.train.checkpoint import Checkpointer
    from polytrain.train.integrity import verify

    checkpointer = Checkpointer(directory)
    candidates = checkpointer.candidates()
    if not candidates:
        raise ConfigError(f"{directory}: no checkpoint there (no step-NNNNNNNN.pt file)")
    return checkpointer, [verify(path, lazy=lazy) for path in candidates]


def _pick(args: argparse.Namespace, verdicts: list[Any]) -> Any:
    """The verdict of --step N, or the first good one in --resume's order."""
    from polytrain.errors import ConfigError
    from polytrain.train.checkpoint import Choice

    if args.step is not None:
        found = [v for v in verdicts if v.step == args.step]
        if not found:
            steps = ", ".join(str(v.step) for v in sorted(verdicts, key=lambda v: v.step))
            raise ConfigError(f"{args.dir}: no checkpoint of step {args.step} (steps: {steps})")
        return found[0]
    good = next((v for v in verdicts if v.ok), None)
    if good is None:
        from pathlib import Path
        raise ConfigError(Choice(None, verdicts).no_good_message(Path(args.dir)))
    return good


def _status_line(verdict: Any) -> str:
    size = f"{verdict.size:>14,} B" if verdict.size is not None else f"{'?':>16}"
    manifest = verdict.manifest or {}
    model = (manifest.get("model") or {}).get("fingerprint")
    parts = manifest.get("parts") or []
    if parts:  # written in parts, one per rank: the bytes of them all
        size = f"{verdict.size + sum(int(p.get('size', 0)) for p in parts):>14,} B"
    if verdict.verified:
        status = "ok, size and SHA-256 match its manifest" + (f" (and its {len(parts)} parts')" if parts else "")
    elif verdict.ok:
        status = "ok, but no manifest: loads, cannot be verified"
    else:
        status = f"BAD: {verdict.problem}"
    return f"{verdict.path.name}  {size}  {status}" + (f"  (model {model})" if model and verdict.ok else "")


def _contents(state: dict[str, Any], file_size: int | None) -> list[str]:
    """What a loaded checkpoint holds, one line each."""
    from polytrain.train.integrity import fingerprint, signature

    config = state.get("config") or {}
    position = state.get("data_position") or {}
    model = state.get("model") or {}
    model_args = ",".join(f"{k}={v}" for k, v in (config.get("model_args") or {}).items())
    lines = [
        f"step {state.get('step')}, strategy {state.get('strategy', '?')}, world size {state.get('world_size', '?')}",
        f"data position: epoch {position.get('epoch', '?')}, batch {position.get('batch', '?')} of it "
        f"(global batch {position.get('global_batch', '?')}{_examples(position)}); data {config.get('data', '?')}",
        f"schedule {state.get('schedule', '?')}; optimizer {config.get('optimizer', '?')}",
        f"model {config.get('model', '?')}{':' + model_args if model_args else ''} "
        f"(fingerprint {fingerprint(signature(model))}): {len(model)} tensors, "
        f"{sum(t.numel() for t in model.values()):,} values, {_bytes(_tensor_bytes(model))}",
    ]
    width = max((len(name) for name in model), default=0)
    for name, t in model.items():
        shape = "x".join(map(str, t.shape)) or "scalar"
        lines.append(f"  {name:<{width}}  {shape:<14} {str(t.dtype).removeprefix('torch.'):<9} "
                     f"{_bytes(t.numel() * t.element_size())}")
    for key in sorted(k for k in state if k not in ("model", "config", "format")):
        count = _count_tensors(state[key])
        if count:
            lines.append(f"{key}: {count} tensor(s), {_bytes(_tensor_bytes(state[key]))}")
    parts = state.get("written_in_parts")
    where = f"written by {parts} ranks in parts, each its shard" if parts else f"file {_bytes(file_size or 0)}"
    lines.append(f"tensors in all: {_bytes(_tensor_bytes(state))}; {where}")
    return lines


def _examples(position: dict[str, Any]) -> str:
    """Where in the epoch's permutation the run was (checkpoints that save it: the resumable position)."""
    if "examples" not in position:
        return ""
    return f"; example {position['examples']} of the epoch's {position.get('epoch_examples', '?')}"


def _tensors(value: Any):
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _count_tensors(value: Any) -> int:
    return sum(1 for _ in _tensors(value))


def _tensor_bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
