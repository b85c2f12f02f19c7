"""The 62 M-parameter ``transformer_lm`` of docs/fsdp.md under ``fsdp --workers 4 --memory-limit 600MiB``, end to
end: a run that is never stopped, a run stopped by SIGTERM after step ``--stop-after`` and resumed under the same
limit, and ``polytrain checkpoint export`` of the stopped-and-resumed run's checkpoint.

    python benchmarks/fsdp_memory_resume.py                      # 5 steps, SIGTERM once step 2 is logged
    python benchmarks/fsdp_memory_resume.py --steps 6 --stop-after 3 --json benchmarks/results/fsdp-62m.json

Every training process runs under ``--memory-limit`` (the kernel's RLIMIT_DATA at its baseline plus the limit:
an allocation past it is refused, and the run stops with the limit's one line), and so does the export (the
same mechanism, applied in its process once Python and torch are loaded; ``checkpoint export`` has no flag for
it). It prints how each ended, each rank's peak RSS (the run's summary; it includes the baseline and resident
library code), whether the resumed model equals the uninterrupted one bit for bit (both written by
``--save-model DIR``, one tensor at a time), and whether the export's directory equals ``--save-model``'s.
Exit status 1 when any of these fails. Half an hour on a loaded 2-core machine.

``--hf`` does the same for a Hugging Face model that every run starts from with ``--init-from``: the script writes
a transformers ``LlamaForCausalLM`` (rotary embeddings, grouped-query attention; ``--hf-config``) with
``save_pretrained`` into a temporary directory (nothing is downloaded), and each run is ``--model hf:DIR
--init-from DIR`` (the resumed one starts from its checkpoint). Its parameter bytes exceed ``--limit``, so no
process can hold the whole model; the optimizer is plain SGD (Adam's two moments would be the whole model's bytes
again on each of 4 ranks), with ``--activation-checkpointing full``. It also loads the exported directory with transformers' ``from_pretrained`` and
checks that nothing is missing or unexpected::

    python benchmarks/fsdp_memory_resume.py --hf                 # 230 MiB of parameters, --memory-limit 224MiB
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = "transformer_lm:layers=8,dim=800,heads=8"
#: --hf's Llama: 48 layers of 1.25 M parameters and a 256-token vocabulary (bytes): 230 MiB of float32 parameters
#: (a rank holds a quarter of the parameters and of the gradients, a few units gathered, and some 60 MiB of other
#: data: thread stacks, the process group's buffers, the data; the limit is below the parameters' bytes)
HF_CONFIG = "layers=48,hidden=384,intermediate=768,heads=8,kv_heads=2"


def _env() -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[1] / "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}


def _train_args(args: argparse.Namespace) -> list[str]:
    hf = args.model.startswith("hf:")
    # --hf: every run starts from the directory's weights; plain SGD, activations recomputed, a 1/200 test split
    extra = ["--init-from", args.model[3:], "--momentum", "0", "--activation-checkpointing", "full"] if hf else []
    data = "text:seq_len=32" + (",test_fraction=0.005" if hf else "")
    return ["--strategy", "fsdp", "--workers", "4", "--model", args.model, *extra, "--data", data,
            "--batch-size", "8", "--optimizer", args.optimizer, "--lr", args.lr, "--steps", str(args.steps),
            "--eval-every", "0", "--eval-batch-size", "16", "--memory-limit", args.limit, "--log-every", "1",
            "--progress", "off", "--timeout", "900", "--seed", "3"]


def _records(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip().endswith("}")]


def _end(metrics: Path) -> dict:
    ends = [r for r in _records(metrics) if r.get("event") == "end"]
    if not ends:
        raise SystemExit(f"{metrics}: no end record")
    return ends[-1]


def _run(name: str, cmd: list[str], timeout: float) -> tuple[int, str]:
    """Run a polytrain command to its end: (exit status, stderr)."""
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "polytrain", *cmd], env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise SystemExit(f"{name}: still running after {timeout:.0f} s (killed)") from None
    print(f"{name}: exit {proc.returncode} after {time.monotonic() - started:.0f} s", flush=True)
    return proc.returncode, err


#: ``polytrain checkpoint export`` under ``--memory-limit``'s own mechanism: the kernel's RLIMIT_DATA at this
#: process's data size once Python and torch are loaded, plus the limit (as a worker applies it)
_EXPORT_UNDER_LIMIT = """
import sys
import torch
from polytrain.cli.main import main
from polytrain.devices.memory_limit import limited
with limited(sys.argv[1], torch.device("cpu")):
    code = main(["checkpoint", "export", sys.argv[2], sys.argv[3]])
