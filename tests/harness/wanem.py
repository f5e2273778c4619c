"""An emulated WAN between K hosts on one box: namespaces joined by a userspace TUN forwarder.

This kernel has no ``sch_netem`` (``tc qdisc ... netem``: "Specified qdisc kind is unknown",
no module to load; ../shared/reference/network.md), so delay, loss and a bounded queue
cannot come from ``tc``. Instead, as network.md describes: every host is a network namespace
whose only route to the others is a TUN device ``wan0``, and one forwarder process holds all
the TUN fds and moves each packet to its destination's TUN after the directed pair's delay,
at its rate, through its tail-drop queue and random loss. The TUN devices use
``IFF_VNET_HDR`` with TSO offloads, so the forwarder moves whole 64 KiB GSO packets.

The forwarder is C (``wanem_forwarder.c``, the link arithmetic in ``wanem_link.c``; their
header comments give the protocol): a Python one ran out of CPU beyond ~6 TCP streams at
1 Gbit/s, so the instrument became the bottleneck. ``forwarder_binary()`` compiles it with
``cc`` on first use into ``build/wanem/`` of this checkout, keyed by a hash of the sources
and flags. It gets the hosts and links as arguments (``--host NETNS DEV ADDR``, ``--link SRC
DST DELAY_MS RATE_MBIT LOSS QUEUE_MS``, ``--seed N``) and text commands on stdin (``stats``,
``set SRC DST DELAY_MS RATE_MBIT LOSS QUEUE_MS``), and answers each with one JSON line.

``wan(k, link, overrides=...)`` yields a ``Wan``: host i is namespace ``names[i]`` with
address ``addrs[i]`` = 198.18.0.{i+1}/24 on ``wan0`` (198.18.0.0/15 is the RFC 2544
benchmarking range, routed only between these namespaces; the same addresses as
``netns.hosts``). Every directed pair (i, j) gets ``link`` unless ``overrides[(i, j)]``
says otherwise, e.g. 4 fast hosts with one slow pair::

    slow = Link(delay_ms=25, rate_mbit=100)
    with wan(4, Link(delay_ms=25, rate_mbit=1000), overrides={(1, 2): slow, (2, 1): slow}) as w:
        p = w.popen(0, [sys.executable, "peer.py", w.addrs[1]])

``wan_pair(delay_ms, rate_mbit, loss, queue_ms)`` is the symmetric two-host case.
``Wan.popen``/``Wan.run`` mirror ``netns.Hosts`` (``NsProcess`` with JSON-line events);
``Wan.stats()`` reads the forwarder's per-link counters (drops by loss and by queue) and
its CPU time; ``Wan.set_link`` changes a pair's parameters while traffic flows.

IPv6 is disabled in the namespaces (no router solicitations on ``wan0``); ``tcp_wmem_max``/
``tcp_rmem_max`` lower the TCP autotuning limits inside them (the last field of
``net.ipv4.tcp_wmem``/``tcp_rmem``; ``net.core.*mem_max`` cannot be written in a child
namespace), e.g. to make one stream window-bound at a modest rate, and ``congestion`` picks
the congestion control (reno, bbr, cubic here); by default a namespace keeps the kernel's.

Names are ``pcclwan-<pid>-<seq>-<host>``. Teardown (a ``finally`` and ``atexit``): processes
from ``popen`` are SIGKILLed, the forwarder's stdin is closed (it exits, taking the TUN
devices with it; it also exits by itself when this process dies), then the namespaces are
deleted. Namespaces left by a run that was SIGKILLed (its pid is gone) are deleted by the
next run. Needs real root, ``/dev/net/tun`` and a C compiler; otherwise ``WanemUnavailable``
is raised, which the ``wan_hosts`` fixture (tests/conftest.py) turns into a skip with the
reason.
No pytest here: ``benchmarks/wan.py`` builds its links with this module too.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from harness import HARNESS, REPO
from harness.netns import NetnsUnavailable, NsProcess, delete_stale, ip, kill_and_delete
from harness.netns import unavailable_reason as _netns_unavailable_reason

SUBNET = "198.18.0"  # host i (0-based) is f"{SUBNET}.{i + 1}"/24 on DEV
DEV = "wan0"
SOURCES = [os.path.join(HARNESS, n)
           for n in ("wanem_forwarder.c", "wanem_link.c", "wanem_link.h")]
CFLAGS = ["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror"]
BUILD_DIR = os.path.join(REPO, "build", "wanem")
_PREFIX = "pcclwan"
_STALE = re.compile(rf"^{_PREFIX}-(\d+)-\d+-\d+$")
_IP_DEADLINE_S = 10.0
_COMPILE_DEADLINE_S = 120.0  # ~1 s alone; far more while the 2 cores compile other things
_READY_DEADLINE_S = 15.0  # the forwarder's start: setns and ioctls, on 2 busy cores
_REPLY_DEADLINE_S = 10.0
_STOP_DEADLINE_S = 5.0

_lock = threading.Lock()
_build_lock = threading.Lock()
_seq = itertools.count()
_live: set[Wan] = set()  # emulators made by this process and not yet closed


class WanemUnavailable(NetnsUnavailable):
    """The emulator cannot run here: not root, no ``ip``, no TUN, no C compiler, or the kernel
    refused."""


@dataclasses.dataclass(frozen=True)
class Link:
    """One direction of a host pair.

    Attributes:
        delay_ms: one-way delay in milliseconds (the RTT of a symmetric pair is twice this).
        rate_mbit: rate in Mbit/s (10^6 bit/s) of IP bytes; None: unlimited (no queue).
        loss: probability that an MSS-sized segment is lost, in [0, 1); a 64 KiB GSO packet
            is dropped whole, with the probability that any of its segments would be.
        queue_ms: tail-drop queue limit, in milliseconds of transmission at ``rate_mbit``
            (never less than two 64 KiB packets).
    """

    delay_ms: float = 0.0
    rate_mbit: float | None = None
    loss: float = 0.0
    queue_ms: float = 50.0

    def __post_init__(self):
        if not (self.delay_ms >= 0 and (self.rate_mbit is None or self.rate_mbit > 0)
                and 0 <= self.loss < 1 and self.queue_ms >= 0):
            raise ValueError(f"bad link {self}: need delay_ms >= 0, rate_mbit None or > 0, "
                             f"0 <= loss < 1, queue_ms >= 0")


def _link_args(link: Link) -> list[str]:
    """DELAY_MS RATE_MBIT LOSS QUEUE_MS as the forwarder reads them (rate 0: unlimited)."""
    return [repr(float(v)) for v in (link.delay_ms, link.rate_mbit or 0, link.loss,
                                     link.queue_ms)]


def forwarder_binary() -> str:
    """The path of the compiled forwarder, built on first use (and after any change to its
    sources or flags) into ``BUILD_DIR`` under a name keyed by their hash; the build goes to
    a temporary name that is renamed into place, so concurrent builders never see half a file.

    Raises:
        WanemUnavailable: no C compiler (``cc``, ``gcc`` or ``clang``) on PATH.
        RuntimeError: the compiler rejected the sources (its message included).
    """
    cc = next((p for p in map(shutil.which, ("cc", "gcc", "clang")) if p), None)
    if cc is None:
        raise WanemUnavailable("no C compiler (cc, gcc or clang) to build the forwarder; "
                               "apt-get install gcc")
    digest = hashlib.sha256("\0".join([cc, *CFLAGS]).encode())
    for path in SOURCES:
        with open(path, "rb") as f:
            digest.update(f.read())
    exe = os.path.join(BUILD_DIR, f"wanem_forwarder-{digest.hexdigest()[:16]}")
    with _build_lock:
        if os.access(exe, os.X_OK):
            return exe
        os.makedirs(BUILD_DIR, exist_ok=True)
        tmp = f"{exe}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            proc = subprocess.run([cc, *CFLAGS, "-o", tmp,
                                   *(p for p in SOURCES if p.endswith(".c")), "-lm"],
                                  capture_output=True, text=True, timeout=_COMPILE_DEADLINE_S)
            if proc.returncode != 0:
                raise RuntimeError(f"'{cc}' could not build the WAN forwarder:\n"
                                   f"{(proc.stdout + proc.stderr).strip()[-4000:]}")
            os.replace(tmp, exe)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return exe


def _wan_ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return ip(*args, check=check, error=WanemUnavailable)


def unavailable_reason() -> str | None:
    """Why the emulator cannot run here, or None when it probably can."""
    reason = _netns_unavailable_reason()
    if reason:
        return reason
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing (no TUN driver)"
    return None


@atexit.register
def _close_all() -> None:
    with _lock:
        wans = list(_live)
    for w in wans:
        w.close()


class _Forwarder:
    """The forwarder process: text commands on its stdin, JSON replies on its stdout."""

    def __init__(self, argv: list[str], stderr_path: str):
        self.stderr_path = stderr_path
        with open(stderr_path, "wb") as err:
            # Its stdin is a pipe only this process holds: when we close it or die, it exits.
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, start_new_session=True)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        self._buf = b""
        self._io = threading.Lock()  # one command and its reply at a time

    def describe(self) -> str:
        code = self.proc.poll()
        try:
            with open(self.stderr_path, "rb") as f:
                err = f.read().decode("utf-8", "replace")[-3000:]
        except OSError as e:
            err = f"<unreadable: {e}>"
        return (f"forwarder (pid {self.proc.pid}, "
                f"{'running' if code is None else f'exit code {code}'})\n--- stderr ---\n{err}")

    def read_event(self, deadline_s: float) -> dict:
        """The next JSON line within ``deadline_s``; raises RuntimeError at EOF or deadline."""
        end = time.monotonic() + deadline_s
        while b"\n" not in self._buf:
            left = end - time.monotonic()
            if left <= 0 or not self._sel.select(left):
                raise RuntimeError(f"no reply within {deadline_s} s from {self.describe()}")
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=2)
                raise RuntimeError(f"exited: {self.describe()}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def command(self, line: str) -> dict:
        """Sends one command line; its JSON reply. Raises RuntimeError when the forwarder
        refused it, died or did not answer within 10 s."""
        with self._io:
            self.proc.stdin.write((line + "\n").encode())
            self.proc.stdin.flush()
            rec = self.read_event(_REPLY_DEADLINE_S)
        if rec.get("event") == "error":
            raise RuntimeError(f"the forwarder refused {line!r}: {rec.get('error')}")
        return rec

    def stop(self) -> None:
        """Closes its stdin (it exits), SIGKILLs it after a bounded wait. Idempotent."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=_STOP_DEADLINE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=_STOP_DEADLINE_S)
        self._sel.close()
        self.proc.stdout.close()


