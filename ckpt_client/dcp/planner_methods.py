"""Whether a DCP save planner's methods are ``DefaultSavePlanner``'s own.

The shortcuts of :mod:`ckpt_client.dcp.fast_plan` and :mod:`ckpt_client.dcp.plan_reuse`
reproduce the default planner's methods; a planner that replaces one (in a subclass, or
by setting it on the instance) must have it called. This module owns that test.
"""

from __future__ import annotations

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner

#: Every method of the default planner: one set on an instance may edit what it is handed.
METHODS = frozenset(name for name in dir(DefaultSavePlanner)
                    if callable(getattr(DefaultSavePlanner, name)))


def keeps_default_methods(planner: SavePlanner, names: tuple) -> bool:
    """Whether ``planner`` is a ``DefaultSavePlanner`` whose ``names`` are its own, neither
    overridden by its class nor set on the instance (``planner.transform_object = f``)."""
    kind, own = type(planner), getattr(planner, "__dict__", {})
    return (isinstance(planner, DefaultSavePlanner)
            and all(getattr(kind, name) is getattr(DefaultSavePlanner, name)
                    and name not in own for name in names))


def is_stock(planner: SavePlanner) -> bool:
    """``planner`` is exactly ``DefaultSavePlanner``, no method set on the instance."""
    return type(planner) is DefaultSavePlanner and not METHODS & vars(planner).keys()
