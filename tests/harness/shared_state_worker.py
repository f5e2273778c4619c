"""One elastic peer for tests/elastic/test_shared_state.py, driven over stdin/stdout with JSON lines.

``python tests/harness/shared_state_worker.py MASTER_ADDR TIMEOUT_S`` imports torch,
prints ``{"event": "started", ...}`` and waits as a *standby* until the test
sends ``{"cmd": "join"}``; it then registers with the master
(``init_process_group(init_method="pccl://...")``, blocking while pending) and
answers one command per stdin line like tests/harness/elastic_worker.py (whose
``join_and_serve`` loop it reuses). Standbys let a late joiner's start-up
(importing torch) overlap the rest of the test.

The process holds one shared state, ``STATE`` (name -> CPU tensor), built by
``build``: either a small MLP's ``state_dict()`` (whose tensors alias the
model's parameters, so an in-place sync updates the model) plus an
outer-momentum buffer per parameter and an int64 ``step``, or a "blob" of
float32 entries. ``sync`` runs ``torch_pccl.sync_shared_state`` on it and
reports the result, or the exception, as data, together with sha256 digests
of every entry before and after (computed here, independently of
``torch_pccl.state_hashes``) so the test can check "unchanged" and "equal on
every peer" without trusting the code under test.
"""

import hashlib
import os
import resource
import signal
import sys
import time

import torch
import torch.distributed as dist

import torch_pccl
# Run as a script, this file has tests/harness first on sys.path; "harness" needs tests/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.elastic_worker import emit, error_record, standby_then_serve, world  # noqa: E402
# content_digest is not exported at the top level (yet)
from torch_pccl.elastic.shared_state import content_digest  # noqa: E402

STATE = {}
MODEL = {}   # "model": the MLP of kind "mlp", whose parameters STATE aliases


def sha(t):
    """sha256 of the tensor's bytes (any dtype, 0-dim and empty included)."""
    return hashlib.sha256(t.detach().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def shas():
    return {name: sha(t) for name, t in STATE.items()}


def state_bytes():
    return sum(t.numel() * t.element_size() for t in STATE.values())


def summary():
    return {"shas": shas(), "bytes": state_bytes(),
            "nbytes": {n: t.numel() * t.element_size() for n, t in STATE.items()}, **world()}


# -- state ----------------------------------------------------------------------


def build(kind, seed, entries=4, entry_elems=65536, hidden=512, width=64):
    """Replaces STATE; ``seed`` decides every value (same seed: bit-identical state)."""
    STATE.clear()
    MODEL.clear()
    torch.manual_seed(seed)
    if kind == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.Tanh(),
                                    torch.nn.Linear(hidden, width))
        MODEL["model"] = model
        STATE.update(model.state_dict())       # detached views of the parameters
        for name, t in list(STATE.items()):
            STATE[f"outer_momentum.{name}"] = torch.zeros_like(t)
        STATE["step"] = torch.zeros((), dtype=torch.int64)
    elif kind == "blob":
        g = torch.Generator().manual_seed(seed)
        for i in range(entries):
            STATE[f"blob{i}"] = torch.randn(entry_elems, generator=g)
    else:
        raise ValueError(f"unknown state kind {kind!r}")
    return summary()


def outer_step(inner_steps=3, lr=0.05, outer_momentum=0.5):
    """A few local SGD steps on this rank's own data, then the outer step:
    AVG of the parameters over the group, a momentum buffer on the pseudo-gradient."""
    model = MODEL["model"]
    params = dict(model.named_parameters())
    step = int(STATE["step"])
    anchor = {n: p.detach().clone() for n, p in params.items()}
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    width = model[0].in_features
    for _ in range(inner_steps):
        x = torch.randn(32, width, generator=g)
        y = torch.randn(32, width, generator=g)
        loss = ((model(x) - y) ** 2).mean()
        model.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            for p in params.values():
                p.sub_(lr * p.grad)
    with torch.no_grad():
        for n, p in params.items():
            dist.all_reduce(p.detach(), op=dist.ReduceOp.AVG)
            mom = STATE[f"outer_momentum.{n}"]
            mom.mul_(outer_momentum).add_(anchor[n] - p)
            p.copy_(anchor[n] - mom)
        STATE["step"].add_(1)
    return {"loss": loss.item(), "step": int(STATE["step"])}


