"""Every setting of torch_pccl in one place: environment variable, default, parsing.

Like NCCL's and gloo's environment variables, each setting is read here and
nowhere else, parsed strictly (junk is a ``ValueError`` naming the variable,
never a silent default) and listed in ``SETTINGS``, from which the README's
"Configuration" table is checked. Settings are read when a group is created,
so a script may set them with ``os.environ`` before ``init_process_group``.

The defaults that are not environment variables (the master's timers, the
deadlines of membership calls, the quantization block) live here too, so that
the master CLI, the master, the client and the API agree on them.

This module imports only the standard library: the master (which runs without
torch or the native extension) reads its defaults here.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from datetime import timedelta

# -- defaults that are not environment variables --------------------------------------

BACKEND_NAME = "pccl"
"""The c10d backend's name (``init_process_group(backend="pccl")``), the ``pccl://``
rendezvous scheme and the prefix of the profiler's events."""

DEFAULT_LANES = 4
"""Lanes of a new group (``PCCL_LANES``): TCP connections per peer, collectives in flight."""
DEFAULT_STREAMS = 4
"""TCP streams per peer and lane that one collective is striped over between hosts, when
``PCCL_STREAMS`` is unset (a group whose ranks are all on this host uses one): the fewest a
paced group stripes over before its rate controller has measured the path, and the fewest
it picks from then on (``STRIPE_MAX``; native/src/rate.hpp).

Four fill a 1 Gbit/s, 100 ms link about as well as sixteen, 2.4x one stream (whose window
caps it; ../shared/reference/network.md); on loopback they cost up to ~10 % at world 4
(``benchmarks/wan.py``, ``benchmarks/allreduce.py``; docs/performance.md)."""

STRIPE_MAX = 12
"""The most streams per peer and lane a group stripes over when it picks the count itself
(``PCCL_STREAMS`` unset, between hosts, paced): it connects this many, and each op's sender
deals over what its path's rate controller picks (native/src/rate.hpp). With Linux's default
send buffer (``tcp_wmem`` max 4 MiB) one stream carries ~3 MB per round trip, so 1 Gbit/s
at 250 ms (31 MB in flight) needs about twelve."""
STRIPE_SOCKETS = 192
"""The data connections one rank may hold for a picked stripe, all lanes and peers: it
bounds ``STRIPE_MAX`` in a large group (file descriptors)."""

HEARTBEAT_INTERVAL_S = 1.0
"""Seconds between a peer's heartbeats to the master (the master tells its peers);
``PCCL_HEARTBEAT_INTERVAL`` overrides it."""
HEARTBEAT_TIMEOUT_S = 10.0
"""The master drops a peer silent for longer than this, in seconds, and tells the other
members at once, which abort the collectives waiting on it (``PCCL_HEARTBEAT_TIMEOUT``
overrides it). Ten missed heartbeats: over a lossy long link TCP's retransmission backoff
(0.2, 0.4, 0.8, 1.6, 3.2 s) can hold a heartbeat back ~6 s without the peer being gone,
and a stopped peer still frees the others in ~10 s, not at their op deadline."""
ROUND_TIMEOUT_S = 30.0
"""The master drops members missing from an update or sync round after this, in seconds."""
HANDSHAKE_TIMEOUT_S = 5.0
"""A connection to the master must send its hello within this, in seconds."""

CONNECT_TIMEOUT_S = 30.0
"""Default deadline for connecting a new epoch's communicator (``PCCL_CONNECT_TIMEOUT``): a
member that cannot be reached within it is reported to the master, which drops it if it was
newly admitted, and the others connect again without it."""

RECONNECT_BACKOFF_S = (0.1, 1.0)
"""Seconds between a member's attempts to reach a master that went away: the first wait,
doubling up to the last. Capped at 1 s so that a restarted master hears from every live
member within about a second (plus the connection's round trips)."""

MASTER_RECONNECT_S = 600.0
"""How long a member that lost its master keeps training and reconnecting to it, in seconds
(``PCCL_MASTER_RECONNECT``): long enough for a supervisor or an operator to restart
``pccl-master``; membership changes wait meanwhile."""