class Wan:
    """k namespaces joined by the emulated links; build with ``wan(...)``.

    Attributes:
        k: number of hosts. names[i]: host i's namespace. addrs[i]: its IPv4 address.
        links: the ``Link`` of every directed pair (i, j), i != j.
    """

    def __init__(self, k: int, links: dict[tuple[int, int], Link], workdir: str, seed: int):
        self.k = k
        self.links = dict(links)
        self.workdir = workdir
        self.seed = seed
        tag = f"{_PREFIX}-{os.getpid()}-{next(_seq)}"
        self.names = [f"{tag}-{i}" for i in range(k)]
        self.addrs = [f"{SUBNET}.{i + 1}" for i in range(k)]
        self.procs: list[NsProcess] = []
        self._made: list[str] = []  # namespaces that exist, for close()
        self._fwd: _Forwarder | None = None

    def _sysctl(self, name: str, settings: dict[str, str]) -> None:
        # -e: a kernel without IPv6 has no net.ipv6 keys, and then nothing to disable.
        argv = ["ip", "netns", "exec", name, "sysctl", "-q", "-e", "-w",
                *[f"{k}={v}" for k, v in settings.items()]]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=_IP_DEADLINE_S)
        if proc.returncode != 0:
            raise WanemUnavailable(f"'{' '.join(argv)}' failed: {proc.stderr.strip()}")

    def _tcp_limits(self, name: str, wmem_max: int | None, rmem_max: int | None) -> dict:
        """``tcp_wmem``/``tcp_rmem`` with the max (bytes) replaced, the default kept <= it."""
        out = {}
        for key, cap in (("net.ipv4.tcp_wmem", wmem_max), ("net.ipv4.tcp_rmem", rmem_max)):
            if cap is None:
                continue
            cur = subprocess.run(["ip", "netns", "exec", name, "sysctl", "-n", key],
                                 capture_output=True, text=True, timeout=_IP_DEADLINE_S)
            if cur.returncode != 0:
                raise WanemUnavailable(f"cannot read {key} in {name}: {cur.stderr.strip()}")
            lo, default, _ = (int(x) for x in cur.stdout.split())
            out[key] = f"{min(lo, cap)} {min(default, cap)} {int(cap)}"
        return out

    def _create(self, tcp_wmem_max: int | None, tcp_rmem_max: int | None,
                congestion: str | None) -> None:
        settings = {"net.ipv6.conf.all.disable_ipv6": "1",
                    "net.ipv6.conf.default.disable_ipv6": "1"}
        if congestion:
            settings["net.ipv4.tcp_congestion_control"] = congestion
        for name in self.names:
            _wan_ip("netns", "add", name)
            self._made.append(name)
            _wan_ip("-n", name, "link", "set", "lo", "up")
            if tcp_wmem_max is not None or tcp_rmem_max is not None:
                settings.update(self._tcp_limits(name, tcp_wmem_max, tcp_rmem_max))
            self._sysctl(name, settings)
        argv = [forwarder_binary(), "--seed", str(self.seed)]
        for name, addr in zip(self.names, self.addrs):
            argv += ["--host", f"/run/netns/{name}", DEV, addr]
        for (s, d), ln in sorted(self.links.items()):
            argv += ["--link", str(s), str(d), *_link_args(ln)]
        self._fwd = _Forwarder(argv, os.path.join(self.workdir, "forwarder.stderr"))
        ev = self._fwd.read_event(_READY_DEADLINE_S)
        if ev.get("event") == "unavailable":
            raise WanemUnavailable(f"the forwarder cannot open TUN devices: {ev['error']}")
        if ev.get("event") != "ready":
            raise RuntimeError(f"forwarder said {ev} instead of ready: {self._fwd.describe()}")
        # The forwarder created wan0 in every namespace; addresses go on once it exists.
        for name, addr in zip(self.names, self.addrs):
            _wan_ip("-n", name, "addr", "add", f"{addr}/24", "dev", DEV)
            _wan_ip("-n", name, "link", "set", DEV, "up")

    def popen(self, i: int, argv: list[str], env: dict[str, str] | None = None,
              label: str | None = None, stdin: bool = False) -> NsProcess:
        """Starts ``argv`` in host i's namespace (as ``netns.Hosts.popen``; ``stdin``: see
        ``NsProcess``); SIGKILLed at teardown if still running."""
        label = label or f"host {i} ({self.addrs[i]})"
        stderr_path = os.path.join(self.workdir, f"host{i}-{len(self.procs)}.stderr")
        p = NsProcess(["ip", "netns", "exec", self.names[i], *argv],
                      env if env is not None else dict(os.environ), stderr_path, label, stdin)
        self.procs.append(p)
        return p

    def run(self, i: int, argv: list[str], deadline_s: float, **kw) -> subprocess.CompletedProcess:
        """Runs ``argv`` in host i's namespace to completion; killed at ``deadline_s`` (s)."""
        return subprocess.run(["ip", "netns", "exec", self.names[i], *argv], capture_output=True,
                              text=True, timeout=deadline_s, **kw)

    def stats(self) -> dict:
        """The forwarder's counters: ``links[(i, j)]`` holds pkts_in/out, bytes_in/out (wire
        bytes), drop_loss, drop_queue, max_queue_bytes, in_flight; also ``cpu_s`` (its CPU
        seconds so far), ``wall_s``, ``unroutable`` and ``write_errors``.

        Raises:
            RuntimeError: the forwarder did not answer within 10 s (or has died).
        """
        rec = self._fwd.command("stats")
        rec["links"] = {(ln.pop("src"), ln.pop("dst")): ln for ln in rec["links"]}
        return rec

    def set_link(self, i: int, j: int, link: Link) -> None:
        """Gives the pair i -> j new parameters from now on (packets in flight keep theirs).

        Raises:
            ValueError: no such pair. RuntimeError: the forwarder refused them or died.
        """
        if (i, j) not in self.links:
            raise ValueError(f"no link {i} -> {j} among {self.k} hosts")
        self._fwd.command(" ".join(["set", str(i), str(j), *_link_args(link)]))
        self.links[(i, j)] = link

    def forwarder_pid(self) -> int:
        return self._fwd.proc.pid

    def check_connectivity(self, deadline_s: float = 20.0) -> None:
        """Asserts every host reaches every other over TCP (a refused connect proves the path;
        each one costs a round trip)."""
        code = ("import socket, sys\n"
                "for a in sys.argv[1:]:\n"
                "    s = socket.socket(); s.settimeout(10)\n"
                "    try: s.connect((a, 9))\n"
                "    except ConnectionRefusedError: pass\n"
                "    else: sys.exit(f'unexpected listener on {a}:9')\n"
                "    finally: s.close()\n")
        for i in range(self.k):
            others = [a for j, a in enumerate(self.addrs) if j != i]
            proc = self.run(i, [sys.executable, "-c", code, *others], deadline_s)
            assert proc.returncode == 0, (f"host {i} ({self.addrs[i]}) cannot reach {others}: "
                                          f"{proc.stderr.strip()[-2000:]}")

    def close(self) -> None:
        """Kills the hosts' processes, stops the forwarder, deletes the namespaces. Idempotent."""
        procs, self.procs = self.procs, []
        for p in procs:
            p.close()
        fwd, self._fwd = self._fwd, None
        if fwd is not None:
            fwd.stop()
        made, self._made = self._made, []
        for name in made:
            kill_and_delete(name)
        with _lock:
            _live.discard(self)


