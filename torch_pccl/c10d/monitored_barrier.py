"""A barrier that names the ranks that did not arrive (c10d's ``monitored_barrier``).

gloo's algorithm (``ProcessGroupGloo::monitoredBarrier``): every rank but 0
sends rank 0 a token and waits for its answer; rank 0 receives the tokens,
from any source, until the deadline, and answers every rank once all are in.
If the deadline passes first, rank 0 raises naming the ranks whose token did
not come (the first of them, or all with ``wait_all_ranks``), and its failure
reaches the others as an error on their wait. The messages are gloo's, which
torch's tests and users' log filters match.

A failed monitored barrier leaves the group's communicator failed (a timeout
is sticky, as every network error is): it is a debugging aid that stops a run
which has lost a rank, as it does on gloo.
"""

from __future__ import annotations

import time

import torch

from ..core.communicator import Communicator
from ..errors import PcclError, PcclTimeoutError

# Tag of the barrier's point-to-point messages, apart from users' tags.
TAG = 0x6D626172  # "mbar"


def run(comm: Communicator, timeout_s: float, wait_all_ranks: bool) -> None:
    """Returns once every rank of ``comm`` has called it; raises naming the ranks that did not.

    Args:
        comm: the communicator (the group's lane 0).
        timeout_s: seconds rank 0 waits for the others, and the others for rank 0;
            0 fails at once.
        wait_all_ranks: name every missing rank, not only the lowest.

    Raises:
        PcclTimeoutError (or the class of the failure that ended the wait, such as
            PeerLostError): on rank 0, "Rank 1 failed to pass monitoredBarrier in
            2000 ms" ("Ranks 1, 3 ..." with ``wait_all_ranks``), or "Rank 0 timed
            out in monitoredBarrier after 0 ms" for a zero timeout.
        PcclError (the class of the failure): on the other ranks, "Rank 2
            successfully reached monitoredBarrier, but received errors while
            waiting for send/recv from rank 0 ...", with the cause chained.
    """
    me, n = comm.rank, comm.world_size
    ms = round(timeout_s * 1000)
    if n == 1:
        return
    if timeout_s <= 0:
        raise PcclTimeoutError(f"Rank {me} timed out in monitoredBarrier after {ms} ms")
    deadline = time.monotonic() + timeout_s
    token = torch.zeros(1, dtype=torch.uint8)
    if me != 0:
        try:
            comm.send(token, 0, TAG, timeout_s=timeout_s)
            comm.recv(token, 0, TAG, timeout_s=max(deadline - time.monotonic(), 1e-3))
        except PcclError as exc:
            raise type(exc)(
                f"Rank {me} successfully reached monitoredBarrier, but received errors while "
                f"waiting for send/recv from rank 0. Please check rank 0 logs for faulty rank. "
                f"({exc})", exc.code, exc.detail) from exc
        return
    arrived: set[int] = set()
    try:
        while len(arrived) < n - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PcclTimeoutError(f"Timed out waiting {ms}ms for monitoredBarrier")
            arrived.add(comm.recv_any_source(token, TAG, timeout_s=left))
    except PcclError as exc:
        missing = [r for r in range(1, n) if r not in arrived]
        named = missing if wait_all_ranks else missing[:1]
        who = ("Ranks " if len(named) > 1 else "Rank ") + ", ".join(map(str, named))
        raise type(exc)(f"{who} failed to pass monitoredBarrier in {ms} ms ({exc})",
                        exc.code, exc.detail) from exc
    for r in range(1, n):
        comm.send(token, r, TAG, timeout_s=max(deadline - time.monotonic(), 1e-3))
