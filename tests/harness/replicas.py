"""An in-process group of DiLoCo replicas, one thread each, standing in for the pccl
transport (``torch_pccl.algorithms.diloco.transport.Transport``) in the tests of the
wrappers' math (tests/algorithms/test_diloco.py, tests/algorithms/test_finite.py).

Every collective is numbered per replica in call order (as c10d requires every rank to
issue them in one order); the n-th of every replica meet and get the same bytes:

- ``all_reduce`` (AVG): the contributions added in rank order, then divided by n (an
  inf or NaN propagates as in any sum);
- ``all_gather``: the contributions stacked in rank order;
- ``all_reduce_max``: the element-wise maximum (Streaming DiLoCo's automatic tau).

Quorum rounds (``DiLoCo(quorum=...)``) go through the master's own rule
(``torch_pccl.master.quorum.QuorumRounds``) held here, on the clock of ``time.monotonic``;
every replica is a live member, and its announcements land in per-replica mailboxes.

A replica whose n-th collective is of another kind than the others' fails the test
(``AssertionError``), as a pccl group would fail with ``MismatchError``; a replica
that never comes fails it after 30 s.
"""

import threading
import time
from types import SimpleNamespace

import torch

from torch_pccl.master.actions import Actions
from torch_pccl.master.quorum import QuorumRounds

from harness.diloco_worker import sha as digest  # sha256 of a state's names and bytes

WAIT_S = 30.0   # seconds: how long a collective waits for the last replica


class ThreadGroup:
    """n replicas; a sync that records each replica's state digest per revision, so tests
    can check the shared state's parity (``digests``), and the kind of every collective
    (``kinds``), so tests can check what went on the wire."""

    def __init__(self, n):
        self.n = n
        self.cond = threading.Condition()
        self.contribs = {}       # seq -> {rank: (kind, tensor)}
        self.results = {}
        self.digests = {}        # revision -> {rank: sha256 of the shared state}
        self.quorum = QuorumRounds()
        self.mailbox = {r: {} for r in range(n)}     # rank -> {round: announcement}
        self._ids = {r: SimpleNamespace(peer_id=f"replica{r}") for r in range(n)}

    def ready(self, rank, msg):
        """Replica ``rank`` sent ``ready``: the master's rule, then its announcements."""
        with self.cond:
            act = Actions()
            self.quorum.ready(act, rank, f"replica{rank}", msg, time.monotonic(), self._ids,
                              list(range(self.n)))
            self._deliver(act)

    def tick(self):
        with self.cond:
            act = Actions()
            self.quorum.check(act, time.monotonic(), self._ids, list(range(self.n)))
            self._deliver(act)

    def _deliver(self, act):
        for conn, msg in act.sends:
            assert msg["type"] == "quorum", msg
            self.mailbox[conn][msg["round"]] = msg
        self.cond.notify_all()

    def peer(self, rank):
        return ThreadPeer(self, rank)

    def kinds(self):
        """The kind of each collective so far, in order ("all_reduce" / "all_gather")."""
        with self.cond:
            return [next(iter(self.contribs[s].values()))[0] for s in sorted(self.contribs)]

    def contribute(self, seq, rank, kind, tensor):
        with self.cond:
            self.contribs.setdefault(seq, {})[rank] = (kind, tensor.detach().clone())
            self.cond.notify_all()

    def result(self, seq):
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.contribs.get(seq, {})) == self.n,
                                      WAIT_S), f"collective #{seq}: a replica never came"
            if seq not in self.results:
                parts = [self.contribs[seq][r] for r in range(self.n)]
                kinds = [k for k, _ in parts]
                assert len(set(kinds)) == 1, f"collective #{seq}: replicas called {kinds}"
                tensors = [t for _, t in parts]
                if kinds[0] == "all_gather":
                    self.results[seq] = torch.stack(tensors)
                elif kinds[0] == "all_reduce_max":
                    self.results[seq] = torch.stack(tensors).amax(dim=0)
                else:
                    acc = tensors[0].clone()
                    for t in tensors[1:]:
                        acc += t
                    self.results[seq] = acc / self.n
            return self.results[seq]


