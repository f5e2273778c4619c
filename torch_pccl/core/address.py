"""Addresses: ``host:port`` text both ways, and the address this process advertises.

Formatting and parsing (IPv6 hosts in brackets) live in ``torch_pccl.control.address``,
which the master's protocol shares without importing core; they are re-exported here
for the data plane and the c10d store bootstrap. Standard library only.
"""

from __future__ import annotations

import ipaddress
import socket

from .. import config
from ..control.address import format_address, is_loopback, parse_address

__all__ = ["advertised_host", "format_address", "is_loopback", "parse_address", "root_store",
           "store_host"]


def root_store(store):
    """The store under every ``PrefixStore`` of ``store`` (the run's TCPStore); duck-typed
    (``underlying_store``) so that this module does not import torch."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


def store_host(store) -> str | None:
    """The host of the TCPStore under ``store`` (PrefixStores unwrapped), else None.

    ``init_method="tcp://host:port"`` sets no ``MASTER_ADDR``; its store knows
    the host. Duck-typed (``underlying_store``, ``host``) so that this module
    does not import torch.
    """
    host = getattr(root_store(store), "host", None)
    return host if isinstance(host, str) and host else None


def advertised_host(store=None, target: str | None = None) -> str:
    """Returns the numeric address this rank listens on and advertises to its peers.

    In order: env ``PCCL_HOST`` (resolved to a numeric address); 127.0.0.1 when
    the rendezvous host (``target`` if given, e.g. the master of a
    ``pccl://`` group, else env ``MASTER_ADDR``, else the host of the TCPStore
    under ``store``) is unknown or a loopback address; otherwise the address of
    the interface that routes to the rendezvous host, found with a UDP socket
    ``connect()`` + ``getsockname()`` (no packet is sent).

    Raises:
        OSError: the host cannot be resolved or there is no route to it.
    """
    env = config.host()
    if env:
        return socket.getaddrinfo(env, None, type=socket.SOCK_STREAM)[0][4][0]
    master = target or config.rendezvous_host() or store_host(store)
    if not master:
        return "127.0.0.1"
    try:
        # A numeric host needs no resolver: a device mesh asks this once per group.
        numeric = ipaddress.ip_address(master)
    except ValueError:
        family, _, _, _, sockaddr = socket.getaddrinfo(master, 1, type=socket.SOCK_DGRAM)[0]
        numeric = ipaddress.ip_address(sockaddr[0].split("%")[0])
    else:
        family = socket.AF_INET if numeric.version == 4 else socket.AF_INET6
        sockaddr = (master, 1) if numeric.version == 4 else (master, 1, 0, 0)
    if numeric.is_loopback:
        return "127.0.0.1"
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return probe.getsockname()[0]
