"""``pipeline`` and ``hybrid`` strategies (:mod:`.strategy`, registered when the registry first looks a name up),
their schedules as data (:mod:`.plan`) and the model's split into stages (:mod:`.split`)."""