def resume_grace_s(heartbeat_timeout_s: float) -> float:
    """The default resume grace window of ``pccl-master`` (seconds): how long a master that
    starts without a record of the run holds joiners before forming a group from them.

    A member that a live master still counts as alive (silent for up to the heartbeat
    timeout) and that reconnects with the longest backoff re-registers within the heartbeat
    timeout plus ``RECONNECT_BACKOFF_S[1]``; waiting that long means no member of an earlier
    group is left out for being slow. 11 s with the defaults.
    """
    return float(heartbeat_timeout_s) + RECONNECT_BACKOFF_S[1]


UPDATE_TIMEOUT_S = 60.0
"""Default deadline of ``update_topology`` and of a shared-state vote, in seconds: longer
than ``ROUND_TIMEOUT_S``, after which the master drops the members that never came."""
QUORUM_TIMEOUT_S = 600.0
"""Longest wait of a DiLoCo member that is ready for a quorum round for the master to close
it, in seconds: the round waits for ``min_peers`` members' inner steps (as an exchange
waits for the slowest peer's) and rides out a master restart (``MASTER_RECONNECT_S``)."""
QUERY_TIMEOUT_S = 10.0
"""Default deadline of the master round trip in ``peers_pending``, in seconds."""
MASTER_CONNECT_TIMEOUT_S = 60.0
"""Longest wait for the master's welcome when registering, in seconds."""

QUANT_BLOCK = 256
"""Default elements per float32 scale of the quantized all-reduce (1 .. PCCL_MAX_QUANT_BLOCK)."""

# -- tuning constants (each read by one module; kept here so that every knob has one home) ---

MASTER_SEND_TIMEOUT_S = 5.0
"""Bound on one blocking send from a peer to its master, in seconds: a master that takes no
bytes for this long is treated as gone (``MasterClient``)."""
STOPPED_MASTER_QUIET_S = 5.0
"""A member whose master said it is stopping logs nothing above INFO for this long, in
seconds (a torchrun job's end, a quick restart); then it warns that the master is not back."""
MASTER_ATTEMPT_S = 5.0
"""Bound on one attempt to reconnect to a master that went away, in seconds (the waits
between attempts are ``RECONNECT_BACKOFF_S``)."""
CONNECT_ATTEMPTS = 3
"""Epochs ``Membership.connect`` (elastic/membership.py) tries after the first before
``update_topology`` gives up (each drops the joiners nobody could reach)."""
PROBE_BYTES = 2 << 20
"""Bytes each peer sends each other peer per probe exchange to time their link in
``optimize_topology``; at 100 Mbit/s, 0.17 s."""
PROBE_EXCHANGES = 8
"""The most probe exchanges per pair in ``optimize_topology``: a pair exchanges its probe
until its rate stops growing (at least 4 times; ring/measure.py says why), the fastest
exchange times the link."""
MIN_GAIN = 1.2
"""A new ring must be this much faster at its slowest hop to replace the current one: on
links of one speed the measurements differ by noise alone, and reordering for noise would
only change the floating-point summation order from run to run."""
PIECE_BYTES = 4 << 20
"""Largest piece of a shared-state transfer, in bytes: small enough that a receiver's
entries spread over every source, large enough that per-message costs vanish."""


# -- environment variables ---------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One environment variable: its name, its default as documented, and what it does."""

    name: str
    default: str
    help: str


TIMEOUT = Setting("PCCL_TIMEOUT", "the group's timeout (c10d: 30 min)",
                  "Deadline of every collective, in seconds (a positive float). Overrides "
                  "`init_process_group(timeout=...)`.")
LANES = Setting("PCCL_LANES", str(DEFAULT_LANES),
                "Lanes per group: TCP connections to every peer, each running one collective "
                "at a time (an int in 1 .. 64; 1 runs the group's ops one after the other). "
                "Equal on every rank.")
LAZY_CONNECT = Setting("PCCL_LAZY_CONNECT", "1",
                       "A subgroup (`new_group`, a device mesh's groups) publishes its address "
                       "and returns; it connects in the background and its first op waits for "
                       "that, so a rank forms its next group meanwhile (NCCL's default; "
                       "`TORCH_GLOO_LAZY_INIT` for gloo). When it needs no warm-up (all ranks "
                       "on one host, for one) it opens lanes 1.. with the first op that runs "
                       "on one. A failed connect is raised by the "
                       "group's ops. `0`/`false`/`no`/`off` connects every group (all its "
                       "lanes) before `new_group` returns. The default group always connects "
                       "at once.")