sys.exit(code)
"""


def _export(ckpt: Path, out: Path, limit: str, timeout: float) -> tuple[int, str, float]:
    """``polytrain checkpoint export`` in its own process under ``limit``: (exit status, stderr, its peak RSS in
    MiB from the kernel's accounting, wait4)."""
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", _EXPORT_UNDER_LIMIT, limit, str(ckpt), str(out)], env=_env(),
                            text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = proc.stderr.read()
    deadline = time.monotonic() + timeout
    while True:  # (wait4 gives the child's own rusage; Popen.wait would reap it without)
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"export: still running after {timeout:.0f} s (killed)")
        time.sleep(0.1)
    proc.returncode = os.waitstatus_to_exitcode(status)
    print(f"export: exit {proc.returncode} after {time.monotonic() - started:.0f} s", flush=True)
    return proc.returncode, err, usage.ru_maxrss / 1024  # Linux: KiB


def _same_directory(a: Path, b: Path) -> tuple[bool, str]:
    """Every tensor of two Hugging Face directories equal bit for bit: (yes/no, the first difference)."""
    import torch
    from safetensors.torch import load_file

    def tensors(directory: Path) -> dict:
        out: dict = {}
        for shard in sorted(directory.glob("*.safetensors")):
            out.update(load_file(shard))
        return out

    left, right = tensors(a), tensors(b)
    if left.keys() != right.keys() or not left:
        return False, f"names differ: {sorted(left.keys() ^ right.keys())[:5]}"
    for key, value in left.items():
        if value.dtype != right[key].dtype or not torch.equal(value, right[key]):
            return False, f"{key} differs (largest {(value.double() - right[key].double()).abs().max():.3g})"
    return True, f"{len(left)} tensors equal"


