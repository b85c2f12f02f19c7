"""``--host-memory``: with ``cache`` a training step reuses its memory instead of faulting in fresh pages.

Page faults are counted in fresh processes (the setting is process-wide C library state); the median
step's count is what is asserted. Only ``cache`` is polytrain's doing: whether glibc's default (``release``)
faults depends on its sliding mmap threshold, i.e. on what the process happened to free before (measured
here: from about 1 to 2,400 faults per step between runs of the same script), so ``release`` is compared
with only when that run did fault."""

import functools
import os
import subprocess
import sys

import pytest

from polytrain.devices import host_memory
from polytrain.devices.host_memory import describe_host_memory, set_host_memory
from tests.conftest import SRC

_STEPS = """
import resource, sys, torch, torch.nn.functional as F
from polytrain.devices.host_memory import set_host_memory
from polytrain.models.registry import build_model
print(set_host_memory(sys.argv[1]))
torch.manual_seed(0)
torch.set_num_threads(1)
model = build_model("cifar_cnn", input_shape=(3, 24, 24), num_classes=10)
x, y = torch.randn(16, 3, 24, 24), torch.randint(0, 10, (16,))
def step():
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
for _ in range(5):
    step()
faults = []
for _ in range(15):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sorted(faults)[7])  # the median step: a one-off growth of the heap (seen: 145, 576 faults) is not a step's cost
"""

NEAR_ZERO = 8  # pages per step (32 KiB); one step of this model touches about 2,000 pages of activations
FAULTED = 10 * NEAR_ZERO  # a release run below this kept its memory too: there is nothing to compare


@functools.cache
def _faults_per_step(mode):
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", _STEPS, mode], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    said, faults = done.stdout.strip().splitlines()
    return said, float(faults)


def _cached():
    said, faults = _faults_per_step("cache")
    if "not glibc" in said:
        pytest.skip(said)
    assert said == "freed tensor memory kept for reuse (--host-memory cache)"
    return faults


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc is what it tunes")


def test_cache_steps_fault_in_near_zero_pages():
    cached = _cached()
    assert cached <= NEAR_ZERO, f"--host-memory cache: the median step faulted {cached:g} pages"


def test_cache_faults_far_less_than_a_release_run_that_faulted():
    cached = _cached()
    said, released = _faults_per_step("release")
    assert said == "freed tensor memory returned to the system (glibc's default)"
    if released < FAULTED:
        pytest.skip(f"glibc's default kept this run's memory as well ({released:g} page faults per median step)")
    assert cached < released / 10, f"cache: {cached:g} page faults per step, release: {released:g}"


def test_another_preloaded_malloc_is_left_alone_and_named(monkeypatch):
    monkeypatch.setattr(host_memory, "_state", {"applied": "release", "why": "glibc's default"})
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert set_host_memory("cache") == ("freed tensor memory returned to the system "
                                        "(jemalloc is preloaded and has its own settings)")
    assert describe_host_memory().endswith("(jemalloc is preloaded and has its own settings)")


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="must be one of cache, release, got 'keep'"):
        set_host_memory("keep")
