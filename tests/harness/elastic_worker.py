"""One elastic peer for tests/elastic/test_membership.py, driven over stdin/stdout with JSON lines.

``python tests/harness/elastic_worker.py MASTER_ADDR TIMEOUT_S`` (or ``default``) joins through
``init_process_group(backend="pccl", init_method="pccl://MASTER_ADDR")``
(blocking while pending), prints ``{"event": "ready", ...}``, then runs one
command per stdin line (``{"cmd": NAME, ...}``) and answers each with one
stdout line. Errors of the commands are reported, not raised.
"""

import json
import os
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import torch_pccl


def emit(**msg):
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def error_record(exc, started):
    return {"type": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__],
            "message": str(exc), "elapsed": time.monotonic() - started,
            "traceback": traceback.format_exc()}


def world():
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
            "epoch": torch_pccl.epoch(),
            "group_ranks": dist.get_process_group_ranks(dist.group.WORLD)}


def value_of():
    # Each rank contributes rank+1, so a SUM over n ranks is n(n+1)/2.
    return float(dist.get_rank() + 1)


def all_reduce(n=1000, op="SUM"):
    t = torch.full((n,), value_of())
    before = t.clone()
    started = time.monotonic()
    try:
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    except torch_pccl.PcclError as exc:
        return {"error": error_record(exc, started), "unchanged": bool(torch.equal(t, before))}
    return {"error": None, "result": t[0].item(), "uniform": bool((t == t[0]).all()), **world()}


def loop_all_reduce(n=200_000, max_s=30.0):
    """All-reduces until one fails (or ``max_s`` passes); reports the failure."""
    emit(event="looping")
    deadline = time.monotonic() + max_s
    done = 0
    while time.monotonic() < deadline:
        res = all_reduce(n)
        if res["error"] is not None:
            return {**res, "done": done}
        done += 1
    return {"error": None, "done": done}


def until_failure_then_update(n=1000, max_s=120.0):
    """All-reduces until one fails, then ``update_topology()`` and one more all-reduce.

    Reports the failure, and when (``time.monotonic()``: one clock for every process of
    this host) it came and the all-reduce on the new world completed.
    """
    emit(event="looping")
    deadline = time.monotonic() + max_s
    while time.monotonic() < deadline:
        res = all_reduce(n)
        if res["error"] is not None:
            failed_at = time.monotonic()
            change = torch_pccl.update_topology()
            after = all_reduce(n)
            return {"failure": res["error"], "unchanged": res["unchanged"],
                    "failed_at": failed_at, "done_at": time.monotonic(),
                    "left": list(change.left), "after": after}
    return {"failure": None}


_BOOKED = []     # the result tensor of the last complete_alone


def complete_alone(value, n=1000):
    """Test-only: books an all-or-nothing exchange as completed on this peer alone, its
    result every element ``value`` (what a peer lost inside an all-reduce can leave: this
    survivor received every byte, the others did not)."""
    m = torch_pccl.elastic.topology.elastic_group().membership
    _BOOKED[:] = [torch.full((n,), float(value))]
    m.end_exchange(_BOOKED[0])
    return {"done": m.exchanges_done}


def refill_booked(value):
    """Overwrites the booked result's tensor in place, as a DiLoCo wrapper's next fill of
    its exchange buffer does."""
    _BOOKED[0].fill_(float(value))
    return {}


def pending():
    m = torch_pccl.elastic.topology.elastic_group().membership
    return {"pending": torch_pccl.peers_pending(), "quiet": m.last_quiet}


def round_opened():
    """Whether this member, past a boundary passed quiet, was told of an update round of
    its epoch (``Membership.round_opened``: a DiLoCo wrapper joins it at its next step)."""
    return {"opened": torch_pccl.elastic.topology.elastic_group().membership.round_opened}


def recover():
    """``update_topology(admit=False)``: a recovery round, as DiLoCo joins one."""
    change = torch_pccl.update_topology(admit=False)
    return {"change_epoch": change.epoch, **world()}


def retry_all_reduce(n=1000):
    t = torch.full((n,), value_of())
    changes = torch_pccl.all_reduce_with_retry(t)
    return {"result": t[0].item(), "uniform": bool((t == t[0]).all()),
            "changes": len(changes), **world()}