class ThreadWork:
    def __init__(self, group, seq, buf):
        self.group, self.seq, self.buf = group, seq, buf

    def wait(self):
        self.buf.copy_(self.group.result(self.seq).view(self.buf.shape))
        return True

    def is_completed(self):
        """Every replica has contributed (the result is ready)."""
        with self.group.cond:
            return len(self.group.contribs.get(self.seq, {})) == self.group.n


class FixedMembership:
    """The membership half of a ``Transport`` (torch_pccl.algorithms.diloco.transport) whose
    world never changes: epoch 1, nobody pending, every exchange kept, no traffic counted.
    ``ThreadPeer`` and tests/harness/shards_code.py's ``SecondReplica`` add the collectives."""

    def epoch(self):
        return 1

    def shared_revision(self):
        return 0

    def peers_pending(self):
        return False

    def quiet(self):
        return False

    def round_opened(self):
        return False

    def update_topology(self, admit=True):
        raise AssertionError("no topology changes in a fixed world")

    def begin_exchange(self, buf):
        pass

    def end_exchange(self, buf):
        pass

    def rolled_forward(self):
        return False

    def errored(self):
        return False

    def traffic(self):
        return (0, 0)


class ThreadPeer(FixedMembership):
    """One replica's transport (see ``transport.Transport``); its peer id is
    ``replica<rank>``, its address ``thread-<rank>``."""

    def __init__(self, group, rank):
        self.group, self.rank, self.seq = group, rank, 0

    def _next(self):
        seq, self.seq = self.seq, self.seq + 1
        return seq

    def world_size(self):
        return self.group.n

    def all_reduce(self, buf, async_op):
        seq = self._next()
        self.group.contribute(seq, self.rank, "all_reduce", buf)
        work = ThreadWork(self.group, seq, buf)
        if async_op:
            return work
        work.wait()
        return None

    def all_reduce_max(self, buf):
        seq = self._next()
        self.group.contribute(seq, self.rank, "all_reduce_max", buf)
        return ThreadWork(self.group, seq, buf)

    def all_gather(self, out, inp, async_op=False):
        seq = self._next()
        self.group.contribute(seq, self.rank, "all_gather", inp.reshape(-1))
        work = ThreadWork(self.group, seq, out)
        if async_op:
            return work
        work.wait()
        return None

    def members(self):
        return tuple((f"replica{r}", f"thread-{r}") for r in range(self.group.n))

    def sync(self, state, revision, max_retries):
        with self.group.cond:
            self.group.digests.setdefault(revision, {})[self.rank] = digest(state)
        return SimpleNamespace(revision=revision, changed=(), retries=0, bytes_sent=0,
                               bytes_received=0, content=None)

    def report_step(self, step):
        self.step = step

    def peer_id(self):
        return f"replica{self.rank}"

    def quorum_early(self, round_, tokens, stale, min_peers, grace_s):
        self.early = round_
        self.group.ready(self.rank, {"round": round_, "tokens": tokens, "stale": stale,
                                     "min_peers": min_peers, "grace_s": grace_s})

    def quorum_ready(self, round_, tokens, stale, min_peers, grace_s):
        if getattr(self, "early", None) != round_:      # else sent ahead: only wait
            self.group.ready(self.rank, {"round": round_, "tokens": tokens, "stale": stale,
                                         "min_peers": min_peers, "grace_s": grace_s})
        deadline = time.monotonic() + WAIT_S
        box = self.group.mailbox[self.rank]
        while round_ not in box:
            # The grace window's deadline is the master's tick; here the waiter's.
            assert time.monotonic() < deadline, f"quorum round {round_} never closed"
            self.group.tick()
            with self.group.cond:
                self.group.cond.wait_for(lambda: round_ in box, 0.05)
        return box[round_]

    def quorum_closed(self, round_):
        with self.group.cond:
            return self.group.mailbox[self.rank].get(round_)
