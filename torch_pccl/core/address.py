"""Addresses: ``host:port`` text both ways, and the address this process advertises.

The one place addresses are formatted and parsed (IPv6 hosts in brackets), for
the data plane, the c10d store bootstrap and the master's protocol alike.
Standard library only: the master uses it without torch.
"""

from __future__ import annotations

import ipaddress
import socket

from .. import config


def format_address(host: str, port: int) -> str:
    """``"host:port"``, or ``"[host]:port"`` for an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(addr: str) -> tuple[str, int]:
    """Splits ``"host:port"`` or ``"[v6host]:port"`` into ``(host, port)``.

    Raises:
        ValueError: not that shape, an empty host, an IPv6 host without
            brackets, or a port outside 1 .. 65535.
    """
    host, sep, port = addr.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"address {addr!r}: write IPv6 hosts as [host]:port")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"address {addr!r} is not host:port with a port in 1 .. 65535")
    return host, int(port)


def is_loopback(addr: str) -> bool:
    """Whether ``"host:port"`` names a loopback address (127.0.0.0/8, ::1) of this host.

    Raises:
        ValueError: ``addr`` is not ``host:port`` with a numeric host.
    """
    return ipaddress.ip_address(parse_address(addr)[0].split("%")[0]).is_loopback


def store_host(store) -> str | None:
    """The host of the TCPStore under ``store`` (PrefixStores unwrapped), else None.

    ``init_method="tcp://host:port"`` sets no ``MASTER_ADDR``; its store knows
    the host. Duck-typed (``underlying_store``, ``host``) so that this module
    does not import torch.
    """
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    host = getattr(store, "host", None)
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
    family, _, _, _, sockaddr = socket.getaddrinfo(master, 1, type=socket.SOCK_DGRAM)[0]
    if ipaddress.ip_address(sockaddr[0].split("%")[0]).is_loopback:
        return "127.0.0.1"
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return probe.getsockname()[0]