STREAMS = Setting("PCCL_STREAMS",
                  f"between hosts, paced: picked from the path's bandwidth-delay product, "
                  f"{DEFAULT_STREAMS} .. {STRIPE_MAX}; else {DEFAULT_STREAMS}; 1 when every rank "
                  f"is on this host",
                  "TCP streams per peer and lane that every collective is striped over (an int "
                  "in 1 .. 64): one TCP stream moves at most its window per round trip (about "
                  "270 Mbit/s at 100 ms with default buffers), so long fat links need several. "
                  "Unset between hosts, a group connects up to the most and each op's sender "
                  "deals over as many as its path's rate controller picks: what the measured "
                  "rate times round trip needs, then more only where more carried more. Set, it "
                  "is pinned; equal on every rank.")
PACING = Setting("PCCL_PACING", "`auto`",
                 "Cap on what the striped streams to one peer send together, so that they do "
                 "not overrun the path's queue together: `auto` measures each peer's path "
                 "(a short warm-up when the group forms, at most 64 MiB per rank, then during "
                 "every operation; kept per peer address across groups) and caps at 1.25x "
                 "that rate; a rate in Mbit/s per peer pins the cap; `off` neither "
                 "paces nor warms up. Only groups with more than one stream are paced, so a "
                 "group on one host never is.")
LINK_TIMEOUT = Setting(
    "PCCL_LINK_TIMEOUT", "30",
    "Seconds a data-plane link may go without the peer's kernel acknowledging anything "
    "while data or a keepalive probe is out (TCP_USER_TIMEOUT): a path that silently drops "
    "everything then fails the op with `PeerLostError` instead of at its deadline (a number "
    "in 1 .. 3600). A peer that is only slow to read is not affected.")
CONNECT_TIMEOUT = Setting(
    "PCCL_CONNECT_TIMEOUT", f"{CONNECT_TIMEOUT_S:g}",
    "Seconds a group formed through a master waits for a new epoch's connections (a positive "
    "number; at most the op deadline). A newly admitted peer that cannot be reached in time "
    "is dropped and the members connect again without it.")
MASTER_RECONNECT = Setting(
    "PCCL_MASTER_RECONNECT", f"{MASTER_RECONNECT_S:g}",
    "Seconds a member that lost its master keeps training and reconnecting to the same "
    "address (a positive number): collectives go on, membership changes wait, and a "
    "restarted master takes the group back from its members' re-registrations "
    "(docs/membership.md). After it, the next membership call raises `PeerLostError`.")
HEARTBEAT_INTERVAL = Setting(
    "PCCL_HEARTBEAT_INTERVAL", f"{HEARTBEAT_INTERVAL_S:g}",
    "Seconds between a peer's heartbeats to its master (a positive number), set where the "
    "master runs (`pccl-master`, or rank 0 of a fixed world); the master tells its peers.")
HEARTBEAT_TIMEOUT = Setting(
    "PCCL_HEARTBEAT_TIMEOUT", f"{HEARTBEAT_TIMEOUT_S:g}",
    "Seconds of silence after which the master drops a peer and the other members abort "
    "the collectives that wait on it with `PeerLostError` (a number above the interval), "
    "set where the master runs.")
MASTER = Setting("PCCL_MASTER", "1",
                 "Start a membership master in rank 0 for a fixed world (torchrun, env://, "
                 "tcp://), so `update_topology` and heartbeats work there: `1`/`true`/`yes`/"
                 "`on` or `0`/`false`/`no`/`off`.")
STATUS_PORT = Setting("PCCL_STATUS_PORT", "unset",
                      "Port of the status page, `/api/status` and `/metrics` of the master "
                      "that rank 0 starts for a fixed world (`pccl-master --http-port` for a "
                      "master of its own; docs/status-page.md), on loopback (0: a free port, "
                      "logged). Unset: no page.")
HOST = Setting("PCCL_HOST", "the interface that routes to the rendezvous host",
               "Address this process listens on and advertises to its peers (a host name or "
               "a numeric address).")
