"""The test side of a worker process driven by JSON lines: commands go to its stdin,
events come back on its stdout. Every wait is bounded; stderr goes to a file that
failure messages quote."""

import json
import queue
import signal
import subprocess
import threading
import time


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
