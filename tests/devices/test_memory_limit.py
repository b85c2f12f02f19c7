"""``--memory-limit SIZE`` (polytrain/devices/memory_limit.py): sizes, the one line before anything starts, and a
worker past the limit failing with one line under single and sync, the other ranks stopped with it."""

import re
import multiprocessing
import resource
import subprocess
import sys
import time

import pytest
import torch

import polytrain
from polytrain.cli.main import main
from polytrain.devices import memory_limit
from polytrain.devices.memory_limit import ADVICE, apply_memory_limit, limited, memory_error, parse_size, vm_data
from polytrain.errors import ConfigError, DeviceError, MemoryLimitError
from tests.helpers.cli_batch import run_here
from tests.helpers.forked import run_forked
from tests.helpers.procs import alive, descendants

#: ~4.9 M parameters: 74 MiB of float32 parameters, gradients and Adam state, over a limit 1.6x below that
#: (the documented case is 62 M parameters, ~990 MB of state, under 600MiB: docs/devices.md)
MODEL = ["--model", "transformer_lm:layers=6,dim=256,heads=4", "--data", "text:seq_len=32", "--optimizer", "adam",
         "--batch-size", "8", "--steps", "3", "--progress", "off"]
LIMIT = "46MiB"
FOUR_RANKS_LIMIT = "60MiB"  # 4 fsdp ranks or 4 pipeline stages train within it, single does not


@pytest.mark.parametrize("text, size", [
    ("600MiB", 600 * 2**20), ("2GB", 2 * 10**9), ("1.5GiB", 3 * 2**29), ("4096", 4096), ("64 KiB", 65536),
    ("10kb", 10_000), ("3MB", 3_000_000), ("1TiB", 2**40), ("7b", 7),
])
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["0", "-5MiB", "0MiB", "abc", "12 parsecs", "1e3MB", ""])
def test_bad_sizes(text):
    with pytest.raises(ValueError, match="size such as 600MiB|more than 0 bytes"):
        parse_size(text)


def test_a_bad_limit_is_one_line_before_anything_starts(capsys):
    proc = run_here(capsys, "train", "--strategy", "sync", "--workers", "2", "--memory-limit", "0")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "polytrain: error: --memory-limit: must be more than 0 bytes, got '0'"
    assert proc.stdout == ""  # nothing started