PEER_ID = Setting("PCCL_PEER_ID", "`hostname-pid-random`",
                  "This process's id at the master of a `pccl://` group (1-64 printable "
                  "characters); `?peer_id=` in the URL takes precedence.")
SECRET = Setting("PCCL_SECRET", "unset",
                 "Shared secret of the run (at least 16 characters; set the same on every peer "
                 "and the master): every connection to the master and between peers proves it "
                 "with an HMAC-SHA256 challenge-response before anything else flows, and a "
                 "stranger is refused (docs/security.md). Unset: no authentication.")
SECRET_FILE = Setting("PCCL_SECRET_FILE", "unset",
                      "A file holding the shared secret (its first line), so it stays out of "
                      "the environment and `ps`; used when `PCCL_SECRET` is unset.")
ENCRYPT = Setting("PCCL_ENCRYPT", "1 (when a secret is set)",
                  "With a secret, encrypt and authenticate every byte after the handshake: "
                  "data links (AES-256-GCM records, keys from HKDF-SHA256 over the secret and "
                  "both sides' fresh nonces) and the connection to the master "
                  "(docs/security.md). `0`/`false`/`no`/`off` sends in the clear (the secret "
                  "still authenticates); an encrypting peer refuses such a peer's data links "
                  "and the master warns. Without a secret, links are plain whatever this says.")
MASTER_ADDR = Setting("MASTER_ADDR", "unset",
                      "torch's rendezvous host (set by torchrun); read only to choose the "
                      "interface to advertise when `PCCL_HOST` is unset.")
RESTART_COUNT = Setting("TORCHELASTIC_RESTART_COUNT", "unset",
                        "torchrun's count of the job's restarts (set by torchrun); read only to "
                        "key pccl's entries in the c10d store per attempt, so that a restarted "
                        "job never reads the dead attempt's master address.")

SETTINGS: tuple[Setting, ...] = (TIMEOUT, LANES, LAZY_CONNECT, STREAMS, PACING, LINK_TIMEOUT, CONNECT_TIMEOUT,
                                 MASTER_RECONNECT, HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT, MASTER,
                                 STATUS_PORT, HOST, PEER_ID,
                                 SECRET, SECRET_FILE, ENCRYPT, MASTER_ADDR, RESTART_COUNT)
"""Every environment variable torch_pccl reads, in the README's order."""

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _raw(setting: Setting) -> str | None:
    # Unset and empty are the same: "not configured".
    value = os.environ.get(setting.name, "").strip()
    return value or None


def timeout_s(default_s: float) -> float:
    """The per-op deadline of a new group, seconds: ``PCCL_TIMEOUT`` if set, else ``default_s``.

    Raises:
        ValueError: ``PCCL_TIMEOUT`` is not a positive number of seconds.
    """
    return _seconds(TIMEOUT, default_s)


def lanes(max_lanes: int) -> int:
    """The lane count of a new group: ``PCCL_LANES`` if set, else ``DEFAULT_LANES`` (4).

    Args:
        max_lanes: the native limit, ``lib.PCCL_MAX_LANES`` (passed in so that
            this module loads without the native extension).

    Raises:
        ValueError: ``PCCL_LANES`` is not an int in 1 .. ``max_lanes``.
    """
    return _count(LANES, DEFAULT_LANES, max_lanes)


def streams(max_streams: int) -> int | None:
    """The streams per peer and lane of a new group: ``PCCL_STREAMS`` if set, else None.

    None lets the group choose from its addresses (``core.communicator.auto_streams``:
    ``DEFAULT_STREAMS`` between hosts, 1 on one host); every rank sees the same addresses,
    so every rank chooses the same.

    Args:
        max_streams: the native limit, ``lib.PCCL_MAX_STREAMS``.

    Raises:
        ValueError: ``PCCL_STREAMS`` is not an int in 1 .. ``max_streams``.
    """
    return _count(STREAMS, None, max_streams)


