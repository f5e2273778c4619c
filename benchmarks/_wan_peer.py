"""One peer of benchmarks/wan_training.py: trains the main job's model for one row and records
what it did, without evaluating anything (evaluation would sit in the timed loop).

Run by the driver as ``python benchmarks/_wan_peer.py '<json config>'`` (inside its host's
network namespace). It trains ``examples/_model.py``'s ``CharTransformer`` on the King James
Bible exactly as examples/train_diloco.py does (same seed, initial weights, per-peer data
streams, AdamW with warm-up and cosine, batch and context), with the row's algorithm
(``_wan_rows.Row``), for ``steps`` inner steps or until the driver kills it at its cap.

It writes JSON lines to ``cfg["record"]`` (flushed at once, so a peer killed mid-run leaves
what it had): ``start`` (rank, world, setup seconds), then every ``eval_every`` steps a
``snap`` (step, seconds since its first inner step, group tokens so far, world size, compute
and blocked seconds so far, xxh3-128 digest of its outer parameters), and ``end``. The
observing peer (host 0) also saves the outer parameters of every ``snap`` to
``<snapshots>/<step>.pt`` for the driver to evaluate, and prints ``{"event": "progress"}``
lines on stdout (its step; ``done`` at the end) that drive the progress bar and the churn
schedule. Every peer prints ``{"event": "result"}`` just before a clean exit.

A sharded row's peer (``Row.shards`` > 1) is one shard of its host's replica: an inner gloo
group with the host's other processes (``cfg["inner"]``, on the host's own loopback), the model
sharded with FSDP2 over it, ``batch_size / shards`` sequences a step, and DiLoCo over its shard
ring (``torch_pccl.init_replica_group``). Its ``snap`` digests are of its own shard (they
compare within a shard index); the observing replica's processes gather the full outer
parameters for the snapshot (a collective of the replica, outside the clock).

Clock: ``seconds`` counts from this peer's first inner step, less the time spent writing
records and snapshots. ``compute`` is the wall time of forward, backward and the inner
optimizer step (DDP: less the time its all-reduce hook was in flight, which DDP waits for
inside backward); ``blocked`` is the wall time spent in the wrapper's ``step()`` (DiLoCo
family) or in the gradient all-reduce (DDP).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "examples"))  # the main job's model and data
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _wan_rows import ROWS, Row  # noqa: E402


class Recorder:
    """The peer's record file and clock (see the module docstring)."""

    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1)
        self.start = None
        self.paused = 0.0          # seconds spent recording, left out of the clock
        self.compute = 0.0
        self.blocked = 0.0
        self.wire = 0.0            # DDP: seconds its gradients were on the link

    def wire_seconds(self) -> float:
        """Seconds the exchanges were in flight: DDP's from its first bucket's launch; a
        blocking exchange's, the time its trainer waited."""
        return self.wire or self.blocked

    def begin(self) -> None:
        self.start = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.start - self.paused

    def write(self, kind: str, **fields) -> None:
        self._file.write(json.dumps({"kind": kind, **fields}) + "\n")

    @contextlib.contextmanager
    def pause(self):
        """Time inside the block is left out of ``seconds()``."""
        started = time.perf_counter()
        try:
            yield
        finally:
            if self.start is not None:
                self.paused += time.perf_counter() - started


def make_wrapper(row: Row, cfg: dict, model, opt, ring=None):
    """The row's DiLoCo-family wrapper around ``opt`` (None for DDP), on ``ring`` (a sharded
    replica's shard ring; None: the default group); a collective (a joiner receives the
    group's state here)."""
    if row.algo == "ddp":
        return None
    from _model import balanced_fragments

    from torch_pccl.algorithms import diloco

    def outer(params):
        return torch.optim.SGD(params, lr=cfg["outer_lr"], momentum=cfg["outer_momentum"],
                               nesterov=True)

    common = dict(outer_optimizer=outer, sync_every=cfg["sync_every"],
                  quantization=row.quantization, timeout=cfg["op_timeout"])
    if ring is not None:
        common["group"] = ring
    if row.algo == "streaming":
        common.update(fragments=balanced_fragments(model, cfg["fragments"]), tau=cfg["tau"],
                      alpha=cfg["alpha"])
    if row.compression == "topk":
        from torch_pccl.algorithms.topk import TopK

        common["compression"] = TopK()
    if row.quorum is not None:
        import torch_pccl

        common["quorum"] = torch_pccl.Quorum(*row.quorum)
    common.update(row.options)      # the row's own settings win
    if row.algo == "streaming":
        return diloco.StreamingDiLoCo(model, opt, **common)
    if row.algo == "async":
        return diloco.AsyncDiLoCo(model, opt, **common)
    if row.algo == "diloco":
        return diloco.DiLoCo(model, opt, **common)
    raise ValueError(f"row {row.name}: unknown algorithm {row.algo!r}")


