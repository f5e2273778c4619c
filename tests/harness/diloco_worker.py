"""One elastic peer for tests/algorithms/test_diloco.py, driven over stdin/stdout with JSON lines.

``python tests/harness/diloco_worker.py MASTER_ADDR TIMEOUT_S`` imports torch (and
what the first optimizer imports), prints ``{"event": "started", ...}`` and
waits as a standby until ``{"cmd": "join"}``; it then joins the pccl:// world
and answers commands (tests/harness/elastic_worker.py's ``join_and_serve`` loop); one
process can run several wrappers in turn, each ``setup`` replacing the last:

- ``setup``: builds a small residual MLP (4 blocks ``blocks.<i>.``; initial
  weights seeded by the peer's own name, so peers start *different* and the
  wrapper's constructor sync must equalise them), an inner SGD and one of the
  wrappers (``kind``: diloco | streaming | async; ``compression``: the fields of a
  ``TopK``; ``quorum``: the fields of a ``Quorum``) — a collective;
- ``train``: ``steps`` inner steps on this peer's own data stream, calling
  ``wrapper.step()`` after each; ``user_checks``: also ``if peers_pending():
  update_topology()`` at the top and the end of every inner step, as a user may
  write it; ``die_at``: SIGKILL this process right before
  inner step ``die_at`` (after its exchanges in flight completed and it said
  "killing"); ``until_step``: instead of ``steps``, train until the wrapper's shared
  outer step reaches it (a quorum run: peers run unequal numbers of inner steps);
  ``hold_in``: the hook that holds this peer back: in each of these outer steps (the
  wrapper's ``step_count``), before its first inner step there, it waits (bounded) until
  the master closed the current quorum round, as a straggler would (keyed by the outer
  step, not by the inner step: a peer may come late to a round before its hook runs);
- ``finish``: ``wrapper.finish()``.

Every answer carries the shared state's ``torch_pccl.state_hashes`` and a
sha256 of all its bytes computed here, and the eval loss of the *outer*
parameters on a fixed evaluation set (the same on every peer).
"""

import hashlib
import os
import signal
import sys
import time
import zlib

import torch

import torch_pccl
# Run as a script, this file has tests/harness first on sys.path; "harness" needs tests/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.elastic_worker import emit, master_away, standby_then_serve, world  # noqa: E402

DIM = 8
WIDTH = 16
BLOCKS = 4
RUN = {}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(DIM, WIDTH)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS))
        self.out = torch.nn.Linear(WIDTH, DIM)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.out(h)


def teacher():
    g = torch.Generator().manual_seed(1234)
    return torch.randn(DIM, DIM, generator=g) / DIM ** 0.5


def batch(seed, n=32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, DIM, generator=g)
    return x, x @ teacher().T + 0.01 * torch.randn(n, DIM, generator=g)


EVAL = None


def eval_loss(params):
    """MSE of a Net holding ``params`` (name -> tensor) on the fixed evaluation set."""
    global EVAL
    if EVAL is None:
        EVAL = batch(999, 256)
    net = Net()
    net.load_state_dict(params, strict=False)
    with torch.no_grad():
        return torch.nn.functional.mse_loss(net(EVAL[0]), EVAL[1]).item()


def sha(state):
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def summary():
    d = RUN["wrapper"]
    state = d.state()
    return {"hashes": torch_pccl.state_hashes(state), "sha": sha(state),
            "step": d.step_count, "eval": eval_loss(d.outer_state_dict()), **world()}


def record(o):
    return {"step": o.step, "world_size": o.world_size, "bytes_sent": o.bytes_sent,
            "bytes_received": o.bytes_received, "seconds": o.seconds, "retries": o.retries,
            "joined": list(o.joined), "left": list(o.left), "fragments": list(o.fragments),
            "participants": list(o.participants), "late": list(o.late),
            "rounds": [[list(p), list(late)] for p, late in o.rounds]}