def pacing() -> int:
    """The native ``"pacing"`` option of a new group from ``PCCL_PACING``: -1 (``auto``,
    also when unset: measured per peer), 0 (``off``), or a pinned cap in bytes per second
    per peer (the variable gives Mbit/s, 10^6 bit/s).

    Raises:
        ValueError: ``PCCL_PACING`` is none of ``auto``, ``off`` or a positive number.
    """
    value = _raw(PACING)
    if value is None or value.lower() == "auto":
        return -1
    if value.lower() in _FALSE:
        return 0
    try:
        mbit = float(value)
    except ValueError:
        mbit = float("nan")
    if not 0 < mbit <= 8e6:
        raise ValueError(f"{PACING.name}={value!r} must be 'auto', 'off' or Mbit/s in "
                         "(0, 8e6]")
    return max(1, int(mbit * 1e6 / 8))


def link_timeout_ms() -> int:
    """The native ``link_timeout_ms`` of a new communicator: ``PCCL_LINK_TIMEOUT`` seconds
    (1 .. 3600), else 30 s.

    Raises:
        ValueError: not a number of seconds in 1 .. 3600.
    """
    seconds = _seconds(LINK_TIMEOUT, 30.0)
    if not 1 <= seconds <= 3600:
        raise ValueError(f"{LINK_TIMEOUT.name}={seconds:g} must be 1 .. 3600 seconds")
    return int(seconds * 1000)


def connect_timeout_s() -> float:
    """Deadline for connecting a new epoch: ``PCCL_CONNECT_TIMEOUT``, else ``CONNECT_TIMEOUT_S``.

    Raises:
        ValueError: not a positive number of seconds.
    """
    return _seconds(CONNECT_TIMEOUT, CONNECT_TIMEOUT_S)


def master_reconnect_s() -> float:
    """How long a member reconnects to a lost master: ``PCCL_MASTER_RECONNECT``, else
    ``MASTER_RECONNECT_S``.

    Raises:
        ValueError: not a positive number of seconds.
    """
    return _seconds(MASTER_RECONNECT, MASTER_RECONNECT_S)


def heartbeat_interval_s() -> float:
    """Seconds between heartbeats: ``PCCL_HEARTBEAT_INTERVAL``, else ``HEARTBEAT_INTERVAL_S``.

    Raises:
        ValueError: not a positive number of seconds.
    """
    return _seconds(HEARTBEAT_INTERVAL, HEARTBEAT_INTERVAL_S)


def heartbeat_timeout_s() -> float:
    """Silence after which the master drops a peer: ``PCCL_HEARTBEAT_TIMEOUT``, else
    ``HEARTBEAT_TIMEOUT_S`` (seconds; the master checks it exceeds the interval).

    Raises:
        ValueError: not a positive number of seconds.
    """
    return _seconds(HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_S)


def _seconds(setting: Setting, default: float) -> float:
    value = _raw(setting)
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < math.inf:
        raise ValueError(f"{setting.name}={value!r} must be a positive number of seconds")
    return seconds


def _count(setting: Setting, default: int | None, limit: int) -> int | None:
    value = _raw(setting)
    if value is None:
        return default
    try:
        count = int(value)
    except ValueError:
        count = 0
    if not 1 <= count <= limit:
        raise ValueError(f"{setting.name}={value!r} must be an int in 1 .. {limit}")
    return count


def status_port() -> int | None:
    """``PCCL_STATUS_PORT``: the status page port of a fixed world's master, or None (unset).

    Raises:
        ValueError: not an int in 0 .. 65535.
    """
    value = _raw(STATUS_PORT)
    if value is None:
        return None
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ValueError(f"{STATUS_PORT.name}={value!r} must be a port number in 0 .. 65535")
    return port


def master_enabled() -> bool:
    """Whether a fixed world's default group starts a master in rank 0 (``PCCL_MASTER``, on).

    Raises:
        ValueError: ``PCCL_MASTER`` is not one of 1/true/yes/on/0/false/no/off
            (any case).
    """
    return _flag(MASTER, True)


def _flag(setting: Setting, default: bool) -> bool:
    value = _raw(setting)
    if value is None:
        return default
    lowered = value.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"{setting.name}={value!r} must be one of "
                     f"{'/'.join(_TRUE)} (on) or {'/'.join(_FALSE)} (off)")