def _matrix(k: int, link: Link, overrides: dict[tuple[int, int], Link] | None
            ) -> dict[tuple[int, int], Link]:
    links = {(i, j): link for i in range(k) for j in range(k) if i != j}
    for (i, j), ln in (overrides or {}).items():
        if (i, j) not in links:
            raise ValueError(f"override for {i} -> {j}: not a pair of distinct hosts < {k}")
        links[(i, j)] = ln
    return links


@contextlib.contextmanager
def wan(k: int, link: Link = Link(), *, overrides: dict[tuple[int, int], Link] | None = None,
        seed: int = 0, tcp_wmem_max: int | None = None, tcp_rmem_max: int | None = None,
        congestion: str | None = None, workdir: str | None = None):
    """Yields a ``Wan`` of k hosts, every directed pair on ``link`` except ``overrides``;
    always torn down on exit.

    Args:
        k: number of hosts (>= 2).
        link: the default ``Link`` of every directed pair.
        overrides: ``{(i, j): Link}`` for the pairs that differ (one direction each).
        seed: seeds the loss of every link (each direction has its own generator); a
            signed 64-bit integer.
        tcp_wmem_max, tcp_rmem_max: TCP autotuning limits (bytes) in every namespace; None
            keeps the kernel's (4 MiB and 32 MiB here).
        congestion: ``net.ipv4.tcp_congestion_control`` in every namespace; None keeps it.
        workdir: where stderr files go; a temporary folder by default.

    Raises:
        WanemUnavailable: not root, no ``ip``, no ``/dev/net/tun``, no C compiler, or the
            kernel refused.
        RuntimeError: the forwarder did not build or start (the message says why).
        ValueError: a bad ``Link`` or override.
    """
    if k < 2:
        raise ValueError(f"need at least 2 hosts, not {k}")
    links = _matrix(k, link, overrides)
    reason = unavailable_reason()
    if reason:
        raise WanemUnavailable(reason)
    forwarder_binary()  # before any namespace exists: a build failure leaves nothing behind
    delete_stale(_STALE)
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="pccl-wanem-"))
        w = Wan(k, links, workdir, seed)
        with _lock:
            _live.add(w)
        stack.callback(w.close)
        w._create(tcp_wmem_max, tcp_rmem_max, congestion)
        yield w


def wan_pair(delay_ms: float, rate_mbit: float | None = None, loss: float = 0.0,
             queue_ms: float = 50.0, **kw):
    """``wan(2, ...)`` with the same ``Link(delay_ms, rate_mbit, loss, queue_ms)`` both ways
    (RTT = 2 x delay_ms); ``kw`` as for ``wan``."""
    return wan(2, Link(delay_ms, rate_mbit, loss, queue_ms), **kw)
