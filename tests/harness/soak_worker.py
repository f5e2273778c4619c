"""One peer of the churn soak (tests/harness/soak.py), driven over stdin/stdout with JSON lines.

``python tests/harness/soak_worker.py MASTER_ADDR H COUNT_FILE`` imports torch, says
``started`` and waits as a standby for a ``join`` line; then it joins the ``pccl://`` world,
builds a small MLP with a DiLoCo wrapper (``sync_every=H``) and trains until it is killed,
stopped or fails (with ``SOAK_QUORUM=min_peers,grace`` in its environment, the DiLoCo has
that ``Quorum``). After every outer step it prints the step, the world size, a sha256 of the
outer parameters, the loss and how long ``DiLoCo.step()`` took; after every inner step it
writes its inner-step count to COUNT_FILE (8 bytes), so the driver can tell how much work a
killed peer lost. A network error ends it with an ``error`` line and exit status 3.
"""

import hashlib
import json
import os
import struct
import sys
import time
import zlib

import torch
import torch.distributed as dist

STEP_COMPUTE_S = 0.01   # simulated compute per inner step (not synchronisation: nothing waits on it)


def emit(**msg):
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def main():
    torch.set_num_threads(1)
    master, H, count_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    name = os.environ["PCCL_PEER_ID"]
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)   # pays the lazy imports
    import torch_pccl.algorithms.diloco  # noqa: F401
    import torch_pccl.elastic.shared_state  # noqa: F401
    emit(event="started", pid=os.getpid())
    if not sys.stdin.readline():
        return
    dist.init_process_group(backend="pccl", init_method=f"pccl://{master}")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    teacher = torch.randn(8, 8, generator=torch.Generator().manual_seed(7)) / 8 ** 0.5
    try:
        quorum = os.environ.get("SOAK_QUORUM")
        if quorum:                      # "min_peers,grace": the soak's quorum option
            min_peers, grace = quorum.split(",")
            quorum = torch_pccl.Quorum(int(min_peers), float(grace))
        d = torch_pccl.DiLoCo(model, inner, sync_every=H, max_retries=5, quorum=quorum or None)
        emit(event="joined", rank=dist.get_rank(), world=dist.get_world_size(),
             step=d.step_count)
        t = d.step_count * H
        with open(count_path, "wb", buffering=0) as counter:
            done = 0
            while True:
                t += 1
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 100_003 + t)
                x = torch.randn(32, 8, generator=g)
                loss = torch.nn.functional.mse_loss(model(x), x @ teacher)
                inner.zero_grad(set_to_none=True)
                loss.backward()
                inner.step()
                time.sleep(STEP_COMPUTE_S)
                done += 1
                counter.seek(0)
                counter.write(struct.pack("<q", done))
                started = time.monotonic()
                o = d.step()
                if o is not None:
                    outer = torch.cat([p.reshape(-1) for p in d.outer_parameters])
                    emit(event="outer", step=o.step, world=o.world_size,
                         digest=hashlib.sha256(outer.numpy().tobytes()).hexdigest(),
                         loss=loss.item(), seconds=time.monotonic() - started, inner=done,
                         joined=list(o.joined), left=list(o.left))
    except torch_pccl.PcclError as exc:
        emit(event="error", type=type(exc).__name__, message=str(exc)[:500])
        sys.exit(3)


if __name__ == "__main__":
    main()
