"""The shared-memory all-reduce against sums computed in one process, and its decision plan."""

import os
import time

import pytest
import torch

from polytrain.distributed.shm import SHM_DIR, SharedMemoryAllReduce, gather_plan, plan_shm, region_bytes
from polytrain.errors import CommunicationError, ConfigError
from tests.helpers.spawn import spawn

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm")

# (numel, dtype): below, equal to and above one chunk, with ragged tails and several dtypes
CASES = [(1, torch.float32), (1000, torch.float32), (4096, torch.float32), (10_007, torch.float32),
         (3_001, torch.float64), (5_000, torch.bfloat16), (777, torch.int64)]
CHUNK = 16 << 10  # small, so the larger cases take several rounds through the window


def _contribution(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + numel)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)
    return torch.randint(-1000, 1000, (numel,), generator=gen, dtype=dtype)


def _expected_sum(world: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    total = _contribution(0, numel, dtype) + _contribution(1, numel, dtype)
    for rank in range(2, world):
        total += _contribution(rank, numel, dtype)  # rank order, in the tensor's own dtype
    return total


def _reduce_all_cases(ctx):
    exchange = SharedMemoryAllReduce.open(ctx.topology, CHUNK)
    sums = [exchange.sum_(_contribution(ctx.rank, n, d)) for n, d in CASES]
    means = [exchange.average_(_contribution(ctx.rank, n, torch.float32)) for n in (10, 9_999)]
    # the first sum passed a barrier that rank 0 reaches after unlinking: nothing is left in /dev/shm
    return os.path.exists(exchange.path), sums, means


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sums_equal_the_rank_order_sum_bitwise_on_every_rank(world):
    results = spawn(_reduce_all_cases, world)
    for file_left, sums, means in results:
        assert not file_left
        for (numel, dtype), got in zip(CASES, sums):
            assert got.dtype == dtype
            assert torch.equal(got, _expected_sum(world, numel, dtype)), (world, numel, dtype)
        for numel, got in zip((10, 9_999), means):
            assert torch.equal(got, _expected_sum(world, numel, torch.float32) / world)


def _late_rank_1(ctx, use_futex):
    """Rank 1 comes 0.3 s late to each sum, until rank 0 has waited for it (sleeping on its counter, or
    polling) in three sums. On a loaded machine rank 0 may itself come late; such a sum tests nothing and
    is not counted. Each rank puts the moment it arrived (CLOCK_MONOTONIC, one clock for every process)
    in its own slot, so the sum tells both ranks both moments and they agree on when to stop."""
    exchange = SharedMemoryAllReduce.open(ctx.topology, CHUNK)
    exchange._use_futex = use_futex and exchange._use_futex
    exchange.timeout_s = 30.0  # a rank that nobody wakes sleeps until this runs out, then finds the peer
    latencies = []
    for round_ in range(20):
        if ctx.rank == 1:
            time.sleep(0.3)
        payload = torch.full((1002,), float(ctx.rank + round_), dtype=torch.float64)
        payload[:2] = 0.0
        payload[ctx.rank] = time.monotonic()
        got = exchange.sum_(payload)
        back = time.monotonic()
        assert torch.equal(got[2:], torch.full((1000,), float(1 + 2 * round_), dtype=torch.float64))
        came_0, came_1 = got[:2].tolist()
        if came_1 - came_0 > 0.1:  # rank 0 waited long enough to go to sleep
            latencies.append(back - came_1)  # on rank 0: from the late rank's arrival to its own return
        if len(latencies) == 3:
            break
    return exchange._use_futex, latencies


@pytest.mark.parametrize("use_futex", [True, False])
def test_a_waiting_rank_resumes_as_soon_as_the_late_one_arrives(use_futex):
    (used, latencies), _ = spawn(_late_rank_1, 2, use_futex)
    if use_futex:
        assert used, "futexes are available on x86-64 Linux, where shm runs"
    assert len(latencies) == 3, "rank 0 came first to fewer than 3 of 20 sums although rank 1 slept 0.3 s"
    # Woken by the late rank's arrival, not by the end of its 30 s sleep: load delays a wake-up by
    # milliseconds, far from 10 s, while a missing wake shows as about 30 s.
    assert all(latency < 10.0 for latency in latencies), latencies


def _open_while_rank_1_stays_away(ctx, away_s):
    """Rank 0's exchange, with a 1 s timeout; rank 1 maps it too, then sleeps ``away_s`` and gets None."""
    exchange = SharedMemoryAllReduce.open(ctx.topology, CHUNK)
    exchange.timeout_s = 1.0
    if ctx.rank == 1:
        time.sleep(away_s)
        return None
    return exchange


def _rank1_never_comes(ctx):
    if (exchange := _open_while_rank_1_stays_away(ctx, 4)) is None:
        return None
    started = time.monotonic()
    with pytest.raises(CommunicationError) as err:
        exchange.sum_(torch.ones(10))
    return str(err.value), time.monotonic() - started


def test_a_rank_that_never_arrives_is_named_after_the_timeout():
    message, waited = spawn(_rank1_never_comes, 2)[0]
    assert "rank(s) 1 did not reach" in message and "--timeout" in message
    # never before the 1 s timeout (the clock cannot run early); the upper bound only says the 1 s timeout
    # was used, not the process group's 120 s, with room for any load
    assert 1.0 <= waited < 60.0


def _plans(ctx):
    return gather_plan(ctx.topology, largest_bytes=1 << 20)


def test_workers_on_one_machine_agree_to_use_shared_memory():
    plans = spawn(_plans, 2)
    assert plans[0] == plans[1]
    assert plans[0].use and plans[0].chunk_bytes == 1 << 20


def _plan(**overrides):
    facts = dict(device_type="cpu", machine="x86_64", system="Linux", machine_ids=["a", "a"],
                 largest_bytes=4 << 20, free_bytes=1 << 30)
    return plan_shm(**{**facts, **overrides})


def test_plan_uses_shared_memory_only_where_it_applies():
    assert _plan().use and _plan().chunk_bytes == 4 << 20
    assert _plan(largest_bytes=100 << 20).chunk_bytes == 8 << 20  # bigger tensors go in several rounds
    assert "one process" in _plan(machine_ids=["a"]).reason
    assert "cuda" in _plan(device_type="cuda").reason
    assert "x86-64" in _plan(machine="aarch64").reason
    assert "x86-64" in _plan(system="Darwin").reason
    assert "2 machines" in _plan(machine_ids=["a", "b", "a"]).reason
    assert "not available" in _plan(free_bytes=None).reason


def test_a_small_dev_shm_shrinks_the_window_or_explains_the_fix():
    small = _plan(machine_ids=["a"] * 8, free_bytes=64 << 20, largest_bytes=100 << 20)
    assert small.use and region_bytes(8, small.chunk_bytes) <= 32 << 20
    full = _plan(free_bytes=1 << 20)
    assert not full.use and "--shm-size" in full.reason


def _in_background(ctx):
    exchange = SharedMemoryAllReduce.open(ctx.topology, CHUNK)
    inputs = [_contribution(ctx.rank, n, torch.float32) for n in (10_007, 3, 4096)]
    futures = [exchange.start_average(t) for t in inputs]  # queued at once, served in order
    results = [f.wait() for f in futures]
    assert all(r is t for r, t in zip(results, inputs))  # averaged in place
    return results


def test_background_averages_are_served_in_order_and_equal_the_mean():
    for results in spawn(_in_background, 2):
        for numel, got in zip((10_007, 3, 4096), results):
            assert torch.equal(got, _expected_sum(2, numel, torch.float32) / 2)


def _background_peer_never_comes(ctx):
    if (exchange := _open_while_rank_1_stays_away(ctx, 3)) is None:
        return None
    first, second = exchange.start_average(torch.ones(10)), exchange.start_average(torch.ones(10))
    errors = []
    for future in (first, second):
        with pytest.raises(CommunicationError) as err:
            future.wait()
        errors.append(str(err.value))
    return errors


def test_a_background_timeout_fails_this_and_every_later_future():
    first, second = spawn(_background_peer_never_comes, 2)[0]
    assert "rank(s) 1 did not reach" in first and second == first


def _open_in_missing_dir(ctx):
    import polytrain.distributed.shm as shm

    shm.SHM_DIR = "/nonexistent-shm"
    with pytest.raises(ConfigError) as err:
        SharedMemoryAllReduce.open(ctx.topology, CHUNK)
    return str(err.value)


def test_a_file_rank_0_cannot_create_fails_every_rank_at_once_with_the_reason():
    for message in spawn(_open_in_missing_dir, 2, timeout=60):
        assert "rank 0 cannot create" in message and "/nonexistent-shm" in message
        assert "--comm backend" in message
