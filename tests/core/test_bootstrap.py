"""Communicator.bootstrap's use of the store: rank 0's communicator id is read with the
addresses, and whatever the store holds there is checked before it is used."""

import threading

import pytest
import torch
import torch.distributed as dist

from torch_pccl.core.communicator import Communicator
from torch_pccl.errors import ProtocolError

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("held", [b"not a number", b"1" * 21, str(2**64).encode(), b"-1"])
def test_a_malformed_communicator_id_in_the_store_is_refused_before_connecting(held):
    store = dist.HashStore()
    store.set("pccl/1/comm_id", held)
    store.set("pccl/1/addr/0", "127.0.0.1:9")
    with pytest.raises(ProtocolError, match="no communicator id") as info:
        Communicator.bootstrap(store, 1, 2, 5.0)
    assert len(str(info.value)) < 120  # bounded, whatever the store held


def test_two_ranks_bootstrapped_on_one_store_reduce():
    store = dist.HashStore()
    comms = [None, None]

    def run(rank):
        comms[rank] = Communicator.bootstrap(store, rank, 2, 10.0)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    try:
        assert all(c is not None for c in comms)
        held = int(store.get("pccl/1/comm_id"))
        assert 0 <= held < 2**64
        bufs = [torch.full((3,), float(r + 1)) for r in range(2)]
        threads = [threading.Thread(target=comms[r].all_reduce, args=(bufs[r],))
                   for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert bufs[0].tolist() == bufs[1].tolist() == [3.0, 3.0, 3.0]
    finally:
        for c in comms:
            if c is not None:
                c.close()
