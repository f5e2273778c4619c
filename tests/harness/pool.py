"""A pool of worker processes that form one process group, driven from the test process.

The parent hosts the TCPStore (port 0, so no free-port race), spawns one
process per rank running `workers.worker_main`, and sends commands over a
Pipe: the name of a function in tests/harness/workers.py and its arguments. Every
wait on a worker is bounded (`Connection.poll(timeout)`); a missed deadline,
a dead worker or an unexpected exception fails the test and marks the pool
broken so the session fixture replaces it. `close()` terminates, kills and
joins every worker.
"""

import multiprocessing
import os
import signal
import time
from datetime import timedelta

import torch.distributed as dist

from harness import workers

_CTX = multiprocessing.get_context("spawn")


class PoolError(AssertionError):
    """A worker missed its deadline, died, or raised an exception it did not expect."""


class WorkerPool:
    def __init__(self, world_size, backend, timeout_s=60.0, start_deadline_s=120.0, with_gloo=True):
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self.broken = False
        self.procs = []
        self.conns = []
        self.stores = []
        try:
            self.store = self.new_store()
            for rank in range(world_size):
                parent_end, child_end = _CTX.Pipe()
                proc = _CTX.Process(
                    target=workers.worker_main,
                    args=(rank, world_size, backend, self.store.port, timeout_s, child_end,
                          with_gloo),
                    name=f"pccl-test-rank{rank}",
                    daemon=True,
                )
                proc.start()
                child_end.close()
                self.procs.append(proc)
                self.conns.append(parent_end)
            self.pids = self._collect(range(world_size), start_deadline_s, "start")
        except BaseException:
            self.close()
            raise

    def new_store(self):
        """A fresh TCPStore master in this process; workers connect to its `.port`."""
        store = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True,
                              wait_for_workers=False, timeout=timedelta(seconds=60))
        self.stores.append(store)
        return store

    # --- commands ---

    def send(self, rank, name, *args, **kwargs):
        assert "." in name or hasattr(workers, name), f"no worker command {name!r}"
        try:
            self.conns[rank].send((name, args, kwargs))
        except (BrokenPipeError, ConnectionError, OSError) as e:
            self.broken = True
            raise PoolError(f"rank {rank}: cannot send {name!r}: {e!r}") from e

    def run(self, name, *args, deadline_s=30.0, ranks=None, per_rank_args=None, **kwargs):
        """Runs `name` on `ranks` (default all) and returns their results in rank order.

        per_rank_args, if given, maps rank -> tuple of positional args for that rank.
        """
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        for r in ranks:
            a = per_rank_args[r] if per_rank_args is not None else args
            self.send(r, name, *a, **kwargs)
        return self._collect(ranks, deadline_s, name)

    def recv(self, rank, deadline_s, what="reply"):
        """Next message from `rank` (a (tag, value) pair), waiting at most deadline_s."""
        conn = self.conns[rank]
        try:
            ready = conn.poll(max(0.0, deadline_s))
            if not ready:
                self.broken = True
                raise PoolError(
                    f"rank {rank}: no {what} within {deadline_s:.1f}s "
                    f"(process {'alive' if self.procs[rank].is_alive() else 'dead'})"
                )
            return conn.recv()
        except (EOFError, ConnectionError, OSError) as e:
            self.broken = True
            code = self.procs[rank].exitcode
            raise PoolError(f"rank {rank}: worker died while waiting for {what} "
                            f"(exit code {code}): {e!r}") from e

    def result(self, rank, deadline_s, what="reply"):
        tag, value = self.recv(rank, deadline_s, what)
        if tag == "err":
            self.broken = True
            raise PoolError(f"rank {rank}: {what} raised {value['type']}: {value['message']}\n"
                            f"--- worker traceback ---\n{value['traceback']}")
        if tag != "ok":
            self.broken = True
            raise PoolError(f"rank {rank}: unexpected message {tag!r} while waiting for {what}")
        return value

    def _collect(self, ranks, deadline_s, what):
        end = time.monotonic() + deadline_s
        out = []
        errors = []
        for r in ranks:
            try:
                out.append(self.result(r, end - time.monotonic(), what))
            except PoolError as e:
                errors.append(str(e))
                out.append(None)
                if "no " in str(e) and "within" in str(e):
                    # A deadline passed: the others are probably stuck too; stop waiting.
                    break
        if errors:
            self.broken = True
            raise PoolError(f"{what} failed on world size {self.world_size}:\n" + "\n".join(errors))
        return out

    # --- failure injection ---

    def kill(self, rank, sig=signal.SIGKILL):
        proc = self.procs[rank]
        if proc.is_alive():
            os.kill(proc.pid, sig)
        proc.join(10)

    # --- teardown ---

    def close(self):
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive() and not self.broken:
                try:
                    conn.send(("exit", (), {}))
                except (BrokenPipeError, ConnectionError, OSError):
                    pass
        end = time.monotonic() + (5.0 if not self.broken else 0.0)
        for proc in self.procs:
            proc.join(max(0.0, end - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(3)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns, self.stores = [], [], []
