"""How an ``--on-failure continue`` worker's session is built (:mod:`polytrain.train.elastic` runs it): a
replacement's from the layout of the generation it joins (:func:`before_build`), and the workers' again over the
survivors when a member is lost during the job's start-up (:func:`build_session`)."""

from __future__ import annotations

import copy
import os
import time
from dataclasses import replace
from typing import Any, Callable

from polytrain.distributed.elastic import Membership
from polytrain.train.elastic import lost_peer
from polytrain.train.faults import KILL_ENV
from polytrain.train.on_failure import continuing, expendable, members_layout


def build_session(config: Any, layout: Any, membership: Membership | None,
                  build: Callable[[Any, Any], Any]) -> Any:
    """``build(layout, None)`` (the session, over the launch's topology), and under ``--on-failure continue``
    ``build(layout, topology)`` again over the survivors when a member is lost during the start-up: every member
    builds from the start (the same initial values, or ``--resume``'s checkpoint), so nothing is handed over;
    :class:`ElasticRun` records the change."""
    members = None
    while True:
        try:
            return build(layout, members)
        except Exception as exc:
            if membership is None or not continuing(config) or not lost_peer(exc) \
                    or membership.slot in membership.generation.joined:  # (a replacement's state comes from peers)
                raise
            exc.__traceback__ = None  # its frames hold the old group's objects
            started, before = time.perf_counter(), membership.generation
            membership.change(0, admit=False)
            layout = _members(config, layout, membership)
            membership.start_up_change = (before, started)
            members = membership.topology()


def before_build(config: Any, layout: Any, membership: Membership | None) -> tuple[Any, Any]:
    """What a replacement builds its session from: the layout of the generation it joins (the global batch still
    cut as at launch for the checks; the trainer re-cuts it over the members), and no ``--resume``: its state
    comes from a peer, not from disk."""
    if membership is None or not membership.generation.number:
        return config, layout
    os.environ.pop(KILL_ENV, None)  # the testing hook's kill was the replaced worker's, not its replacement's
    layout = _members(config, layout, membership)
    if config.checkpoint.resume:
        config = copy.deepcopy(config)
        config.checkpoint.resume = False
    return config, layout


def _members(config: Any, layout: Any, membership: Membership) -> Any:
    """The layout of the membership's current generation, every rank expendable (the global batch still cut as at
    launch, ``layout``'s slices, for the checks; the trainer re-cuts it over the members)."""
    from polytrain.strategies import get_strategy
    from polytrain.strategies.registry import strategy_class
    from polytrain.train.session import strategy_options

    cls = strategy_class(config, layout) if layout is not None else get_strategy(config.train.strategy)
    members = members_layout(cls, len(membership.generation.slots), membership.launched, strategy_options(config, cls))
    return expendable(replace(members, slices=layout.slices) if layout is not None else members)
