"""The memory plan of ``async``: a worker holds the whole model and its gradients, and buffers of the parameters'
size for the values it pulls, its optimizer never stepped; a parameter server holds its share of the
parameters (the partition ``async`` cuts), of the gradients and of the optimizer state, besides the model it was
built with (:mod:`polytrain.parallel.memory_plan`)."""

from __future__ import annotations

from dataclasses import replace

from polytrain.parallel.memory_count import Count, RankMemory


def ranks(count: Count) -> list[RankMemory]:
    from polytrain.strategies.ps.partition import PartitionPlan

    found = count.activations()
    act = found[0] if found else None
    servers = [rank for rank in range(count.layout.processes) if count.layout.role(rank) == "server"]
    params = [t for t in count.tensors if t.name in count.param_names]
    partition = PartitionPlan.build(((t.name, t.shape) for t in params), max(1, len(servers)))
    size = params[0].element_size if params else 4
    opt = count.optimizers[size]
    out = []
    for rank in range(count.layout.processes):
        if rank in servers:
            index = servers.index(rank)
            pieces, numel = partition.pieces_of(index), partition.numel(index)
            share = f"server {index}: {numel / max(1, partition.total):.0%} of the parameters"
            out.append(RankMemory(rank, "server", share, count.params(count.tensors) + numel * size, numel * size,
                                  sum(opt.bytes(p.numel) for p in pieces), None, data=count.data))
            continue
        r = count.rank(rank, "the whole model", count.tensors, act, extra=count.params(params),
                       extra_what="async: a worker's buffers for the values it pulls")
        out.append(replace(r, optimizer=count.state(count.tensors, stepped=False)))
    count.notes.append("async: a server's parameters include the whole model it was built with (besides its "
                       "share); a worker's optimizer is never stepped")
    return out
