"""What makes a checkpoint file trustworthy: its manifest, and the checks made before anything is loaded from it.

Next to each ``step-00000100.pt`` the checkpointer writes ``step-00000100.json``: the file's size and SHA-256,
its step, strategy and world size, and the model's tensor names, shapes and dtypes (its *signature*). A file
is usable when it has the manifest's size and checksum (else it was truncated or corrupted after it was
written), loads with ``weights_only=True`` as a polytrain checkpoint of the step its name says, and holds the
model it is meant for (else it is a *foreign* checkpoint: another model's). A file without a manifest (written
by polytrain before manifests existed) is still usable if it loads; it is reported as unverified.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

FORMAT = "polytrain.checkpoint/1"
MANIFEST_FORMAT = "polytrain.manifest/1"
NAME = re.compile(r"^step-(\d{8,})\.pt$")
FOREIGN = "holds another model"

#: a model's signature: for each tensor of its state_dict, [name, shape, dtype] (JSON-friendly)
Signature = list[list[Any]]


def manifest_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_suffix(".json")


def name_step(path: str | Path) -> int | None:
    match = NAME.match(Path(path).name)
    return int(match.group(1)) if match else None


def signature(state_dict: Mapping[str, Any]) -> Signature:
    """The names, shapes and dtypes of a ``state_dict``'s tensors, in its order."""
    return [[name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in state_dict.items()
            if isinstance(t, torch.Tensor)]


def fingerprint(sig: Signature) -> str:
    """A short id of a signature: two checkpoints of the same model share it."""
    return hashlib.sha256(json.dumps(sig).encode()).hexdigest()[:16]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def build_manifest(path: Path, state: Mapping[str, Any], step: int) -> dict[str, Any]:
    """The manifest of the checkpoint file ``path`` (complete, in place) that holds ``state``."""
    sig = state["sharded"]["model"] if "sharded" in state else signature(state.get("model") or {})
    return {
        "format": MANIFEST_FORMAT,
        "checkpoint_format": FORMAT,
        "file": path.name,
        "step": step,
        "size": path.stat().st_size,
        "sha256": sha256_file(path),
        "strategy": state.get("strategy"),
        "world_size": state.get("world_size"),
        "model": {"fingerprint": fingerprint(sig), "tensors": sig},
    }


def dumps_manifest(manifest: dict[str, Any]) -> str:
    """JSON with one line per field and per tensor, so that a person can read (and diff) it."""
    fields = [f" {json.dumps(key)}: {json.dumps(value)}" for key, value in manifest.items() if key != "model"]
    model = manifest["model"]
    tensors = ",\n".join(f"   {json.dumps(t)}" for t in model["tensors"])
    fields.append(f' "model": {{"fingerprint": {json.dumps(model["fingerprint"])}, "tensors": [\n{tensors}\n ]}}')
    return "{\n" + ",\n".join(fields) + "\n}\n"


def model_difference(found: Signature, expected: Signature) -> str | None:
    """Why a checkpoint whose model has signature ``found`` is not one of the model ``expected`` (None: it is)."""
    have = {name: (list(shape), dtype) for name, shape, dtype in found}
    want = {name: (list(shape), dtype) for name, shape, dtype in expected}
    missing = [n for n in want if n not in have]
    extra = [n for n in have if n not in want]
    if missing or extra:
        parts = ([f"lacks {_names(missing)}"] if missing else []) + \
                ([f"has {_names(extra)} that this model does not"] if extra else [])
        return (f"{FOREIGN} ({len(have)} tensors, the model being resumed has {len(want)}; "
                f"it {' and '.join(parts)})")
    for name, (shape, dtype) in want.items():
        if have[name] != (shape, dtype):
            there = f"{_shape(have[name][0])} {have[name][1]}"
            return (f"{FOREIGN} ({name} is {there} there, {_shape(shape)} {dtype} in the model "
                    "being resumed)")
    return None


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _shape(shape: list[int]) -> str:
    return "x".join(map(str, shape)) or "scalar"


@dataclass
class Verdict:
    """What :func:`verify` found about one checkpoint file."""

    path: Path
    problem: str | None = None  # why it cannot be used, after its name ("is truncated: ..."); None: it can
    manifest: dict[str, Any] | None = None  # None: no manifest (an older polytrain's file), or unreadable
    state: dict[str, Any] | None = None  # its contents, when usable
    size: int | None = None
    #: verified ``lazy``: the contents of its parts, mapped (a checkpoint written in parts; None otherwise)
    parts: list[dict[str, Any]] | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None

    @property
    def verified(self) -> bool:
        """Usable, and its size and checksum matched a manifest."""
        return self.ok and self.manifest is not None

    @property
    def foreign(self) -> bool:
        """Sound, but a checkpoint of another model."""
        return (self.problem or "").startswith(FOREIGN)

    @property
    def step(self) -> int | None:
        return name_step(self.path)

    def describe(self) -> str:
        """One line: the file and why it cannot be used."""
        return f"{self.path} {self.problem}"


def verify(path: str | Path, expected: Signature | None = None,
           map_location: str | torch.device = "cpu", lazy: bool = False) -> Verdict:
    """Check ``path`` against its manifest and, given ``expected``, against the model it is meant for;
    load it if that passes. Never raises for a bad file: the verdict says what is wrong with it. ``lazy``:
    every file is checked as well, but loaded mapped (its tensors read only when touched; see
    :func:`polytrain.weights.sources.load_mapped`) and a checkpoint in parts is not put together
    (``verdict.parts``): for a reader that takes only the rows it holds (:mod:`polytrain.train.lazy`)."""
    verdict = Verdict(Path(path))
    try:
        verdict.size = verdict.path.stat().st_size
    except OSError as exc:
        verdict.problem = f"cannot be read ({exc.strerror or exc})"
        return verdict
    verdict.problem = _check_manifest(verdict, expected)
    if verdict.problem:
        return verdict
    try:
        state = _load(verdict.path, map_location, lazy)
    except Exception as exc:  # truncated or damaged without a manifest to tell which: say what torch said
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        verdict.problem = f"cannot be read as a checkpoint ({first})"
        return verdict
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        verdict.problem = f"is not a polytrain checkpoint (format {FORMAT})"
    elif verdict.step is not None and state.get("step") != verdict.step:
        verdict.problem = f"holds step {state.get('step')}, its name says step {verdict.step}"
    elif "sharded" in state and (problem := _assemble(verdict, state, map_location, lazy)):
        verdict.problem = problem
    elif expected is not None and (difference := model_difference(_model_signature(verdict.state or state),
                                                                   expected)):
        verdict.problem = difference
        verdict.state = None
    else:
        verdict.state = verdict.state or state
    return verdict


def _load(path: Path, map_location: str | torch.device, lazy: bool) -> Any:
    if lazy:
        from polytrain.weights.sources import load_mapped

        return load_mapped(path)
    return torch.load(path, map_location=map_location, weights_only=True)


def _model_signature(state: dict[str, Any]) -> Signature:
    """The model's signature in a loaded checkpoint (a checkpoint in parts not put together: its main file's)."""
    if "model" not in state and "sharded" in state:
        return [list(t) for t in state["sharded"]["model"]]
    return signature(state.get("model") or {})


def _assemble(verdict: Verdict, main: dict[str, Any], map_location: str | torch.device,
              lazy: bool = False) -> str | None:
    """A checkpoint written in parts (:mod:`polytrain.train.sharded`): each part checked against the manifest
    (size, SHA-256) and read, and the whole state put together into ``verdict.state`` (``lazy``: the parts
    mapped into ``verdict.parts``, nothing put together); the problem, if any."""
    from polytrain.train.sharded import PART_FORMAT, assemble

    listed = (verdict.manifest or {}).get("parts") or [{"file": name} for name in main["sharded"].get("files", [])]
    if len(listed) != main["sharded"].get("parts"):
        return f"lists {len(listed)} parts, it was written in {main['sharded'].get('parts')}"
    contents = []
    for entry in listed:
        where = verdict.path.with_name(str(entry["file"]))
        try:
            size = where.stat().st_size
        except OSError:
            return f"lacks its part {where.name}"
        if "size" in entry and size != entry["size"]:
            return f"has a part {where.name} of {size:,} bytes, its manifest says {entry['size']:,}"
        if "sha256" in entry and sha256_file(where) != entry["sha256"]:
            return f"has a corrupted part {where.name} (its SHA-256 differs from the manifest's)"
        try:
            part = _load(where, map_location, lazy)
        except Exception as exc:  # noqa: BLE001 - a damaged part without a manifest: say what torch said
            return f"has a part {where.name} that cannot be read ({str(exc).strip().splitlines()[0]})"
        if not isinstance(part, dict) or part.get("format") != PART_FORMAT or part.get("step") != main["step"]:
            return f"has a part {where.name} that is not step {main['step']}'s"
        contents.append(part)
    if lazy:
        verdict.state, verdict.parts = main, contents
        return None
    try:
        verdict.state = assemble(main, contents)
    except ValueError as exc:
        return f"cannot be put together from its parts ({exc})"
    return None


def _check_manifest(verdict: Verdict, expected: Signature | None) -> str | None:
    """The problem the manifest reveals (None: none, or no manifest); sets ``verdict.manifest`` once it
    parses. The cheap checks go first: a truncated or foreign file is told without hashing it."""
    where = manifest_path(verdict.path)
    if not where.is_file():
        return None
    try:
        manifest = json.loads(where.read_text())
    except (OSError, ValueError) as exc:
        return f"has an unreadable manifest {where.name} ({getattr(exc, 'strerror', None) or exc})"
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT \
            or not isinstance(manifest.get("size"), int) or not isinstance(manifest.get("sha256"), str):
        return f"has a manifest {where.name} that is not a polytrain manifest (format {MANIFEST_FORMAT})"
    verdict.manifest = manifest
    if manifest.get("file") != verdict.path.name:
        return (f"does not match its manifest {where.name}, which describes {manifest.get('file')} (a file "
                "renamed or copied from another checkpoint)")
    size = manifest["size"]
    if verdict.size < size:
        return f"is truncated: {verdict.size:,} bytes, its manifest says {size:,}"
    if verdict.size != size:
        return f"has {verdict.size:,} bytes, its manifest says {size:,} (written to after it was saved)"
    model = manifest.get("model") or {}
    if expected is not None and "tensors" in model and (difference := model_difference(model["tensors"],
                                                                                         expected)):
        return difference
    digest = sha256_file(verdict.path)
    if digest != manifest["sha256"]:
        return f"is corrupted: its SHA-256 is {digest[:12]}…, its manifest says {manifest['sha256'][:12]}…"
    return None
