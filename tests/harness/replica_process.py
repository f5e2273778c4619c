"""The test side of one process of a sharded replica (tests/harness/replica_worker.py,
replica_ddp_worker.py): its JSON events read on a thread, every wait bounded, a word on
stdin to let a held process go on."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading

from harness import HARNESS, REPO


class ShardProcess:
    """``python HARNESS/<worker> <args>`` named ``name`` (``<replica><shard>``); stderr in
    ``tmp_path/<name>.err``, quoted by every failed wait of ``wait_s`` seconds."""

    def __init__(self, tmp_path, worker, name, args, wait_s):
        self.name, self.replica, self.shard = name, name[:-1], int(name[-1])
        self.wait_s = wait_s
        self.err_path = tmp_path / f"{name}.err"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, HARNESS]))
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, os.path.join(HARNESS, worker)] + args,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, text=True, env=env)
        self.events = []
        self._q = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self._q.put(json.loads(line))
        self._q.put(None)

    def _get(self, kind):
        try:
            msg = self._q.get(timeout=self.wait_s)
        except queue.Empty:
            raise AssertionError(f"{self.name}: no {kind!r} within {self.wait_s} s\n"
                                 f"{self.err_path.read_text()[-3000:]}") from None
        assert msg is not None, f"{self.name} exited before {kind!r}:\n" \
                                f"{self.err_path.read_text()[-3000:]}"
        self.events.append(msg)
        return msg

    def next(self, kind):
        """The next event, which must be ``kind``."""
        msg = self._get(kind)
        assert msg["event"] == kind, f"{self.name}: expected {kind}, got {msg}"
        return msg

    def until(self, kind, passing=("outer",)):
        """Events up to and including the next ``kind``; only ``passing`` ones before it."""
        while True:
            msg = self._get(kind)
            if msg["event"] == kind:
                return msg
            assert msg["event"] in passing, f"{self.name}: expected {kind}, got {msg}"

    def say(self, word):
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def kill(self, sig=signal.SIGKILL):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
