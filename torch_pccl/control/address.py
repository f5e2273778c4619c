"""``host:port`` text both ways (IPv6 hosts in brackets), pure: no socket, no settings.

The one place addresses are formatted and parsed, for the data plane, the c10d store
bootstrap and the master's protocol alike. ``core.address`` re-exports these names
beside the address this process advertises (which needs sockets and settings).
"""

from __future__ import annotations

import functools
import ipaddress


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


@functools.lru_cache(maxsize=4096)
def is_loopback(addr: str) -> bool:
    """Whether ``"host:port"`` names a loopback address (127.0.0.0/8, ::1) of this host.

    Cached: a device mesh asks it of every address of each of its groups (a pure function
    of the text, so a cached answer is the answer).

    Raises:
        ValueError: ``addr`` is not ``host:port`` with a numeric host.
    """
    return ipaddress.ip_address(parse_address(addr)[0].split("%")[0]).is_loopback
