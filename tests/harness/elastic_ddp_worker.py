"""A DDP training loop that members and joiners run alike, for tests/algorithms/test_elastic_ddp.py.

``python tests/harness/elastic_ddp_worker.py MASTER_ADDR ROLE`` joins a ``pccl://`` world
and trains ``make_model()`` with AdamW and a StepLR scheduler through ``ElasticDDP``, in
the loop shape docs/elastic-ddp.md shows (the lines marked "test:" are this test's
instruments). ROLE ``member``, ``victim`` (SIGKILLs itself inside its backward, in a hook
on the first layer's gradient, which comes last, ten steps after the world reached 3)
or ``joiner`` (its events differ; its program is the same); for the all-or-nothing test,
``victim-before-vote`` (SIGKILLs itself after its backward of step 8, before its vote) and
``alone`` (whose vote of that step completes by itself, see ``book_vote_alone``).

Every rank stops at the same step: 20 steps after the boundary where the world shrank,
a count every survivor holds alike (steps are applied everywhere or nowhere). JSON lines
on stdout: ``started``; ``trained`` (members, once, after 5 steps: the test starts the
joiner then); ``done`` with the survivor's digest of the run's whole shared state, its
losses, the worlds it saw, the errors its loop caught, and for the first step of every
new world the parameters before it and the averaged gradient (the test recomputes it).
"""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import torch_pccl

MAX_STEPS = 3000
AFTER_DROP = 20     # steps trained after the world shrank
KILL_AFTER = 10     # the victim dies this many steps after the world reached 3
BOOK_AT = 8         # "alone" completes this step's vote by itself; "victim-before-vote" dies


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 1))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: 16 points of a fixed smooth target."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g)
    teacher = torch.linspace(-1.0, 1.0, 8)
    return x, torch.sin(x @ teacher).unsqueeze(1)


def flat(tensors) -> list[float]:
    return torch.cat([t.detach().reshape(-1) for t in tensors]).tolist()


def eval_loss(net: nn.Module) -> float:
    x, y = batch(10**6, 0)
    net.eval()
    with torch.no_grad():
        loss = nn.functional.mse_loss(net(x), y).item()
    net.train()
    return loss


def book_vote_alone(model) -> None:
    """This peer's vote of the current step completes here alone, as when a peer dies after
    sending it the last bytes of the vote and before sending them to the others (booked by
    hand: that window is too narrow to hit on purpose); the step is applied here, in place
    of ``step()``."""
    model._broadcast_buffers()          # step() up to its vote, with the others
    ledger = model._transport
    ledger.begin_exchange(model._vote)
    ledger.end_exchange(model._vote)
    model._apply()


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def main() -> None:
    torch.set_num_threads(1)
    master, role = sys.argv[1], sys.argv[2]
    emit("started")
    dist.init_process_group(backend="pccl", init_method=f"pccl://{master}")
    net = make_model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=25, gamma=0.8)
    model = torch_pccl.ElasticDDP(net, opt, sched, bucket_cap_mb=0.0005)  # several buckets
    first_loss = eval_loss(net)
    worlds = [(model.step_count, model.world_size)]
    grown_at = model.step_count if model.world_size == 3 else None
    dropped_at = None
    checks, errors, applied_late, changes = [], [], 0, []
    check_next = True          # test: the first step of a world is recomputed by the test
    trained_said = role == "joiner"
    for _ in range(MAX_STEPS):
        if dropped_at is not None and model.step_count >= dropped_at + AFTER_DROP:
            break
        x, y = batch(model.step_count, model.rank)
        try:
            opt.zero_grad()
            before = flat(net.parameters())                               # test
            if role == "victim" and grown_at is not None \
                    and model.step_count == grown_at + KILL_AFTER:        # test
                net[0].weight.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if role == "victim-before-vote" and model.step_count == BOOK_AT:      # test
                model._broadcast_buffers()      # step() up to its vote, then death
                os.kill(os.getpid(), signal.SIGKILL)
            if check_next:                                                # test
                checks.append({"step": model.step_count, "world": model.world_size,
                               "params": before, "grad": flat(p.grad for p in net.parameters())})
                check_next = False
            if role == "alone" and model.step_count == BOOK_AT:                   # test
                book_vote_alone(model)
            else:
                model.step()
        except torch_pccl.PcclError as exc:
            errors.append(f"{type(exc).__name__}: {exc}"[:300])
        b = model.boundary()
        applied_late += b.applied_late
        changes += [("joined", peer) for peer in b.joined] + [("left", peer) for peer in b.left]
        if b.world_size != worlds[-1][1]:
            worlds.append((b.step, b.world_size))
            check_next = True
            if b.world_size == 3 and grown_at is None:
                grown_at = b.step
            if b.world_size < worlds[-2][1]:
                dropped_at = b.step
        if not trained_said and model.step_count >= 5:
            emit("trained")
            trained_said = True
    digest = torch_pccl.content_digest(model.state())
    hashes = torch_pccl.state_hashes(model.state())
    emit("done", role=role, rank=model.rank, world=model.world_size, step=model.step_count,
         digest=digest, first_loss=first_loss, last_loss=eval_loss(net), worlds=worlds,
         errors=errors, checks=checks, applied_late=applied_late,
         epoch=torch_pccl.epoch(), hashes=hashes, changes=changes)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
