"""The loaded-weights matrix: models users bring, their weights loaded by their own code, under each strategy.

Models (:mod:`tests.helpers.zoo`): a transformers Llama and a tied GPT-2 loaded with ``from_pretrained`` from a
directory written here, nanoGPT's shape (blocks in an ``nn.ModuleDict``, tied ``wte``/``lm_head``, fused qkv)
loaded with ``load_state_dict``, and nanoGPT's shape whose ``init_unit`` reads each unit from a file.

* **lr 0**: one step saves exactly the weights loaded (:func:`loaded_weights` is what the model's own code
  loads, read here without polytrain);
* **SGD**: eight steps end within 1e-5 of ``single``;
* **Adam**: eight steps end as ``single`` does, within ``sync``'s own distance from ``single``.

A cell is (model, strategy, "lr0", "sgd" or "adam"). The cells of one world size run in the same worker processes, one
after the other, forked from this process (which has imported transformers and built the models once). A cell
that cannot run is the one line of its refusal (a :class:`~polytrain.errors.ConfigError`), before launch where
the settings show it, else from the workers. ``tests/weights/test_loaded_matrix.py`` runs a bounded set;
``benchmarks/loaded_weights.py`` runs them all and prints the table.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

import polytrain
from polytrain.config import make_config
from polytrain.distributed.launch import launch
from polytrain.errors import ConfigError
from polytrain.train.run import layout_of
from polytrain.train.trainer import Trainer
from tests.helpers import zoo

MODELS = ("llama", "gpt2", "nanogpt", "unit_gpt")
STRATEGIES = {  # name: (world size, settings)
    "single": (1, dict(strategy="single")),
    "sync-2": (2, dict(strategy="sync", workers=2)),
    "fsdp-2": (2, dict(strategy="fsdp", workers=2)),
    "pipeline-2": (2, dict(strategy="pipeline", pp=2, microbatches=2)),
    "tp-2": (2, dict(strategy="tp", workers=2, tp=2)),
    "hybrid-2x2": (4, dict(strategy="hybrid", workers=4, dp_replicate=2, pp=2, microbatches=2)),
    "hybrid-shard-2x2": (4, dict(strategy="hybrid", workers=4, dp_shard=2, pp=2, microbatches=2)),
    "hsdp-2x2": (4, dict(strategy="fsdp", workers=4, dp_replicate=2, dp_shard=2)),
}
RUNS = {"lr0": dict(steps=1, lr=0.0, optimizer="sgd", momentum=0.0),
        "sgd": dict(steps=8, lr=0.1, optimizer="sgd", momentum=0.0),
        "adam": dict(steps=8, lr=0.01, optimizer="adam")}
COMMON = dict(batch_size=8, seed=3, progress="off", eval_every=0, log_every=1, timeout=120)
SEEDS = {"llama": 7, "gpt2": 8, "nanogpt": 4, "unit_gpt": 5}


def write_models(root: Path) -> dict[str, dict[str, str]]:
    """Each model's files, written here (no hub), and the ``--model-arg``s that load them."""
    text = root / "words.txt"
    rng = random.Random(0)
    text.write_text(" ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat", "dog", "ran"]) for _ in range(700)))
    return {"llama": {"path": str(zoo.write_pretrained("llama", root / "llama", seed=SEEDS["llama"]))},
            "gpt2": {"path": str(zoo.write_pretrained("gpt2", root / "gpt2", seed=SEEDS["gpt2"]))},
            "nanogpt": {"path": str(zoo.write_state(root / "nanogpt.pt", seed=SEEDS["nanogpt"]))},
            "unit_gpt": {"path": str(zoo.write_state(root / "unit_gpt.pt", seed=SEEDS["unit_gpt"], tie=False))}}


def loaded_weights(model: str, args: dict[str, str]) -> dict[str, torch.Tensor]:
    """The weights the model's own code loads, as its ``state_dict`` names them, read without polytrain."""
    if model in ("llama", "gpt2"):
        return getattr(zoo, model)(path=args["path"]).state_dict()
    state = torch.load(args["path"], weights_only=True)
    return zoo.nanogpt(path=args["path"]).state_dict() if model == "nanogpt" else state


def config(root: Path, args: dict[str, dict[str, str]], cell: tuple[str, str, str]) -> Any:
    model, strategy, run = cell
    return make_config(**COMMON, **RUNS[run], **STRATEGIES[strategy][1], data=f"text:file={root / 'words.txt'},"
                       "seq_len=16", model=f"tests.helpers.zoo:{model}", model_args=args[model],
                       save_model=str(saved_path(root, cell)))


def saved_path(root: Path, cell: tuple[str, str, str]) -> Path:
    return root / f"{'-'.join(cell)}.pt"


def _in_workers(ctx: Any, configs: list[tuple[tuple[str, str, str], Any]]) -> dict:
    """Each cell in turn in these workers: its summary, or its refusal's line."""
    out: dict = {}
    for cell, cfg in configs:
        try:
            out[cell] = Trainer(cfg, ctx.topology, stop=ctx.stop, layout=layout_of(cfg)).fit()
        except ConfigError as exc:
            out[cell] = str(exc)
    return out


def run_cells(root: Path, cells: list[tuple[str, str, str]]) -> dict[tuple[str, str, str], Any]:
    """Run ``cells`` (model, strategy, run): each one's summary, or its refusal's one line."""
    args = write_models(root)
    results: dict = {}
    by_world: dict[int, list] = {}
    for cell in cells:
        try:
            cfg = config(root, args, cell)
            layout_of(cfg)
        except ConfigError as exc:
            results[cell] = str(exc)
            continue
        by_world.setdefault(STRATEGIES[cell[1]][0], []).append((cell, cfg))
    for cell, cfg in by_world.pop(1, []):
        try:
            results[cell] = polytrain.fit(cfg)
        except ConfigError as exc:
            results[cell] = str(exc)
    for world, configs in sorted(by_world.items()):
        results.update(launch(_in_workers, configs, workers=world, layout=layout_of(configs[0][1]), device="cpu",
                              backend="gloo", timeout=120, threads_per_worker=1)[0])
    return results


def largest_difference(root: Path, cell: tuple[str, str, str], reference: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between the cell's saved model and ``reference`` (the same names)."""
    saved = torch.load(saved_path(root, cell), weights_only=True)
    if saved.keys() != reference.keys():
        raise AssertionError(f"{cell}: saved names differ from the reference's: "
                             f"{sorted(saved.keys() ^ reference.keys())[:6]}")
    return max((saved[k].double() - v.double()).abs().max().item() for k, v in reference.items())


#: Adam divides by the root of its second moment, so the last bits a reduction order changes grow over steps:
#: a strategy's distance from ``single`` is bounded by sync's own (its gradients all-reduced, nothing else
#: different), times this (measured on the whole matrix: at most 5.3, tp 2 on the Llama; 10.2 for the same cell
#: on an AVX-512 CPU, whose kernels sum in another order), and never below :data:`ADAM_FLOOR`: a tenth of the
#: least the eight steps move the weights (the test asserts more than 1e-3), which a wrong split or a lost update
#: passes by orders of magnitude, where sync's own distance alone can be small by chance
ADAM_FACTOR, ADAM_FLOOR = 10.0, 1e-4


def adam_bound(sync_distance: float) -> float:
    return max(ADAM_FACTOR * sync_distance, ADAM_FLOOR)