def setup(kind, sync_every, quantization=None, inner_lr=0.05, compression=None, **kw):
    name = os.environ.get("PCCL_PEER_ID", "peer")
    torch.manual_seed(zlib.crc32(name.encode()))
    model = Net()
    inner = torch.optim.SGD(model.parameters(), lr=inner_lr)
    cls = {"diloco": torch_pccl.DiLoCo, "streaming": torch_pccl.StreamingDiLoCo,
           "async": torch_pccl.AsyncDiLoCo}[kind]
    RUN.update(model=model, inner=inner, name=name, t=0)
    if compression is not None:            # the TopK's fields, as JSON
        kw["compression"] = torch_pccl.TopK(**compression)
    if kw.get("quorum") is not None:       # the Quorum's fields, as JSON
        kw["quorum"] = torch_pccl.Quorum(**kw["quorum"])
    RUN["wrapper"] = cls(model, inner, sync_every=sync_every, quantization=quantization,
                         max_retries=3, **kw)
    RUN["t"] = RUN["wrapper"].step_count * sync_every     # the group's inner step
    return {**summary(), "received": RUN["wrapper"].last_sync.bytes_received,
            "changed": len(RUN["wrapper"].last_sync.changed)}


def user_check():
    """What a user may add to the loop: the wrapper admits peers at its own boundaries,
    so this must change nothing (peers_pending answers False while the wrapper lives)."""
    if torch_pccl.peers_pending():
        torch_pccl.update_topology()


def hold_until_closed(round_, timeout_s=60.0):
    """The straggler hook: waits until the master closed quorum round ``round_``."""
    from torch_pccl.elastic.topology import elastic_group
    membership = elastic_group(None).membership
    deadline = time.monotonic() + timeout_s
    while membership.closed_quorum(round_) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"quorum round {round_} did not close in {timeout_s} s")
        time.sleep(0.02)


def train(steps=None, die_at=None, user_checks=False, until_step=None, hold_in=()):
    model, inner, d = RUN["model"], RUN["inner"], RUN["wrapper"]
    seed0 = zlib.crc32(RUN["name"].encode()) * 100_000
    losses, outer = [], []
    holds = set(hold_in)
    i = 0
    while (i < steps) if until_step is None else (d.step_count < until_step):
        if d.step_count in holds:
            holds.discard(d.step_count)
            # The outer step's first round: DiLoCo and AsyncDiLoCo hold one per outer step,
            # named by the revision it starts from; StreamingDiLoCo one per fragment.
            per_step = len(d.fragments) if isinstance(d, torch_pccl.StreamingDiLoCo) else 1
            hold_until_closed(d.last_sync.revision * per_step)
        if die_at is not None and i == die_at:
            # Die between collectives, as a peer that crashes while computing: its
            # exchanges in flight finish first (here, and so on every peer). A peer lost
            # inside an exchange that some survivors already completed is not handled
            # (see the limits in torch_pccl/algorithms/diloco/__init__.py).
            for pending in list(d._pending):
                pending.work.wait()
            emit(event="killing", step=RUN["t"])
            os.kill(os.getpid(), signal.SIGKILL)
        if user_checks:
            user_check()
        RUN["t"] += 1
        x, y = batch(seed0 + RUN["t"])
        loss = torch.nn.functional.mse_loss(model(x), y)
        inner.zero_grad(set_to_none=True)
        loss.backward()
        inner.step()
        losses.append(loss.item())
        o = d.step()
        if o is not None:
            outer.append(record(o))
        if user_checks:
            user_check()
        i += 1
    return {"losses": losses, "outer": outer, **summary()}


def finish():
    RUN["wrapper"].finish()
    return summary()


COMMANDS = {"setup": setup, "train": train, "finish": finish, "world": world,
            "summary": summary, "master_away": master_away}


def warm_up():
    """Pays the first optimizer's import of torch._dynamo (seconds of CPU) and the
    package's lazy imports before this peer registers with the master."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    import torch_pccl.algorithms.diloco  # noqa: F401
    import torch_pccl.elastic.shared_state  # noqa: F401
    torch_pccl.Communicator  # noqa: B018 - loads the native extension


def main():
    torch.set_num_threads(1)
    master, timeout_s = sys.argv[1], float(sys.argv[2])
    warm_up()
    emit(event="started", pid=os.getpid())
    standby_then_serve(master, timeout_s, COMMANDS)


if __name__ == "__main__":
    main()
