"""What a group connects for one epoch, and the connecting: ``EpochConfig``, ``connect_epoch_lanes``.

A group formed through a master changes its world between steps: the master hands
every member an assignment (rank, world size, the communicator id and every rank's
data-plane address) and each member's ``ProcessGroupPCCL`` builds and connects its own
communicator for it (``ProcessGroupPCCL.create`` for the first epoch,
``ProcessGroupPCCL.configure`` for the next ones), as torchft's ``ProcessGroup.configure``
does from its Manager's quorum. The layer above says what to connect; this module
knows how.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..core.communicator import Communicator
from ..core.listener import Listener
from ..errors import PcclError


@dataclass(frozen=True)
class EpochConfig:
    """Where and as whom a group connects for one epoch (a master's assignment).

    Attributes:
        rank: this process's rank in the epoch (0 .. world_size - 1).
        world_size: the epoch's number of ranks.
        comm_id: the epoch's communicator id (0 .. 2**64 - 1), the same on every rank.
        addrs: every rank's data-plane address (``host:port``), by rank.
        listener: the data-plane ``Listener`` the communicator accepts its links on (one
            per process, shared by every epoch).
        connect_timeout_s: deadline of connecting every link, seconds.
        streams: TCP streams per peer and lane (None: chosen from the addresses, see
            ``Communicator.connect``).
    """

    rank: int
    world_size: int
    comm_id: int
    addrs: Sequence[str]
    listener: Listener
    connect_timeout_s: float
    streams: int | None = None


def connect_epoch_lanes(cfg: EpochConfig, op_timeout_s: float, lanes: int,
                        on_created: Callable[[Communicator], None] | None = None
                        ) -> Communicator:
    """A connected communicator (with ``lanes`` lanes) for the epoch ``cfg`` describes.

    Args:
        cfg: the epoch.
        op_timeout_s: the communicator's default op deadline, seconds.
        lanes: connections per peer (``Communicator.connect``).
        on_created: called with the communicator before it connects (the layer above
            watches it: a member the master drops then aborts the connect).

    Raises:
        PcclError subclasses of creating or connecting, with ``unreached_ranks`` set to
        the ranks some link to or from which did not come up; the communicator is closed.
    """
    comm = Communicator(cfg.rank, cfg.world_size, cfg.comm_id, None, op_timeout_s,
                        listener=cfg.listener)
    try:
        if on_created is not None:
            on_created(comm)
        comm.connect(list(cfg.addrs), timeout_s=cfg.connect_timeout_s, lanes=lanes,
                     streams=cfg.streams)
        return comm
    except PcclError as exc:
        try:
            exc.unreached_ranks = tuple(comm.unreached_ranks())
        except PcclError:
            pass        # closed under us (an abort): nobody is known to be unreachable
        comm.close()
        raise
    except BaseException:
        comm.close()
        raise


__all__ = ["EpochConfig", "connect_epoch_lanes"]
