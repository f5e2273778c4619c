"""The public seams the layers use: ProcessGroupPCCL's drain/reconfigure/timeout_s/errored,
Communicator.errored, Listener.handle, PcclWork.set_result/set_exception.

World size 1 groups in this process (a rank's own links are loopback-free), so each
test is about the seam's contract, not about the network.
"""

import threading

import pytest
import torch

from torch_pccl import Communicator, Listener, PcclWork
from torch_pccl.c10d.process_group import ProcessGroupPCCL
from torch_pccl.errors import (
    AbortedError,
    InvalidArgumentError,
    InvalidUsageError,
    PcclTimeoutError,
)


def _connected(lanes=1, timeout_s=5.0, comm_id=7):
    comm = Communicator(0, 1, comm_id, "127.0.0.1", timeout_s)
    comm.connect([f"127.0.0.1:{comm.port}"], lanes=lanes)
    return comm


def test_communicator_errored_names_the_sticky_error_of_any_lane():
    comm = _connected(lanes=2)
    try:
        assert comm.errored() is None
        comm.lanes[1].abort()                       # one lane only
        err = comm.errored()
        assert isinstance(err, AbortedError) and err.code == AbortedError.code
        with pytest.raises(AbortedError):           # what the next call on that lane raises
            comm.lanes[1].all_reduce(torch.ones(3))
        comm.lanes[0].all_reduce(torch.ones(3))     # the other lane is healthy
    finally:
        comm.close()
    assert comm.errored() is None                   # closed: nothing to report


def test_process_group_seams():
    pg = ProcessGroupPCCL(_connected(lanes=2, timeout_s=3.0), timeout_s=4.0)
    try:
        assert pg.timeout_s == 4.0 and pg.num_lanes == 2 and pg.errored() is None
        t = torch.arange(4, dtype=torch.float32)
        works = [pg.allreduce([t]) for _ in range(4)]      # async: queued on both lanes
        pg.drain()
        assert all(w.is_completed() and w.is_success() for w in works)

        old = pg.communicator
        with pytest.raises(InvalidArgumentError, match="lanes"):
            pg.reconfigure(_connected(lanes=1, comm_id=8))
        assert pg.communicator is old                      # refused: nothing swapped
        new = _connected(lanes=2, comm_id=9)
        assert pg.reconfigure(new) is old and old.closed
        assert pg.communicator is new

        new.abort()
        assert isinstance(pg.errored(), AbortedError)
    finally:
        pg.shutdown()
    with pytest.raises(InvalidUsageError):
        pg.drain()


def test_listener_handle_and_closed_listener():
    listener = Listener("127.0.0.1")
    assert listener.handle is not None and listener.port > 0
    listener.close()
    with pytest.raises(InvalidUsageError, match="closed"):
        listener.handle
    with pytest.raises(InvalidUsageError):
        Communicator(0, 1, 3, None, 5.0, listener=listener)


def test_work_resolves_through_its_public_setters():
    out = torch.zeros(2)
    ok = PcclWork([out])
    done = threading.Event()
    ok.get_future().add_done_callback(lambda _: done.set())
    ok.set_result()
    assert done.is_set() and ok.wait() and ok.result() == [out] and ok.exception() is None

    failed = PcclWork([out])
    failed.set_exception(PcclTimeoutError("slow peer"))
    assert failed.is_completed() and not failed.is_success()
    with pytest.raises(PcclTimeoutError, match="slow peer"):
        failed.wait()
