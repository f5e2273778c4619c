"""Which membership owns which group: the elastic layer's map from a ``ProcessGroupPCCL``
formed through a master to its ``Membership``.

c10d, below this layer, holds no elastic object (docs/architecture.md): the group factory
this layer registers with c10d (``rendezvous.master_group``) ``attach``-es each group it
builds to its membership here, and registers the group's close hook, through which a
group that shuts down (``destroy_process_group``) or aborts leaves its master.
"""

from __future__ import annotations

import threading
import weakref
from typing import NamedTuple

from ..c10d.process_group import ProcessGroupPCCL, pccl_group
from ..errors import InvalidUsageError
from .membership import Membership

_lock = threading.Lock()
_owners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # group -> its Membership


class ElasticGroup(NamedTuple):
    """A group formed through a master, and its membership.

    Attributes:
        pg: the c10d group's ``ProcessGroupPCCL``.
        membership: the ``Membership`` that owns its epochs.
    """

    pg: ProcessGroupPCCL
    membership: Membership


def attach(pg: ProcessGroupPCCL, membership: Membership) -> None:
    """Makes ``membership`` the owner of ``pg``'s epochs, until ``pg`` shuts down or aborts
    (then the membership leaves the master and closes its listener)."""
    with _lock:
        _owners[pg] = membership

    def closed() -> None:
        with _lock:
            _owners.pop(pg, None)
        membership.close(leave=True)

    pg.on_close(closed)


def membership_of(pg: ProcessGroupPCCL) -> Membership | None:
    """The membership that owns ``pg``, or None (a fixed group, or one shut down)."""
    with _lock:
        return _owners.get(pg)


def elastic_group(group=None) -> ElasticGroup:
    """The ``ProcessGroupPCCL`` behind ``group`` (None: the default group), formed through a
    master, with its membership.

    Raises:
        InvalidUsageError: not a pccl group, or not formed through a master
            (``init_method="pccl://..."`` or a fixed world with its automatic
            master), or shut down.
    """
    pg = pccl_group(group)
    membership = membership_of(pg)
    if membership is None:
        raise InvalidUsageError("this group was not formed through a master "
                                "(use init_method='pccl://host:port'), or it was shut down")
    return ElasticGroup(pg, membership)


__all__ = ["ElasticGroup", "attach", "elastic_group", "membership_of"]
