"""Network namespaces as hosts: K "machines" on one box, for multi-host tests (root only).

``hosts(k)`` creates k namespaces, each with one interface ``eth0`` at
198.18.0.{1..k}/24 (198.18.0.0/15 is the RFC 2544 benchmarking range; it is
only ever routed between the namespaces created here), all plugged into a
bridge ``br0`` that lives in one extra namespace. Every namespace also gets its
own ``lo`` up, so 127.0.0.1 in one host is not 127.0.0.1 in another: an address
that wrongly assumes loopback fails to connect instead of passing by accident.

Names are ``pcclns-<pid>-<seq>-<host>`` (and ``...-br``), unique per run.
Everything is torn down in a ``finally`` and again by ``atexit``; processes
started through ``Hosts.popen`` are SIGKILLed first. Namespaces left by a run
that was itself SIGKILLed (its pid is gone) are deleted by the next run.

``Hosts.popen(i, argv)`` runs ``ip netns exec NAME argv...`` (which execs, so the
child's pid is the command's own) in a new session; ``NsProcess`` reads its
stdout JSON lines and waits for it, every wait bounded by a deadline.
"""

from __future__ import annotations

import atexit
import contextlib
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
from collections.abc import Callable


SUBNET = "198.18.0"  # host i (0-based) is f"{SUBNET}.{i + 1}"/24
_PREFIX = "pcclns"
_STALE = re.compile(rf"^{_PREFIX}-(\d+)-\d+-(?:\d+|br)$")
_IP_DEADLINE_S = 10.0

_lock = threading.Lock()
_seq = itertools.count()
_live: set[str] = set()  # namespaces created by this process and not yet deleted


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be created here (not root, no ``ip``, or the kernel refused)."""


def unavailable_reason() -> str | None:
    """Why namespaces cannot be used here, or None when they probably can."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "network namespaces need root (euid 0)"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    return None


def ip(*args: str, check: bool = True,
       error: type[Exception] = NetnsUnavailable) -> subprocess.CompletedProcess:
    """Runs ``ip ARGS`` (bounded); with ``check``, a failure raises ``error`` with its stderr."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_DEADLINE_S)
    if check and proc.returncode != 0:
        raise error(f"'ip {' '.join(args)}' failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def kill_and_delete(name: str) -> None:
    """Kills what still runs in namespace ``name`` (by pid) and deletes it; never raises."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        for pid in ip("netns", "pids", name, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        ip("netns", "delete", name, check=False)


def delete_stale(pattern: re.Pattern, delete: Callable[[str], None] = kill_and_delete) -> None:
    """Deletes the namespaces whose name matches ``pattern`` (group 1: the creator's pid)
    and whose creator no longer runs: leftovers of a killed run."""
    with contextlib.suppress(OSError):
        for name in os.listdir("/run/netns"):
            m = pattern.match(name)
            if not m or int(m.group(1)) == os.getpid():
                continue
            try:
                os.kill(int(m.group(1)), 0)
            except ProcessLookupError:
                delete(name)
            except PermissionError:
                pass


def _delete(name: str) -> None:
    kill_and_delete(name)
    with _lock:
        _live.discard(name)


@atexit.register
def _delete_all() -> None:
    with _lock:
        names = sorted(_live)
    for name in names:
        _delete(name)


