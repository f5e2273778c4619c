"""How a group connects its links: streams per peer, the stripe, pacing, and the warm-up.

The policy half of ``Communicator.connect``, kept apart from the native calls that carry it
out. Every decision is a function of the group's addresses, its shape (world size, lanes)
and the settings (``config``) alone, so every rank decides alike: the handshake refuses a
peer that connected another number of streams.

- Streams: a group on one host (every address a loopback one) keeps one stream per peer,
  where striping only adds work; between hosts it stripes over ``config.DEFAULT_STREAMS``
  (``auto_streams``), enough to fill a long fat link that one TCP window cannot.
- Pacing: ``PCCL_PACING`` (``config.pacing``), except that measured pacing is off on one
  host (loopback has no path queue to keep, nothing to warm).
- The stripe: a group that picks its streams itself, paced, between hosts, connects the
  most it may stripe over (``stripe_ceiling``) and stripes over ``auto_streams`` of them
  until the rate controller of each path has measured it (native/src/rate.hpp).
- The warm-up (``core.warmup``): run by ``connect`` for a striped, paced group of more
  than one rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .. import config
from ..errors import InvalidArgumentError
from .address import is_loopback
from .native import MAX_STREAMS


@dataclass(frozen=True)
class StreamPlan:
    """What ``Communicator.connect`` sets up, equal on every rank of the group.

    Attributes:
        connected: TCP streams to connect to each peer, per lane (the native ``streams``
            option).
        stripe: how many of them each op is striped over at first; less than ``connected``
            only when the group picks its stripe (``picks_stripe``).
        pacing: the native ``pacing`` option: 0 off, > 0 a pinned cap in bytes per second,
            -1 measured.
        warm: whether ``connect`` warms the lanes up (``Communicator.warm_up``).
    """

    connected: int
    stripe: int
    pacing: int
    warm: bool

    @property
    def picks_stripe(self) -> bool:
        """Whether the group stripes over fewer streams than it connects (then the rate
        controller of each path picks the stripe from what it measures)."""
        return self.connected != self.stripe


def plan_streams(addrs: Sequence[str], world_size: int, lanes: int,
                 streams: int | None) -> StreamPlan:
    """The streams, stripe, pacing and warm-up of a group of ``world_size`` ranks at
    ``addrs`` (``"host:port"``, one per rank) with ``lanes`` lanes, asked for ``streams``
    streams per peer (None: ``auto_streams(addrs)``, and the group picks its stripe).

    Raises:
        InvalidArgumentError: ``streams`` is not an int in 1 .. MAX_STREAMS.
        ValueError: a malformed ``PCCL_PACING``.
    """
    chosen = streams is None
    if chosen:
        streams = auto_streams(addrs)
    if not isinstance(streams, int) or not 1 <= streams <= MAX_STREAMS:
        raise InvalidArgumentError(f"streams {streams!r} is not an int in 1 .. {MAX_STREAMS}")
    pacing = config.pacing()
    if pacing < 0 and _one_host(addrs):
        pacing = 0              # loopback has no path queue to keep, nothing to warm
    paced_between_hosts = streams > 1 and pacing != 0 and world_size > 1
    # Chosen streams on a paced group: connect the most the warm-up may pick, stripe
    # over the default until it has measured the path.
    connected = streams
    if chosen and paced_between_hosts:
        connected = max(streams, stripe_ceiling(world_size, lanes))
    return StreamPlan(connected=connected, stripe=streams, pacing=pacing,
                      warm=paced_between_hosts)


def auto_streams(addrs: Sequence[str]) -> int:
    """The streams per peer a group uses when none is configured: 1 when every address is a
    loopback one (all ranks on this host, where striping only adds work), else
    ``config.DEFAULT_STREAMS`` (4), enough to fill a long fat link that one TCP window
    cannot. A function of the addresses alone, so every rank computes the same count.
    """
    return 1 if _one_host(addrs) else config.DEFAULT_STREAMS


def stripe_ceiling(world_size: int, lanes: int) -> int:
    """The streams per peer and lane a group connects when it picks its stripe itself:
    ``config.STRIPE_MAX``, fewer in a large group so that a rank keeps at most
    ``config.STRIPE_SOCKETS`` data connections, never fewer than ``config.DEFAULT_STREAMS``.
    A function of the group's shape alone, so every rank computes the same count."""
    per_stream = max(1, lanes * (world_size - 1))
    return max(config.DEFAULT_STREAMS, min(config.STRIPE_MAX, config.STRIPE_SOCKETS // per_stream))


def _one_host(addrs: Sequence[str]) -> bool:
    """Whether every address is a loopback one (a host name is not provably local)."""
    try:
        return all(is_loopback(a) for a in addrs)
    except ValueError:
        return False
