"""Tensor parallel: ``--strategy tp`` and the ``--tp`` axis of ``pipeline``/``hybrid``; plans in :mod:`.plan`."""

from polytrain.parallel.tp import strategy  # noqa: F401  (registers tp)