def update():
    change = torch_pccl.update_topology()
    return {"change_epoch": change.epoch, "change_rank": change.rank,
            "change_world_size": change.world_size, "joined": list(change.joined),
            "left": list(change.left), **world()}


def new_group():
    try:
        dist.new_group(backend="pccl")
    except torch_pccl.InvalidUsageError as exc:
        return {"refused": str(exc)}
    return {"refused": None}


def master_away():
    """Whether this member's connection to its master is down (reconnecting)."""
    return {"away": torch_pccl.elastic.topology.elastic_group().membership.client.away}


def sync(revision, fill, n=1000):
    """``sync_shared_state`` of {"w": n values ``fill``} at ``revision``: what this peer
    holds afterwards."""
    state = {"w": torch.full((n,), float(fill))}
    res = torch_pccl.sync_shared_state(state, revision)
    return {"value": state["w"][0].item(), "uniform": bool((state["w"] == state["w"][0]).all()),
            "revision": res.revision, **world()}


COMMANDS = {
    "master_away": master_away,
    "sync": sync,
    "new_group": new_group,
    "all_reduce": all_reduce,
    "loop_all_reduce": loop_all_reduce,
    "retry_all_reduce": retry_all_reduce,
    "complete_alone": complete_alone,
    "refill_booked": refill_booked,
    "until_failure_then_update": until_failure_then_update,
    "update": update,
    "pending": pending,
    "round_opened": round_opened,
    "recover": recover,
    "world": world,
}


def join(master, timeout_s, retry=False):
    """``init_process_group`` through ``pccl://master``; with ``retry``, again for as long
    as it fails (a master that dies while this peer is pending, or is not up yet): a
    joiner in a tight retry loop. Each failure goes to stderr; returns their count."""
    # timeout_s None: c10d's default (30 min), i.e. no deadline chosen by the test.
    kw = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    failures = 0
    pace = threading.Event()
    while True:
        try:
            dist.init_process_group(backend="pccl", init_method=f"pccl://{master}", **kw)
            return failures
        except torch_pccl.PcclError as exc:
            if not retry:
                raise
            failures += 1
            print(f"join attempt {failures} failed: {type(exc).__name__}: {exc}",
                  file=sys.stderr, flush=True)
            pace.wait(0.05)     # pacing a retry loop, not synchronisation


def join_and_serve(master, timeout_s, lines, commands, retry=False):
    """Joins the pccl:// world, says "ready" (with ``failures``, the join attempts that
    failed), then answers each command line with an event of the same name (or its
    exception) until "exit" leaves the group cleanly."""
    failures = join(master, timeout_s, retry)
    emit(event="ready", failures=failures, **world())
    for line in lines:
        cmd = json.loads(line)
        name = cmd.pop("cmd")
        if name == "exit":
            dist.destroy_process_group()
            emit(event="bye")
            return
        try:
            emit(event=name, **commands[name](**cmd))
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
            emit(event=name, exception=error_record(exc, time.monotonic()))


def standby_then_serve(master, timeout_s, commands, retry=False):
    """Waits for a "join" line on stdin (the test decides when this peer registers), then
    ``join_and_serve``; returns at once if stdin closes first."""
    lines = iter(sys.stdin)
    for line in lines:
        if json.loads(line)["cmd"] == "join":
            break
    else:
        return
    join_and_serve(master, timeout_s, lines, commands, retry)


def main():
    """``python elastic_worker.py MASTER TIMEOUT_S [join|standby|retry]``: join at once, or
    wait for a "join" command (standby), or wait for it and retry the join until admitted."""
    torch.set_num_threads(1)
    master = sys.argv[1]
    timeout_s = None if sys.argv[2] == "default" else float(sys.argv[2])
    emit(event="started", pid=os.getpid())
    mode = sys.argv[3] if len(sys.argv) > 3 else "join"
    if mode == "join":
        join_and_serve(master, timeout_s, sys.stdin, COMMANDS)
    else:
        standby_then_serve(master, timeout_s, COMMANDS, retry=mode == "retry")


if __name__ == "__main__":
    main()