def timed_allreduce_hook(marks: dict):
    """A DDP communication hook: torch's own ``allreduce_hook`` (the average of the bucket),
    with the first launch, the latest launch and the latest completion of the step's buckets
    kept in ``marks`` ("first", "launched", "done"; perf_counter seconds). DDP launches its
    last bucket as backward's compute ends and waits for every bucket before backward
    returns, so the trainer waited from the last launch to the last completion; the link
    carried the step's gradients from the first launch on."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def hook(state, bucket):
        marks["launched"] = time.perf_counter()
        marks.setdefault("first", marks["launched"])
        fut = default_hooks.allreduce_hook(None, bucket)

        def done(f):
            marks["done"] = time.perf_counter()
            return f.value()
        return fut.then(done)
    return hook


def init_group(row: Row, cfg: dict) -> None:
    """The default group: the peers' own (gloo or pccl), or a sharded replica's inner group."""
    timeout = datetime.timedelta(seconds=cfg["setup_timeout"])
    if row.shards > 1:
        dist.init_process_group("gloo", init_method=f"tcp://{cfg['inner']}", rank=cfg["shard"],
                                world_size=row.shards, timeout=timeout)
        return
    if row.backend == "gloo":
        dist.init_process_group("gloo", init_method=f"tcp://{cfg['store']}", rank=cfg["host"],
                                world_size=cfg["world"], timeout=timeout)
    else:
        os.environ.setdefault("PCCL_TIMEOUT", str(cfg["op_timeout"]))
        dist.init_process_group("pccl", init_method=f"pccl://{cfg['master']}", timeout=timeout)


def shard_model(model, cfg: dict):
    """A sharded replica's model: FSDP2 over a 1-D CPU mesh of the replica's processes, one
    ``fully_shard`` per block, then the root (examples/train_sharded_diloco.py's layout)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def outer_params(wrapper, model) -> list:
    """The parameters a snapshot digests: this process's (a shard's local outer copies)."""
    return list(model.parameters()) if wrapper is None else wrapper.outer_parameters


def full_outer_params(wrapper, model) -> list:
    """The whole outer parameters in ``model.parameters()`` order: of a sharded replica, the
    local shards gathered over its inner group (a collective of the replica)."""
    if wrapper is None:
        return list(model.parameters())
    from torch.distributed.tensor import DTensor

    return [t.full_tensor() if isinstance(t, DTensor) else t
            for t in wrapper.outer_state_dict().values()]


def snapshot(rec: Recorder, cfg: dict, step: int, tokens: int, world: int, wrapper,
             model) -> None:
    """A ``snap`` record; on the observing peer, the parameters saved for evaluation (a
    sharded observer's replica gathers them: every process of it calls this alike)."""
    import torch_pccl

    seconds = rec.seconds()
    with rec.pause():
        params = outer_params(wrapper, model)
        digest = torch_pccl.content_digest({str(i): p.detach() for i, p in enumerate(params)})
        if cfg.get("gather"):
            params = full_outer_params(wrapper, model)
        if cfg["snapshots"]:
            torch.save([p.detach().clone() for p in params],
                       os.path.join(cfg["snapshots"], f"{step}.pt"))
        rec.write("snap", step=step, seconds=seconds, tokens=tokens, world=world,
                  compute=rec.compute, blocked=rec.blocked, wire=rec.wire_seconds(),
                  digest=digest)


def progress(cfg: dict, step: int, done: bool = False) -> None:
    if cfg["snapshots"]:            # the observing peer
        print(json.dumps({"event": "progress", "step": step, "done": done}), flush=True)


def run(cfg: dict) -> None:
    from _data import build_corpus, load_kjv_text, sample_batch, training_generator
    from _model import CharTransformer, lr_at

    torch.set_num_threads(1)
    row = ROWS[cfg["row"]]
    rec = Recorder(cfg["record"])
    setup_start = time.perf_counter()
    corpus = build_corpus(load_kjv_text())
    torch.manual_seed(cfg["seed"])  # the same initial weights on every peer
    model = CharTransformer(corpus.vocab_size, cfg["block_size"], cfg["dim"], cfg["layers"],
                            cfg["heads"])
    gen = training_generator(cfg["seed"], cfg["stream"])
    init_group(row, cfg)
    ring = None
    batch = cfg["batch_size"] // row.shards     # a replica's processes share a peer's batch
    if row.shards > 1:
        import torch_pccl

        shard_model(model, cfg)
        ring = torch_pccl.init_replica_group(cfg["master"], f"r{cfg['host']}", model,
                                             timeout=cfg["setup_timeout"])
    ddp = None
    params = model.parameters()
    if row.algo == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model)              # broadcasts rank 0's parameters: a collective
        marks = {}
        ddp.register_comm_hook(None, timed_allreduce_hook(marks))
        params = ddp.parameters()
    opt = torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=0.01)
    wrapper = make_wrapper(row, cfg, model, opt, ring)
    group = ring if ring is not None else dist.group.WORLD   # the peers' group
    first = 1 if wrapper is None else wrapper.step_count * cfg["sync_every"] + 1
    rec.write("start", rank=group.rank(), world=group.size(),
              first_step=first, setup_s=time.perf_counter() - setup_start, host=cfg["host"],
              shard=cfg.get("shard", 0))
    args = _Schedule(cfg)
    tokens_per_step = cfg["batch_size"] * cfg["block_size"]     # a peer's, or a replica's
    tokens = 0
    # A quorum row trains until the group's outer step reaches the budget's rounds: its
    # peers run unequal numbers of inner steps, and all of them must finish after the
    # same round (DiLoCo's ``quorum`` docstring).
    rounds = cfg["steps"] // cfg["sync_every"] if row.quorum is not None else None
    slow = cfg.get("slow", 1.0)
    since = 0          # inner steps since the wrapper's last outer step (the lr's position)
    rec.begin()
    progress(cfg, first - 1)
    step = first - 1
    while rounds is not None or step < cfg["steps"]:
        step += 1
        if step == cfg.get("kill_step"):
            os.kill(os.getpid(), signal.SIGKILL)    # the churn row's victim
        t0 = time.perf_counter()
        at = step - 1 if rounds is None else \
            min(cfg["steps"] - 1, wrapper.step_count * cfg["sync_every"] + since)
        for g in opt.param_groups:
            g["lr"] = lr_at(at, args)
        x, y = sample_batch(corpus.train, batch, cfg["block_size"], gen)
        loss = (ddp or model)(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if slow > 1.0:
            # The slow peer's machine: each step's compute again (slow - 1) times over,
            # as idle time (it frees the CPU the other peers share here, as a separate
            # slower machine would).
            time.sleep((slow - 1.0) * (time.perf_counter() - t0))
        waited = 0.0
        if ddp is not None:      # the wait inside backward: not compute
            done = marks.pop("done", 0.0)
            waited = max(0.0, done - marks.pop("launched", 0.0))
            rec.blocked += waited
            rec.wire += max(0.0, done - marks.pop("first", done))
        rec.compute += time.perf_counter() - t0 - waited
        world = group.size()        # those who trained this step (before a change)
        last = step == cfg["steps"]
        if wrapper is not None:
            t1 = time.perf_counter()
            outer_step = wrapper.step_count
            wrapper.step()
            # Streaming reports every fragment it applies: the lr's position restarts at
            # the outer step's boundary only.
            since = 0 if wrapper.step_count != outer_step else since + 1
            if rounds is not None:
                last = wrapper.step_count >= rounds
            if last:
                wrapper.finish()        # the final sync: what every peer ends with
            rec.blocked += time.perf_counter() - t1
        tokens += world * tokens_per_step
        # Every peer's last snapshot is the budget's step, so that they compare.
        key = cfg["steps"] if last else step
        # A quorum row's fast peers run past the budget's step count before the group's
        # last round closes: their snapshots there would outrank the final one, which is
        # the one every peer takes (and the parity check compares).
        if step % cfg["eval_every"] == 0 and step < cfg["steps"] or last:
            snapshot(rec, cfg, key, tokens, world, wrapper, model)
        if step % cfg["progress_every"] == 0 and not last:
            progress(cfg, step)
        if last:
            break
    rec.write("end", seconds=rec.seconds(), compute=rec.compute, blocked=rec.blocked,
              wire=rec.wire_seconds(),
              steps=step - first + 1, pccl_bytes=_pccl_bytes(row, ring))
    progress(cfg, cfg["steps"], done=True)
    print(json.dumps({"event": "result", "host": cfg["host"]}), flush=True)
    if ring is not None:
        ring.shutdown()             # leaves the master cleanly
    dist.destroy_process_group()


def _pccl_bytes(row: Row, ring) -> list[int] | None:
    """(sent, received) data-plane bytes of this peer's current pccl communicator (since its
    last change of world; a shard: its ring's), payload plus frame headers; None for gloo."""
    if row.backend != "pccl":
        return None
    from torch_pccl.c10d.process_group import pccl_group

    return list(pccl_group(ring).communicator.stats()[:2])


class _Schedule:
    """What ``_model.lr_at`` reads: peak lr, warm-up and total steps."""

    def __init__(self, cfg: dict):
        self.lr, self.warmup, self.steps = cfg["lr"], cfg["warmup"], cfg["steps"]


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
