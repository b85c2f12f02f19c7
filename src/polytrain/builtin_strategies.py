"""Where each of polytrain's own strategies lives: a plain table, imported without torch.

The registry (:mod:`polytrain.strategies.registry`) imports a strategy's module when its name is first looked
up; the command's first moment (:mod:`polytrain.distributed.prestart`) reads the table before anything imports
torch."""

#: the strategy a run gets without ``--strategy``
DEFAULT_STRATEGY = "sync"

#: polytrain's own strategies: the module that registers each, imported when its name is first looked up (not
#: by the package's ``__init__``: the strategies import each other's helpers, and importing one first must not
#: meet another half imported; and a run of ``sync`` need not import pipelining, DTensor and the tracer)
BUILTIN_STRATEGIES = {
    "single": "polytrain.strategies.single",
    "sync": "polytrain.strategies.sync",
    "local-sgd": "polytrain.strategies.periodic",
    "diloco": "polytrain.strategies.periodic",
    "pipeline": "polytrain.parallel.pp.strategy",
    "hybrid": "polytrain.parallel.pp.strategy",
    "fsdp": "polytrain.parallel.fsdp",
    "tp": "polytrain.parallel.tp.strategy",
    "async": "polytrain.strategies.ps.strategy",
}
