"""``pipeline`` and ``hybrid`` strategies (:mod:`.strategy`), their schedules as data (:mod:`.plan`) and
the model's split into stages (:mod:`.split`)."""

from polytrain.parallel.pp import strategy  # noqa: F401  (registers pipeline and hybrid)
