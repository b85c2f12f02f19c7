"""``polytrain generate``: sample text from a trained ``rnn_lm``/``transformer_lm`` (or any language model).

The weights come from ``--weights FILE`` (what ``train --save-model FILE`` wrote) or from the latest
checkpoint in ``--checkpoint-dir DIR``, whose saved config also names the model, its arguments and the
tokenizer. The vocabulary and, for ``transformer_lm``, the number of positions are read from the weights
themselves. Tokens are bytes unless ``--tokenizer`` (or the run's) names a tokenizer, which then encodes the
prompt and decodes what is sampled.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

DESCRIPTION = """\
Print text sampled from a trained language model: the prompt, then --tokens more tokens, bytes (decoded as
UTF-8; a cut character shows as U+FFFD) or those of --tokenizer. Give the weights with --weights FILE (from
'polytrain train --save-model FILE', plus --model, the --model-arg values and the --tokenizer it was trained
with) or with --checkpoint-dir DIR (its latest checkpoint; model, arguments and tokenizer come from the run's
saved config)."""

EXAMPLES = """\
examples:
  polytrain train --strategy single --data text --save-model lm.pt --steps 2000
  polytrain generate --weights lm.pt --model transformer_lm --prompt "LOVE, n. " --tokens 300
  polytrain generate --checkpoint-dir runs/lm --temperature 0.5 --seed 3
  polytrain generate --weights lm.pt --model transformer_lm --tokenizer text --prompt "WAR, n. "
"""


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("generate", help="sample text from a trained language model", description=DESCRIPTION,
                            epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--weights", metavar="FILE", help="a state_dict written by 'polytrain train --save-model'")
    source.add_argument("--checkpoint-dir", metavar="DIR", help="take the latest checkpoint of this run")
    parser.add_argument("--model", help="rnn_lm | transformer_lm | package.module:factory, with arguments as in "
                                        "train (default with --checkpoint-dir: the run's)")
    parser.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="model argument, as given to train (repeatable)")
    parser.add_argument("--prompt", default="", help="text to continue (default: none, start a new line)")
    parser.add_argument("--tokenizer", metavar="DIR|FILE", help="the tokenizer the model was trained with, as "
                        "train's --tokenizer (default: the run's with --checkpoint-dir, a --model hf:DIR's own; "
                        "else bytes)")
    parser.add_argument("--tokens", type=int, default=200, metavar="N",
                        help="tokens (bytes without a tokenizer) to generate (default: 200)")
    parser.add_argument("--temperature", type=float, default=0.8, metavar="T",
                        help="softmax temperature, a finite number >= 0; 0 always takes the likeliest token "
                             "(default: 0.8)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from polytrain.data.tokenizer import load_tokenizer, model_tokenizer
    from polytrain.errors import ConfigError
    from polytrain.models.sampling import sample_bytes, sample_text

    if args.tokens < 0:
        raise ConfigError(f"--tokens must be >= 0, got {args.tokens}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ConfigError(f"--temperature must be a finite number >= 0 (0 always takes the likeliest token), "
                          f"got {args.temperature}")
    state, saved = _read_weights(args)
    name = args.tokenizer or saved.get("tokenizer") or model_tokenizer(args.model or saved.get("model"))
    tokenizer = load_tokenizer(name) if name else None
    model = load_model(args, state, saved, tokenizer.vocab_size if tokenizer is not None else None)
    if tokenizer is not None:
        _check_vocabulary(model, tokenizer, name)
        text = sample_text(model, tokenizer, args.prompt, args.tokens, args.temperature, args.seed)
    else:
        prompt = args.prompt.encode("utf-8", errors="surrogateescape")  # bytes the shell passed that are not UTF-8
        text = (prompt + sample_bytes(model, prompt, args.tokens, args.temperature, args.seed)).decode(
            "utf-8", errors="replace")
    sys.stdout.write(text + ("" if text.endswith("\n") else "\n"))
    return 0


def load_model(args: argparse.Namespace, state: dict[str, Any] | None = None, saved: dict[str, Any] | None = None,
               vocab: int | None = None):
    """The model the arguments name, with its trained weights loaded (``state``/``saved``: already read);
    ``vocab``: the tokenizer's, for a model whose weights do not tell it."""
    from polytrain.errors import ConfigError
    from polytrain.specs import parse_assignments

    if state is None:
        state, saved = _read_weights(args)
    saved = saved or {}
    spec = args.model or saved.get("model")
    if not spec:
        raise ConfigError("--model is needed with --weights: name the model the weights were trained as")
    # the run's own arguments apply to the run's own model only
    trained_with = dict(saved.get("model_args") or {}) if spec == saved.get("model") else {}
    try:
        model_args = {**trained_with, **parse_assignments(args.model_arg)}
    except ValueError as exc:
        raise ConfigError(f"--model-arg: {exc}") from None
    model = _build_language_model(spec, model_args, state, saved, vocab)
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise ConfigError(f"the weights do not fit --model {spec} with these arguments ({_load_error(exc)}); "
                          "give the --model and --model-arg values the model was trained with") from None
    _check_next_token_logits(model, spec, saved)
    return model


def _build_language_model(spec: str, model_args: dict[str, Any], state: dict[str, Any], saved: dict[str, Any],
                          vocab: int | None = None):
    """``spec`` built for token ids (vocabulary and positions read from ``state``, else the tokenizer's
    vocabulary, else bytes'); one ConfigError line if it is no language model."""
    from polytrain.errors import ConfigError
    from polytrain.models.lm import model_vocab_size, shape_from_state
    from polytrain.models.registry import build_model

    shape = {"input_shape": (1,), "num_classes": vocab or 256, **shape_from_state(state)}
    try:
        model = build_model(spec, model_args, **shape)
    except ConfigError:
        if shape_from_state(state):  # a language model's weights: the arguments are what is wrong
            raise
        raise ConfigError(_not_a_language_model(spec, saved, "it does not take byte ids")) from None
    if model_vocab_size(model) is None:
        raise ConfigError(_not_a_language_model(spec, saved, "it has no token embedding"))
    return model


