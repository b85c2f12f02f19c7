"""Tensor parallel: ``--strategy tp`` (:mod:`.strategy`, registered when the registry first looks a name up) and
the ``--tp`` axis of ``pipeline``/``hybrid`` (:mod:`.axis`); plans in :mod:`.plan`."""
