"""The test side of a worker process driven by JSON lines: commands go to its stdin,
events come back on its stdout. Every wait is bounded; stderr goes to a file that
failure messages quote."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from harness import REPO


class WorkerProcess:
    """One worker process; ``send`` a command, ``recv`` its answer with a deadline."""

    def __init__(self, name, argv, env, stderr_path):
        self.name = name
        self.stderr_path = stderr_path
        with open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, text=True, env=env)
        self.lines = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))
        self.lines.put(None)

    def stderr(self):
        return self.stderr_path.read_text()[-4000:]

    def recv(self, timeout_s, event):
        """The next event, which must be ``event`` and carry no exception.

        Raises:
            AssertionError: nothing within ``timeout_s`` seconds (a hang), the worker
                exited, another event came, or the command raised.
        """
        try:
            msg = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"{self.name}: no {event!r} within {timeout_s} s (hang?)\n"
                                 f"{self.stderr()}") from None
        assert msg is not None, f"{self.name} exited before {event!r}:\n{self.stderr()}"
        assert msg["event"] == event, f"{self.name}: expected {event!r}, got {msg}"
        assert "exception" not in msg, (
            f"{self.name}: {event} raised {msg['exception']['type']}: "
            f"{msg['exception']['traceback']}")
        return msg

    def idle(self):
        """True if the worker has said nothing since its last answer (e.g. still pending)."""
        return self.lines.empty()

    def send(self, cmd, **kw):
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()

    def kill(self, sig=signal.SIGKILL):
        self.proc.send_signal(sig)
        if sig == signal.SIGKILL:
            self.proc.wait(30)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


class StandbyPeer(WorkerProcess):
    """An elastic peer: ``python WORKER MASTER_ADDR JOIN_TIMEOUT_S`` (a script built on
    tests/harness/elastic_worker.py's ``standby_then_serve``) that says "started" and waits as a
    standby until ``join``; ``op_timeout_s`` becomes its PCCL_TIMEOUT, ``name`` its peer id.
    ``start_s`` bounds its start (importing torch), ``step_s`` a command by default."""

    def __init__(self, worker, master_addr, tmp_path, name, op_timeout_s, join_timeout_s,
                 start_s, step_s):
        env = dict(os.environ, PCCL_TIMEOUT=str(op_timeout_s), PCCL_PEER_ID=name,
                   OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH"))
                                              if p))
        super().__init__(name, [sys.executable, worker, master_addr, str(join_timeout_s)], env,
                         tmp_path / f"{name}.stderr")
        self.start_s, self.join_timeout_s, self.step_s = start_s, join_timeout_s, step_s
        self.started = False
        self.pid = None
        self.rank = None

    def join(self):
        """Registers with the master (after the worker's start, waited for here)."""
        if not self.started:
            self.pid = self.recv(self.start_s, "started")["pid"]
            self.started = True
        self.send("join")

    def ready(self):
        """Waits until the master admitted the peer; its rank."""
        self.rank = self.recv(self.start_s + self.join_timeout_s, "ready")["rank"]
        return self.rank

    def call(self, cmd, timeout_s=None, **kw):
        self.send(cmd, **kw)
        return self.recv(self.step_s if timeout_s is None else timeout_s, cmd)


def call_all(peers, cmd, timeout_s, **kw):
    """Sends ``cmd`` to every peer first (a collective), then collects each answer."""
    for p in peers:
        p.send(cmd, **kw)
    return [p.recv(timeout_s, cmd) for p in peers]


def wait_until(predicate, timeout_s, what):
    """Polls ``predicate`` (e.g. a condition of the master's state) until it holds.

    The wait between polls is the poll period, not a guess at how long something takes.

    Raises:
        AssertionError: it did not hold within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    tick = threading.Event()
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        tick.wait(0.05)