def _write_llama(directory: Path, spec: str) -> int:
    """A transformers Llama of ``spec`` (``layers=…,hidden=…``) written with ``save_pretrained`` in shards,
    its weights drawn from a fixed seed; returns its parameter bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = {key: int(value) for key, value in (item.split("=") for item in spec.split(","))}
    config = LlamaConfig(vocab_size=256, hidden_size=sizes["hidden"], intermediate_size=sizes["intermediate"],
                         num_hidden_layers=sizes["layers"], num_attention_heads=sizes["heads"],
                         num_key_value_heads=sizes["kv_heads"], max_position_embeddings=64,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(11)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory, max_shard_size="20MB")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _loads_in_transformers(directory: Path) -> tuple[bool, str]:
    """``from_pretrained`` of an exported directory: no missing or unexpected keys."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    wrong = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    return not wrong, f"{type(model).__name__}, {sum(p.numel() for p in model.parameters())} parameters" + (
        f"; {wrong}" if wrong else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=MODEL, help="(a smaller one tries the script out)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--stop-after", type=int, default=2, help="SIGTERM once this step is logged")
    parser.add_argument("--limit", default="600MiB", help="--memory-limit of every run")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds each run may take")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--hf", action="store_true", help="a transformers Llama written here, --model hf:DIR "
                        "--init-from DIR (defaults then: --limit 224MiB, --optimizer sgd, --lr 0.05)")
    parser.add_argument("--hf-config", default=HF_CONFIG, help="--hf's Llama (default %(default)s)")
    parser.add_argument("--optimizer", help="adam (default), or sgd with --hf")
    parser.add_argument("--lr", help="0.001 (default), or 0.05 with --hf")
    args = parser.parse_args()
    args.optimizer = args.optimizer or ("sgd" if args.hf else "adam")
    args.lr = args.lr or ("0.05" if args.hf else "0.001")
    if args.hf and args.limit == parser.get_default("limit"):
        args.limit = "224MiB"
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="fsdp-62m-") as tmp:
        tmp = Path(tmp)
        results: dict = {}
        if args.hf:
            results["parameter_mib"] = round(_write_llama(tmp / "llama", args.hf_config) / 2**20, 1)
            args.model = f"hf:{tmp / 'llama'}"
            print(f"wrote a Llama of {args.hf_config}: {results['parameter_mib']} MiB of float32 parameters",
                  flush=True)
        results.update({"model": args.model, "limit": args.limit, "steps": args.steps,
                        "optimizer": args.optimizer})
        # 1. never stopped
        code, err = _run("whole run", ["train", *_train_args(args), "--metrics-file", str(tmp / "whole.jsonl"),
                                          "--save-model", str(tmp / "whole")], args.timeout)
        if code != 0:
            raise SystemExit(f"the whole run failed ({code}):\n{err[-3000:]}")
        results["whole_peak_mib"] = _end(tmp / "whole.jsonl")["rank_peak_memory_mb"]
        # 2. stopped by SIGTERM after --stop-after
        ckpt, metrics = tmp / "ck", tmp / "stopped.jsonl"
        proc = subprocess.Popen([sys.executable, "-m", "polytrain", "train", *_train_args(args), "--checkpoint-dir",
                                 str(ckpt), "--metrics-file", str(metrics)], env=_env(), text=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + args.timeout
        while max((r.get("step", 0) for r in _records(metrics) if r.get("event") == "step"), default=0) \
                < args.stop_after:
            if proc.poll() is not None or time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                raise SystemExit(f"the run to stop ended or hung before step {args.stop_after}: "
                                 f"{proc.communicate()[1][-3000:]}")
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=args.timeout)
        stopped = [r for r in _records(metrics) if r.get("event") == "end"]
        results["stopped_exit"] = proc.returncode
        results["stopped_line"] = next((line for line in err.splitlines() if "stopped by SIGTERM" in line), "")
        results["stopped_peak_mib"] = stopped[-1].get("rank_peak_memory_mb") if stopped else None
        results["stopped_at"] = (stopped[-1].get("stopped") or {}).get("step") if stopped else None
        print(f"stopped run: exit {proc.returncode}: {results['stopped_line']}", flush=True)
        if proc.returncode != 75:
            raise SystemExit(f"the stopped run ended with {proc.returncode}, not 75:\n{err[-3000:]}")
        if not results["stopped_at"] or results["stopped_at"] >= args.steps:
            raise SystemExit(f"the run stopped at step {results['stopped_at']}, leaving nothing to resume: "
                             "give more --steps")
        # 3. resumed under the same limit
        code, err = _run("resumed run", ["train", *_train_args(args), "--checkpoint-dir", str(ckpt), "--resume",
                                            "--metrics-file", str(tmp / "resumed.jsonl"), "--save-model",
                                            str(tmp / "resumed")], args.timeout)
        if code != 0:
            raise SystemExit(f"the resumed run failed ({code}):\n{err[-3000:]}")
        results["resumed_peak_mib"] = _end(tmp / "resumed.jsonl")["rank_peak_memory_mb"]
        results["bit_identical"], results["bit_identical_detail"] = _same_directory(tmp / "whole", tmp / "resumed")
        # 4. checkpoint export of the resumed run's newest checkpoint
        code, err, peak = _export(ckpt, tmp / "exported", args.limit, args.timeout)
        results["export_exit"], results["export_peak_mib"] = code, round(peak, 1)
        results["export_equal"], results["export_detail"] = (_same_directory(tmp / "resumed", tmp / "exported")
                                                              if code == 0 else (False, err[-1000:]))
        if args.hf and code == 0:
            results["export_loads"], results["export_loads_detail"] = _loads_in_transformers(tmp / "exported")
    load.append(os.getloadavg()[0])
    results["load"] = [round(x, 1) for x in load]
    # every run and the export ran under RLIMIT_DATA = baseline + the limit (the kernel refuses an allocation past
    # it: the limit's one line, exit 2), so having ended as expected is being within it; peak RSS also counts the
    # baseline (interpreter, torch, process group: about 380 MiB of data) and resident library code
    results["within_limit"] = results["export_exit"] == 0  # (each run that failed stopped the script above)
    what = (f"Llama {args.hf_config} ({results['parameter_mib']} MiB of parameters), --init-from its directory"
            if args.hf else args.model)
    print(f"\n{what}, fsdp --workers 4 --memory-limit {args.limit}, {args.steps} steps ({args.optimizer}); each run "
          f"under the kernel's RLIMIT_DATA = baseline + {args.limit} per process; load {load[0]:.1f} -> {load[1]:.1f}")
    print(f"{'run':<34}{'ended':<22}peak RSS per rank, MiB (baseline and libraries included)")
    for name, key, ended in (("never stopped", "whole_peak_mib", "exit 0"),
                             (f"SIGTERM once step {args.stop_after} was logged", "stopped_peak_mib",
                              f"exit 75 after step {results['stopped_at']}"),
                             ("resumed", "resumed_peak_mib", "exit 0")):
        ranks = results[key] or []
        print(f"{name:<34}{ended:<22}{' / '.join(f'{p:.1f}' for p in ranks) or '-'}")
    print(f"{'checkpoint export (one process)':<34}{'exit ' + str(results['export_exit']):<22}"
          f"{results['export_peak_mib']:.1f}")
    print(f"resumed = never stopped, bit for bit: {'yes' if results['bit_identical'] else 'no'} "
          f"({results['bit_identical_detail']})")
    print(f"export ok (= --save-model, bit for bit): {'yes' if results['export_equal'] else 'no'} "
          f"({results['export_detail']})")
    if args.hf:
        print(f"export loads in transformers' from_pretrained, nothing missing or unexpected: "
              f"{'yes' if results.get('export_loads') else 'no'} ({results.get('export_loads_detail', '-')})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0 if results["within_limit"] and results["bit_identical"] and results["export_equal"] and \
        results.get("export_loads", not args.hf) else 1


if __name__ == "__main__":
    sys.exit(main())
