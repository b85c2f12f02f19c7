"""``pipeline`` and ``hybrid`` strategies (:mod:`.strategy`, imported where a run with one is built; their settings
and declared classes in :mod:`.config`), their schedules as data (:mod:`.plan`), the model's split into stages
(:mod:`.split`), a rank's stages' state (:mod:`.state`) and what the stages' replicas do together
(:mod:`.replicas`)."""