def encrypt() -> bool:
    """Whether this process encrypts its links when the run has a secret (``PCCL_ENCRYPT``,
    on). Without a secret nothing is encrypted, whatever this returns.

    Raises:
        ValueError: ``PCCL_ENCRYPT`` is not one of 1/true/yes/on/0/false/no/off (any case).
    """
    return _flag(ENCRYPT, True)


def lazy_connect() -> bool:
    """Whether a subgroup connects in the background (``PCCL_LAZY_CONNECT``, on;
    c10d/pending_connect.py).

    Raises:
        ValueError: ``PCCL_LAZY_CONNECT`` is not one of 1/true/yes/on/0/false/no/off (any case).
    """
    return _flag(LAZY_CONNECT, True)


def host() -> str | None:
    """``PCCL_HOST``: the address to listen on and advertise, or None when unset."""
    return _raw(HOST)


def peer_id() -> str | None:
    """``PCCL_PEER_ID``: this process's id at the master, or None when unset."""
    return _raw(PEER_ID)


MIN_SECRET_CHARS = 16
MAX_SECRET_BYTES = 4096


def secret() -> bytes | None:
    """The run's shared secret as UTF-8 bytes: ``PCCL_SECRET``, else the first line of the
    file ``PCCL_SECRET_FILE`` names (surrounding whitespace stripped), else None (no
    authentication). Read at each call, so a process may set it before creating a group.

    Raises:
        ValueError: the secret is shorter than ``MIN_SECRET_CHARS`` characters or longer
            than ``MAX_SECRET_BYTES`` bytes, or the file cannot be read (the message names
            the variable, never the secret).
    """
    value = _raw(SECRET)
    source = SECRET.name
    if value is None:
        path = _raw(SECRET_FILE)
        if path is None:
            return None
        return read_secret_file(path, SECRET_FILE.name)
    return checked_secret(value, source)


def read_secret_file(path: str, source: str = "the secret file") -> bytes:
    """The secret in the first line of the file at ``path`` (whitespace stripped), checked
    as ``secret()`` checks it.

    Raises:
        ValueError: the file cannot be read, or its secret is too short or too long.
    """
    try:
        with open(path, encoding="utf-8") as f:
            value = f.readline(MAX_SECRET_BYTES + 2)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{source}: cannot read the secret file {path!r}: {e}") from None
    return checked_secret(value.strip(), f"{source} ({path})")


def checked_secret(value: str, source: str) -> bytes:
    """``value`` as UTF-8 bytes after the length checks of ``secret()``.

    Raises:
        ValueError: shorter than ``MIN_SECRET_CHARS`` or longer than ``MAX_SECRET_BYTES``.
    """
    data = value.encode("utf-8")
    # A short secret can be guessed offline from one recorded handshake.
    if len(value) < MIN_SECRET_CHARS or len(data) > MAX_SECRET_BYTES:
        raise ValueError(f"{source}: the shared secret must be {MIN_SECRET_CHARS} characters "
                         f"to {MAX_SECRET_BYTES} bytes long, got {len(value)} characters")
    return data


def rendezvous_host() -> str | None:
    """torch's ``MASTER_ADDR`` (the rendezvous host), or None when unset."""
    return _raw(MASTER_ADDR)


def torchelastic_attempt() -> str | None:
    """torchrun's ``TORCHELASTIC_RESTART_COUNT`` (which restart of the job this process
    belongs to), or None outside torchrun."""
    return _raw(RESTART_COUNT)


# -- durations ---------------------------------------------------------------------------


def as_seconds(duration: float | timedelta) -> float:
    """A duration given as seconds or a ``timedelta``, as float seconds (not checked)."""
    return duration.total_seconds() if isinstance(duration, timedelta) else float(duration)


def to_seconds(timeout: float | timedelta | None, default: float | None = None) -> float:
    """A deadline given as seconds or a ``timedelta``, as positive float seconds.

    The one check used by every call that takes a ``timeout``; None gives ``default``.

    Raises:
        ValueError: ``timeout`` is not positive, or None without a default.
        TypeError: ``timeout`` is neither a number nor a ``timedelta``.
    """
    if timeout is None:
        if default is None:
            raise ValueError("a timeout is required")
        return float(default)
    seconds = as_seconds(timeout)
    if not seconds > 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    return seconds
