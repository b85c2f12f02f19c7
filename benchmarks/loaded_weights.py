"""The whole loaded-weights matrix (:mod:`tests.weights.loaded_matrix`): four models users bring (a transformers
Llama and a tied GPT-2 from ``from_pretrained``, nanoGPT's shape from ``load_state_dict``, a class whose
``init_unit`` loads a file) under single, sync 2, fsdp 2, pipeline 2 (traced), tp 2, hybrid 2x2 (replicated and
sharded data axis) and fsdp's HSDP 2x2.

    python benchmarks/loaded_weights.py                 # three tables: lr 0, SGD and Adam
    python benchmarks/loaded_weights.py --runs lr0 --models llama,gpt2

lr 0: the largest absolute difference between the model saved after one step and the weights the model's own
code loads (must be <= 1e-7). SGD: after eight steps, the largest difference from ``single`` (<= 1e-5). Adam:
after eight steps, the largest difference from ``single`` (must be within ``ADAM_FACTOR`` times sync's own
difference from ``single``, or ``ADAM_FLOOR`` where that is larger). A cell that cannot run shows the one line
it is refused with. Exit status 1 when a cell that ran is outside its bound.
Minutes on 2 cores (the cells of one world size share their worker processes).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.helpers.zoo, tests.weights.loaded_matrix

from tests.helpers.threads import one_thread  # noqa: E402
from tests.weights.loaded_matrix import (MODELS, STRATEGIES, adam_bound, largest_difference,  # noqa: E402
                                         loaded_weights, run_cells, write_models)

LR0_BOUND, SGD_BOUND = 1e-7, 1e-5
TITLES = {"lr0": "lr 0, one step: largest |saved - loaded| (bound 1e-7)",
          "sgd": "SGD, eight steps: largest |strategy - single| (bound 1e-5)",
          "adam": "Adam, eight steps: largest |strategy - single| (bound: sync's own distance, see ADAM_FACTOR)"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--runs", default="lr0,sgd,adam")
    args = parser.parse_args()
    models, strategies, runs = args.models.split(","), args.strategies.split(","), args.runs.split(",")
    cells = [(m, s, r) for r in runs for m in models for s in strategies]
    for run, needed in (("sgd", ("single",)), ("adam", ("single", "sync-2"))):  # distances from single
        if run in runs:
            cells += [(m, s, run) for m in models for s in needed if (m, s, run) not in cells]
    os.environ.setdefault("POLYTRAIN_START_METHOD", "fork")  # workers inherit transformers and the models
    failed = False
    with tempfile.TemporaryDirectory(prefix="loaded-weights-") as tmp, one_thread():
        root = Path(tmp)
        results = run_cells(root, cells)
        files = write_models(root)
        refusals = []
        for run in runs:
            print(f"\n{TITLES[run]}\n{'model':<10}" + "".join(f"{s:>18}" for s in strategies))
            for model in models:
                row = f"{model:<10}"
                if run == "lr0":
                    reference = loaded_weights(model, files[model])
                else:
                    reference = None if isinstance(results[(model, "single", run)], str) else \
                        _load(root, (model, "single", run))
                    sync = None if run != "adam" or isinstance(results[(model, "sync-2", run)], str) \
                        or reference is None else largest_difference(root, (model, "sync-2", run), reference)
                for strategy in strategies:
                    cell = (model, strategy, run)
                    if isinstance(results[cell], str):
                        if results[cell] not in refusals:
                            refusals.append(results[cell])
                        row += f"{'refused [' + str(refusals.index(results[cell]) + 1) + ']':>18}"
                        continue
                    if reference is None:
                        row += f"{'(no single)':>18}"
                        continue
                    diff = largest_difference(root, cell, reference)
                    bound = {"lr0": LR0_BOUND, "sgd": SGD_BOUND}.get(run) or adam_bound(sync or 0.0)
                    failed |= diff > bound
                    row += f"{diff:>17.3g}{'!' if diff > bound else ' '}"
                print(row)
            if run == "adam":
                print("(sync's own distance, per model: " + ", ".join(
                    f"{m} {largest_difference(root, (m, 'sync-2', 'adam'), _load(root, (m, 'single', 'adam'))):.3g}"
                    for m in models if not isinstance(results[(m, "sync-2", "adam")], str)
                    and not isinstance(results[(m, "single", "adam")], str)) + ")")
        for number, line in enumerate(refusals, 1):
            print(f"[{number}] {line}")
    print("\nall within their bounds" if not failed else "\nOUTSIDE A BOUND (marked !)")
    return 1 if failed else 0


def _load(root: Path, cell: tuple[str, str, str]) -> dict:
    import torch

    from tests.weights.loaded_matrix import saved_path

    return torch.load(saved_path(root, cell), weights_only=True)


if __name__ == "__main__":
    sys.exit(main())