class NsProcess:
    """A command running in a namespace: JSON lines on stdout, stderr to a file; with
    ``stdin=True`` the driver may ``send`` it lines (e.g. "go on" after changing a link)."""

    def __init__(self, argv: list[str], env: dict[str, str], stderr_path: str, label: str,
                 stdin: bool = False):
        self.label = label
        self.stderr_path = stderr_path
        self._buf = b""
        self.lines: list[str] = []  # every stdout line seen so far
        with open(stderr_path, "wb") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=err, env=env,
                                         start_new_session=True)
        self.pid = self.proc.pid
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        self._eof = False

    def send(self, line: str) -> None:
        """Writes ``line`` and a newline to the process's stdin (``stdin=True`` only)."""
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def stderr_tail(self, chars: int = 3000) -> str:
        try:
            with open(self.stderr_path, "rb") as f:
                return f.read().decode("utf-8", "replace")[-chars:]
        except OSError as e:
            return f"<stderr unreadable: {e}>"

    def describe(self) -> str:
        code = self.proc.poll()
        state = "running" if code is None else f"exit code {code}"
        return (f"{self.label} (pid {self.pid}, {state})\n--- stdout ---\n"
                + "\n".join(self.lines[-20:]) + f"\n--- stderr (tail) ---\n{self.stderr_tail()}")

    def _read_line(self, end: float) -> str | None:
        """The next stdout line before monotonic time ``end``; None at EOF; raises after ``end``."""
        while b"\n" not in self._buf:
            if self._eof:
                if self._buf:
                    line, self._buf = self._buf, b""
                    break
                return None
            left = end - time.monotonic()
            if left <= 0 or not self._sel.select(left):
                raise AssertionError(f"deadline passed waiting for output of {self.describe()}")
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                self._eof = True
            self._buf += chunk
        else:
            line, self._buf = self._buf.split(b"\n", 1)
        text = line.decode("utf-8", "replace")
        self.lines.append(text)
        return text

    def next_event(self, deadline_s: float, event: str) -> dict:
        """Waits up to ``deadline_s`` for the stdout JSON line ``{"event": event, ...}``."""
        end = time.monotonic() + deadline_s
        while True:
            line = self._read_line(end)
            if line is None:
                self.proc.wait(timeout=max(0.1, end - time.monotonic()))
                raise AssertionError(f"no {event!r} event before exit from {self.describe()}")
            if line.startswith("{"):
                rec = json.loads(line)
                if rec.get("event") == event:
                    return rec

    def finish(self, deadline_s: float, event: str = "result") -> dict:
        """The ``event`` record, then the exit (code 0 expected), all within ``deadline_s``."""
        end = time.monotonic() + deadline_s
        rec = self.next_event(deadline_s, event)
        try:
            code = self.proc.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"did not exit after its {event!r}: {self.describe()}") from None
        assert code == 0, f"exit code {code}: {self.describe()}"
        return rec

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signals the process (by pid; its session too for SIGKILL) unless it has exited."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)
                if sig == signal.SIGKILL:
                    os.killpg(self.pid, sig)

    def close(self) -> None:
        self.kill(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._sel.close()
        self.proc.stdout.close()
        if self.proc.stdin:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()


class Hosts:
    """k namespaces on one bridge; ``addrs[i]`` is host i's address. Build with ``hosts(k)``."""

    def __init__(self, k: int, workdir: str):
        self.k = k
        self.workdir = workdir
        tag = f"{_PREFIX}-{os.getpid()}-{next(_seq)}"
        self.names = [f"{tag}-{i}" for i in range(k)]
        self.bridge = f"{tag}-br"
        self.addrs = [f"{SUBNET}.{i + 1}" for i in range(k)]
        self.procs: list[NsProcess] = []

    def _create(self) -> None:
        for name in [self.bridge, *self.names]:
            ip("netns", "add", name)  # NetnsUnavailable if the kernel refuses
            with _lock:
                _live.add(name)
        br = self.bridge
        ip("-n", br, "link", "add", "br0", "type", "bridge")
        ip("-n", br, "link", "set", "br0", "up")
        for i, (name, addr) in enumerate(zip(self.names, self.addrs)):
            # Created directly inside the namespaces: no name can clash in the root namespace.
            ip("link", "add", "eth0", "netns", name, "type", "veth", "peer", "name", f"h{i}",
                "netns", br)
            ip("-n", br, "link", "set", f"h{i}", "master", "br0")
            ip("-n", br, "link", "set", f"h{i}", "up")
            ip("-n", name, "addr", "add", f"{addr}/24", "dev", "eth0")
            ip("-n", name, "link", "set", "lo", "up")
            ip("-n", name, "link", "set", "eth0", "up")

    def check_connectivity(self, deadline_s: float = 20.0) -> None:
        """Asserts every host reaches every other one over TCP (a refused connect proves it)."""
        code = ("import socket, sys\n"
                "for a in sys.argv[1:]:\n"
                "    s = socket.socket(); s.settimeout(5)\n"
                "    try: s.connect((a, 9))\n"
                "    except ConnectionRefusedError: pass\n"
                "    else: sys.exit(f'unexpected listener on {a}:9')\n"
                "    finally: s.close()\n")
        for i in range(self.k):
            others = [a for j, a in enumerate(self.addrs) if j != i]
            argv = ["ip", "netns", "exec", self.names[i], sys.executable, "-c", code, *others]
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=deadline_s)
            assert proc.returncode == 0, (f"host {i} ({self.addrs[i]}) cannot reach {others}: "
                                          f"{proc.stderr.strip()[-2000:]}")

    def popen(self, i: int, argv: list[str], env: dict[str, str] | None = None,
              label: str | None = None) -> NsProcess:
        """Starts ``argv`` in host i's namespace; it is SIGKILLed at teardown if still running."""
        label = label or f"host {i} ({self.addrs[i]})"
        stderr_path = os.path.join(self.workdir, f"host{i}-{len(self.procs)}.stderr")
        p = NsProcess(["ip", "netns", "exec", self.names[i], *argv],
                      env if env is not None else dict(os.environ), stderr_path, label)
        self.procs.append(p)
        return p

    def run(self, i: int, argv: list[str], deadline_s: float, **kw) -> subprocess.CompletedProcess:
        """Runs ``argv`` in host i's namespace to completion; killed at ``deadline_s``."""
        return subprocess.run(["ip", "netns", "exec", self.names[i], *argv], capture_output=True,
                              text=True, timeout=deadline_s, **kw)

    def close(self) -> None:
        """Kills every process started here, then deletes the namespaces. Idempotent."""
        procs, self.procs = self.procs, []
        for p in procs:
            p.close()
        for name in [*self.names, self.bridge]:
            _delete(name)


@contextlib.contextmanager
def hosts(k: int, workdir: str | None = None):
    """Yields a ``Hosts`` of k connected namespaces; always torn down on exit.

    Raises:
        NetnsUnavailable: not root, no ``ip``, or a namespace/link could not be made.
    """
    reason = unavailable_reason()
    if reason:
        raise NetnsUnavailable(reason)
    delete_stale(_STALE, _delete)
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="pccl-netns-"))
        h = Hosts(k, workdir)
        stack.callback(h.close)
        h._create()
        yield h