def tamper(name, delta=1.0):
    STATE[name].add_(delta)
    return summary()


def add_entry(name, numel=16):
    STATE[name] = torch.zeros(numel)
    return summary()


def remove_entry(name):
    del STATE[name]
    return summary()


def reshape_entry(name, numel_delta=1):
    """Gives entry ``name`` another shape (``numel_delta`` more elements), same dtype."""
    old = STATE[name]
    STATE[name] = torch.zeros(old.numel() + numel_delta, dtype=old.dtype)
    return summary()


def retype_entry(name):
    STATE[name] = STATE[name].to(torch.float64)
    return summary()


# -- the feature under test -----------------------------------------------------


def result_record(res):
    return {"revision": res.revision, "content": res.content, "bytes_sent": res.bytes_sent,
            "bytes_received": res.bytes_received, "changed": list(res.changed),
            "sources": list(res.sources), "retries": res.retries, "seconds": res.seconds}


def vm_size_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def sync(revision, strategy="enforce_popular", allow_divergence=(), timeout=None,
         max_retries=3, as_headroom_mib=None):
    """Runs sync_shared_state on STATE; reports its result or its exception.

    ``as_headroom_mib``: lowers the soft RLIMIT_AS to the current address-space
    size plus that many MiB right before the call and restores it right after.
    """
    before = shas()
    out = {}
    started = time.monotonic()
    restore = None
    try:
        if as_headroom_mib is not None:
            restore = resource.getrlimit(resource.RLIMIT_AS)
            limit = vm_size_bytes() + int(as_headroom_mib * 2**20)
            resource.setrlimit(resource.RLIMIT_AS, (limit, restore[1]))
            out["as_limit"] = limit
        try:
            res = torch_pccl.sync_shared_state(STATE, revision, strategy=strategy,
                                               allow_divergence=tuple(allow_divergence),
                                               timeout=timeout, max_retries=max_retries)
        finally:
            if restore is not None:
                resource.setrlimit(resource.RLIMIT_AS, restore)
        out.update(error=None, result=result_record(res))
    except torch_pccl.PcclError as exc:
        out.update(error=error_record(exc, started), result=None)
    out["elapsed"] = time.monotonic() - started
    after = shas()
    out.update(before=before, shas=after, unchanged=before == after,
               hashes=torch_pccl.state_hashes(STATE, allow_divergence=tuple(allow_divergence)),
               digest=content_digest(STATE, allow_divergence=tuple(allow_divergence)),
               **world())
    return out


def arm_kill(fraction=0.5):
    """Test-only: the next Communicator.transfer_batch of this process runs the real
    method on the first ``fraction`` of its ops, says "killing", then SIGKILLs itself."""
    from torch_pccl.core.communicator import Communicator

    real = Communicator.transfer_batch

    def transfer_then_die(self, ops, timeout_s=None):
        ops = list(ops)
        half = int(len(ops) * fraction)
        if half:
            real(self, ops[:half], timeout_s)
        emit(event="killing", ops=len(ops), done=half,
             sends=sum(1 for op in ops if op[0]), recvs=sum(1 for op in ops if not op[0]))
        os.kill(os.getpid(), signal.SIGKILL)

    Communicator.transfer_batch = transfer_then_die
    return {"armed": True}


def all_reduce(n=1000):
    t = torch.full((n,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    n_ranks = dist.get_world_size()
    return {"ok": t[0].item() == n_ranks * (n_ranks + 1) / 2 and bool((t == t[0]).all()),
            **world()}


def update():
    change = torch_pccl.update_topology()
    return {"joined": list(change.joined), "left": list(change.left), **world()}


COMMANDS = {
    "build": build,
    "outer_step": outer_step,
    "tamper": tamper,
    "add_entry": add_entry,
    "remove_entry": remove_entry,
    "reshape_entry": reshape_entry,
    "retype_entry": retype_entry,
    "summary": summary,
    "sync": sync,
    "arm_kill": arm_kill,
    "all_reduce": all_reduce,
    "update": update,
    "pending": lambda: {"pending": torch_pccl.peers_pending()},
    "world": world,
}


def main():
    torch.set_num_threads(1)
    master, timeout_s = sys.argv[1], float(sys.argv[2])
    emit(event="started", pid=os.getpid())
    standby_then_serve(master, timeout_s, COMMANDS)


if __name__ == "__main__":
    main()
