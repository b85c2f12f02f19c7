"""Named axes: a strategy lays the world out as dp_replicate x dp_shard x pp x tp on a DeviceMesh; slices and
groups follow the axes, the batch axis dp being dp_replicate x dp_shard."""

import pytest
import torch

from polytrain.distributed.topology import Topology
from tests.helpers.spawn import spawn


def test_a_single_process_is_one_replica_on_every_axis():
    topo = Topology()
    assert [(topo.axis_size(a), topo.axis_rank(a)) for a in ("dp", "pp")] == [(1, 0), (1, 0)]
    assert topo.arranged(dp=1, pp=1).axes == (("dp_replicate", 1), ("pp", 1))  # dp: dp_replicate
    with pytest.raises(ValueError, match="hold 4 processes, but the world has 1"):
        topo.arranged(dp=2, pp=2)
    assert topo.arranged(tp=1, dp_replicate=1).axes == (("dp_replicate", 1), ("tp", 1))  # in mesh order, as named
    assert (topo.axis_size("tp"), topo.axis_rank("tp"), topo.axis_group("tp")) == (1, 0, None)
    with pytest.raises(ValueError, match="unknown axes \\['shard'\\]"):
        topo.arranged(shard=1)


def _axes(ctx):
    topo = ctx.topology.arranged(dp=2, pp=2)
    coords = (topo.axis_rank("dp"), topo.axis_rank("pp"))
    sums = {}
    for axis in ("dp", "pp"):
        along = topo.along(axis)
        value = torch.tensor([float(topo.rank)])
        along.all_reduce_sum(value)  # the ranks that differ from this one only along `axis`
        sums[axis] = (along.rank, along.world_size, value.item())
    hsdp = ctx.topology.arranged(dp_replicate=2, dp_shard=2)  # the batch axis: both, one group of the four
    batch = hsdp.along("dp")
    value = torch.tensor([float(topo.rank)])
    batch.all_reduce_sum(value)
    sums["hsdp"] = (hsdp.axis_rank("dp_replicate"), hsdp.axis_rank("dp_shard"), batch.rank, batch.world_size,
                    value.item(), hsdp.submesh("dp_replicate", "dp_shard").ndim, hsdp.submesh("pp", "dp_shard").ndim)
    return coords, sums


def test_dp_by_pp_gives_each_rank_its_coordinates_and_a_group_per_axis():
    results = spawn(_axes, 4)
    # mesh order dp, pp: rank = dp * 2 + pp
    assert [coords for coords, _ in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rank, (_, sums) in enumerate(results):
        dp, pp = divmod(rank, 2)
        assert sums["dp"] == (dp, 2, float(pp + (pp + 2)))  # ranks {pp, pp + 2}
        assert sums["pp"] == (pp, 2, float(2 * dp + (2 * dp + 1)))  # ranks {2dp, 2dp + 1}
        # HSDP's mesh: rank = replicate * 2 + shard; every rank its own slice; FSDP's mesh 2-D, the other 1-D
        assert sums["hsdp"] == (rank // 2, rank % 2, rank, 4, 6.0, 2, 1)


def _default_layout(ctx):
    from polytrain.strategies import get_strategy
    from polytrain.strategies.base import data_slice

    sync = get_strategy("sync")(ctx.topology)
    return data_slice(sync), sync.topology.axis_size("pp"), sync.topology.axis_group("dp") is ctx.topology.group


def test_sync_takes_its_slices_from_the_dp_axis_of_the_whole_world():
    results = spawn(_default_layout, 2)
    assert [(shard.index, shard.count) for shard, _, _ in results] == [(0, 2), (1, 2)]
    assert all(pp == 1 and same_group for _, pp, same_group in results)


def _gathered(ctx):
    topo = ctx.topology
    small = (topo.rank, 0.5 * topo.rank, None, {"key": [topo.rank] * 3})
    mixed = "x" * (5000 if topo.rank == 1 else 10)  # one rank's pickle over GATHER_BYTES: every rank falls back
    exact = b"y" * 1000
    return topo.all_gather_object(small), topo.all_gather_object(mixed), topo.all_gather_object(exact)


def test_all_gather_object_returns_every_ranks_object_small_or_past_the_one_collective_size():
    from polytrain.distributed.topology import GATHER_BYTES

    assert GATHER_BYTES < 5000
    for small, mixed, exact in spawn(_gathered, 3):
        assert small == [(r, 0.5 * r, None, {"key": [r] * 3}) for r in range(3)]
        assert mixed == ["x" * 10, "x" * 5000, "x" * 10]
        assert exact == [b"y" * 1000] * 3