def _check_vocabulary(model: Any, tokenizer: Any, name: str) -> None:
    from polytrain.errors import ConfigError
    from polytrain.models.lm import model_vocab_size

    vocab = model_vocab_size(model)
    if vocab is not None and vocab < tokenizer.vocab_size:
        raise ConfigError(f"--tokenizer {name}: its vocabulary of {tokenizer.vocab_size} tokens is larger than the "
                          f"model's {vocab}; give the tokenizer the model was trained with")


def _load_error(exc: RuntimeError) -> str:
    """What ``load_state_dict`` found wrong, in one line: past its header, shortened."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()] or [type(exc).__name__]
    first = lines[1] if len(lines) > 1 and lines[0].startswith("Error(s) in loading") else lines[0]
    return first if len(first) <= 160 else first[:160] + "…"


def _not_a_language_model(spec: str, saved: dict[str, Any], why: str) -> str:
    ours = saved.get("model") == spec and saved.get("data")
    what = f"the run's model {spec} (trained on {saved['data']})" if ours else f"--model {spec}"
    return (f"{what} is not a byte-level language model ({why}); generate samples from a model that maps "
            "byte ids to next-byte logits: rnn_lm, transformer_lm, or your own factory of one")


def _check_next_token_logits(model: Any, spec: str, saved: dict[str, Any]) -> None:
    """One ConfigError line unless one byte id in gives (1, 1, vocab) logits out."""
    import torch

    from polytrain.errors import ConfigError
    from polytrain.models.sampling import START
    from polytrain.tasks import outputs_of

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            shape = tuple(outputs_of(model(torch.tensor([list(START)]))).shape)
    except Exception as exc:  # noqa: BLE001 - whatever a model that takes no byte ids raises
        shape, why = None, f"it fails on byte ids: {type(exc).__name__}"
    model.train(was_training)
    if shape is not None:
        if len(shape) == 3 and shape[:2] == (1, 1):
            return
        why = f"for 1 byte id it gives outputs of shape {shape}, not (1, 1, vocab)"
    raise ConfigError(_not_a_language_model(spec, saved, why))


def _read_weights(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state_dict, the run's saved config or {})."""
    import torch

    from polytrain.errors import ConfigError
    from polytrain.train.checkpoint import Checkpointer

    if args.weights:
        return _read_state_dict(args.weights), {}
    state = Checkpointer(args.checkpoint_dir).load_latest()
    if state is None:
        raise ConfigError(f"--checkpoint-dir {args.checkpoint_dir}: no checkpoint there")
    if not isinstance(state.get("model"), dict) or not state["model"]:
        raise ConfigError(f"--checkpoint-dir {args.checkpoint_dir}: its latest checkpoint holds no model state_dict; "
                          "use the directory of a run that polytrain train checkpointed")
    return state["model"], state.get("config", {})


#: what --weights wants, ending each of its errors
_WEIGHTS_WANTED = "give the file 'polytrain train --save-model FILE' wrote (a state_dict: tensors by name)"


def _read_state_dict(path: str) -> dict[str, Any]:
    """The state_dict in ``path``; one ConfigError line naming the file if it is no such thing."""
    import os
    import warnings

    import torch

    from polytrain.errors import ConfigError
    from polytrain.train.integrity import FORMAT

    what = f"--weights {path}"
    if os.path.isdir(path):
        raise ConfigError(f"{what}: a directory, not a weights file; {_WEIGHTS_WANTED}, or the run's "
                          "checkpoints with --checkpoint-dir DIR")
    try:
        with open(path, "rb") as fh:
            empty = os.fstat(fh.fileno()).st_size == 0  # /dev/null, /dev/zero too
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read it ({exc.strerror or exc})") from None
    if empty:
        raise ConfigError(f"{what}: the file is empty; {_WEIGHTS_WANTED}")
    try:
        with warnings.catch_warnings():  # torch's notes on a foreign pickle: the one line below says it all
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a damaged or foreign file: whatever torch.load raises for it
        first = (str(exc).strip().splitlines() or [""])[0].split(". ")[0]
        reason = type(exc).__name__ + (f": {first}" if first and len(first) <= 100 else "")
        raise ConfigError(f"{what}: not a file of tensors torch.save wrote, or a damaged one ({reason}); "
                          f"{_WEIGHTS_WANTED}") from None
    if isinstance(state, dict) and state.get("format") == FORMAT:
        raise ConfigError(f"{what}: a polytrain checkpoint, not a model's weights; pass its directory with "
                          "--checkpoint-dir DIR (or write the weights with 'polytrain checkpoint export')")
    problem = _not_a_state_dict(state)
    if problem:
        raise ConfigError(f"{what}: {problem}; {_WEIGHTS_WANTED}")
    return state


def _not_a_state_dict(state: Any) -> str | None:
    import torch

    if not isinstance(state, dict):
        return f"holds a {type(state).__name__}, not a state_dict"
    if not state:
        return "holds an empty dict, no tensors"
    bad = next(((k, v) for k, v in state.items() if not isinstance(k, str) or not torch.is_tensor(v)), None)
    if bad is not None:
        return f"not a state_dict: it maps {bad[0]!r} to a {type(bad[1]).__name__}, not to a tensor"
    return None