@pytest.mark.parametrize("value", ["-1GB", "lots", "1KB"])
def test_bad_limits_from_the_command_line(capsys, value):
    assert main(["train", f"--memory-limit={value}", "--steps", "1"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("polytrain: error: --memory-limit: ") and value in line


def test_the_limit_and_the_gpu_fraction_are_one_or_the_other():
    with pytest.raises(DeviceError, match="--memory-limit and --gpu-memory-fraction"):
        polytrain.fit(strategy="single", steps=1, memory_limit="1GiB", gpu_memory_fraction=0.5, progress="off")


def _one_line_past_the_limit(stderr, ranks, limit=LIMIT):
    (line,) = [line for line in stderr.strip().splitlines() if line.strip()]
    match = re.match(rf"polytrain: error: \[rank (\d)\] out of memory under --memory-limit {limit} per worker: "
                     r"allocating [\d.]+ [KM]iB with [\d.]+ MiB of it in use would pass it; ", line)
    assert match and int(match.group(1)) in ranks and line.endswith(ADVICE), line


def test_single_past_the_limit_fails_with_one_line(tmp_path):
    """Also where 4 fsdp ranks or 4 pipeline stages train (test_fsdp_and_pipeline_with_4_ranks_...). The
    command's main in a fresh process: single trains in it, limited from its start."""
    code = run_forked(main, ["train", "--strategy", "single", *MODEL, "--memory-limit", FOUR_RANKS_LIMIT],
                               stderr=tmp_path / "stderr")
    assert code == 1
    _one_line_past_the_limit((tmp_path / "stderr").read_text(), [0], FOUR_RANKS_LIMIT)


def test_sync_past_the_limit_fails_with_one_line_and_every_rank_stopped(cli_env):
    proc = subprocess.Popen([sys.executable, "-m", "polytrain", "train", "--strategy", "sync", "--workers", "2",
                             *MODEL, "--memory-limit", LIMIT], env=cli_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen = set()
    while proc.poll() is None:  # every process of the job while it runs: the launcher's workers
        seen.update(descendants(proc.pid))
        time.sleep(0.05)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1
    _one_line_past_the_limit(stderr, [0, 1])
    assert len(seen) >= 3  # the launcher and its two workers were there
    assert not alive(sorted(seen - {proc.pid}))  # and none outlived the command


def test_fsdp_and_pipeline_with_4_ranks_train_within_a_limit_single_cannot():
    """Within 60MiB per worker, where single fails (test_single_past_the_limit_fails_with_one_line): each of 4
    fsdp ranks holds a quarter of the 74 MiB of state (a unit's gathered parameters, freed each step, are
    returned to the kernel, not kept) and each of 4 pipeline stages its own units': 2, 1, 1 and 2 of the 6 blocks,
    the embedding and the head with the outer ones (cut with --split-at: the measured split balances forward and
    backward time, which a loaded machine moves, and put 4 units on one stage under a CPU burner). In this process
    (the workers are fresh processes, limited from their own start, as the command's are); a test split of 1 %
    keeps the final evaluation short."""
    run = dict(model="transformer_lm:layers=6,dim=256,heads=4", data="text:seq_len=32,test_fraction=0.01",
               optimizer="adam", batch_size=8, steps=3, progress="off", eval_batch_size=8,
               memory_limit=FOUR_RANKS_LIMIT)
    pipeline = dict(strategy="pipeline", pp=4, split_at="blocks.2,blocks.3,blocks.4")
    for strategy in (dict(strategy="fsdp", workers=4), pipeline):
        summary = polytrain.fit(**strategy, **run)
        held = summary["rank_state_mb"]
        assert summary["steps"] == 3 and summary["eval_loss"] is not None, (strategy, summary)
        assert len(held) == 4 and sum(held) < 80 and max(held) < 30, (strategy, held)


def test_past_the_limit_in_evaluation_the_line_says_eval_batch_size():
    allocator = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 104857600 bytes.")
    with limited("8GiB", torch.device("cpu"), rank=1):
        with pytest.raises(MemoryLimitError) as caught, memory_limit.evaluating(256):
            raise allocator
        assert re.fullmatch(r"\[rank 1\] out of memory under --memory-limit 8GiB per worker: allocating 100.0 MiB "
                            r"with ([\d.]+ [KMG]?i?B of it in use|none of it in use yet) would pass it; in evaluation: give a smaller "
                            r"--eval-batch-size \(now 256 per worker\)", str(caught.value)), str(caught.value)
        assert memory_error(allocator).args[0].endswith(ADVICE)  # outside evaluation: the usual advice
    with memory_limit.evaluating(256):  # no limit in force: nothing changes
        pass


def test_in_process_the_callers_limit_is_restored_after_the_run():
    # in a process of its own, fresh: a pytest worker's heap that earlier tests grew and freed (kept mapped by
    # the allocator) lets the run fit under a limit counted from here (it did not raise in one suite run)
    child = multiprocessing.get_context("spawn").Process(target=_the_callers_limit_is_restored)
    child.start()
    child.join(300)
    if child.exitcode is None:
        child.kill()
        child.join()
    assert child.exitcode == 0, f"the fresh process ended with {child.exitcode} (its traceback is above)"


def _the_callers_limit_is_restored() -> None:
    import faulthandler

    faulthandler.enable()  # a native crash under the tight limit (-11 once, in a whole-suite run) leaves its stack
    torch.set_num_threads(1)
    before = resource.getrlimit(resource.RLIMIT_DATA)
    # first, before anything imported torch's compiler: the optimizer's first zero_grad imports it (68 MiB of
    # module state); under the limit that import failed with "allocating a Python object", or crashed
    assert "torch._dynamo" not in sys.modules
    tiny = polytrain.fit(strategy="single", model="mlp:hidden=16", data="digits", steps=2, progress="off",
                         memory_limit="10MiB")
    assert tiny["steps"] == 2 and resource.getrlimit(resource.RLIMIT_DATA) == before
    common = dict(strategy="single", model="transformer_lm:layers=6,dim=256,heads=4", data="text:seq_len=32",
                  optimizer="adam", batch_size=8, steps=2, progress="off")
    with pytest.raises(MemoryLimitError, match=r"^\[rank 0\] out of memory under --memory-limit 46MiB per worker"):
        polytrain.fit(**common, memory_limit=LIMIT)
    assert resource.getrlimit(resource.RLIMIT_DATA) == before
    summary = polytrain.fit(**dict(common, model="mlp:hidden=16", data="digits"), memory_limit="200MiB")
    assert summary["steps"] == 2  # a run within its limit trains as without one
    assert resource.getrlimit(resource.RLIMIT_DATA) == before


def test_errors_past_the_limit_become_one_line_and_others_stay_what_they_are():
    allocator = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                             "memory: you tried to allocate 1048576 bytes. Error code 12 (Cannot allocate memory)")
    assert memory_error(allocator) is allocator  # no limit in force: nothing to blame on it
    with pytest.raises(MemoryLimitError) as caught, limited("8GiB", torch.device("cpu"), rank=3):
        raise allocator
    message = str(caught.value)
    assert message.startswith("[rank 3] out of memory under --memory-limit 8GiB per worker: allocating 1.0 MiB "
                              "with ") and message.endswith(ADVICE)
    with limited("8GiB", torch.device("cpu")):
        assert "allocating a Python object" in str(memory_error(MemoryError()))
        wrapped = RuntimeError("[Stage 0] failed to run forward")
        wrapped.__cause__ = allocator  # a pipeline stage's error around the allocator's
        assert "allocating 1.0 MiB" in str(memory_error(wrapped))
        other = ValueError("not memory")
        assert memory_error(other) is other
        with pytest.raises(ConfigError):  # errors that are not the limit's leave the block as they are
            raise ConfigError("bad")


def test_the_peers_hear_the_limits_line_and_none_in_use_is_not_0_bytes(monkeypatch):
    from polytrain.distributed.context import with_heartbeat

    class Beat:
        message = None

        def failed(self, message):
            self.message = message

    def fails():  # oneDNN's words for a kernel it had no memory for
        raise RuntimeError("could not create a primitive")

    beat = Beat()
    with pytest.raises(MemoryLimitError) as caught, limited("8GiB", torch.device("cpu"), rank=1) as applied:
        monkeypatch.setattr(memory_limit, "vm_data", lambda: applied.baseline)  # nothing allocated since the start
        with_heartbeat(beat, fails)
    assert beat.message == str(caught.value)  # what the others log is the launcher's line, not the RuntimeError
    assert "allocating memory with none of it in use yet would pass it" in beat.message, beat.message


def _counts_from_start():
    with limited("64MiB", torch.device("cpu")) as applied:
        soft, _ = resource.getrlimit(resource.RLIMIT_DATA)
        assert soft == applied.baseline + 64 * 2**20, (soft, applied.baseline)
        assert applied.baseline <= vm_data()
        kept = torch.empty(16 * 2**20, dtype=torch.uint8)  # within: fine
        try:
            torch.empty(80 * 2**20, dtype=torch.uint8)
        except RuntimeError as exc:
            assert "can't allocate memory" in str(exc)
        else:
            raise AssertionError("80 MiB past a 64MiB limit was allocated")
        del kept


def test_the_limit_counts_from_what_the_process_holds_at_its_start(tmp_path):
    """In a fresh process: one that has run others' tests may hold freed memory in its heap, which counts in
    its baseline and serves an allocation without a new mapping."""
    code = run_forked(_counts_from_start, stderr=tmp_path / "stderr")
    assert code == 0, (tmp_path / "stderr").read_text()


def test_the_cpu_limit_needs_linux(monkeypatch):
    monkeypatch.setattr(memory_limit.sys, "platform", "darwin")
    with pytest.raises(ConfigError, match=r"^--memory-limit 1GiB on the CPU needs Linux .* use it with a GPU"):
        apply_memory_limit("1GiB", torch.device("cpu"), 0)


def test_a_kernel_that_does_not_enforce_the_limit_is_one_line_and_changes_nothing(monkeypatch):
    class Granted:  # an mmap past the limit that the kernel let through
        def close(self):
            pass

    before = resource.getrlimit(resource.RLIMIT_DATA)
    monkeypatch.setattr(memory_limit.mmap, "mmap", lambda *args, **kwargs: Granted())
    with pytest.raises(ConfigError, match=r"^--memory-limit 64MiB: this Linux kernel does not enforce RLIMIT_DATA"):
        apply_memory_limit("64MiB", torch.device("cpu"), 0)
    assert resource.getrlimit(resource.RLIMIT_DATA) == before


def _hard_limit_below():
    resource.setrlimit(resource.RLIMIT_DATA, (vm_data() + (256 << 20),) * 2)
    apply_memory_limit("1GiB", torch.device("cpu"), 0)


def test_a_hard_limit_below_the_asked_one_is_one_line(tmp_path):
    """In a fresh process: the hard limit it lowers cannot be raised again."""
    code = run_forked(_hard_limit_below, stderr=tmp_path / "stderr")
    stderr = (tmp_path / "stderr").read_text()
    assert code == 1
    assert re.search(r"ConfigError: --memory-limit 1GiB: this process may not raise its data limit above "
                     r"[\d.]+ MiB \(ulimit -d\), [\d.]+ MiB of which it holds at the start", stderr), stderr
