"""A pccl group c10d did not create (a sharded replica's shard ring, formed beside the
replica's own default group) is listed in c10d's maps: a failing ``dist.*`` collective on
it raises its ``PcclError``, not the ``ValueError`` of c10d's logger looking the group up.

World size 1, in this process: a gloo default group and one pccl group.
"""

import pytest
import torch
import torch.distributed as dist

from torch_pccl import Communicator
from torch_pccl.c10d.process_group import ProcessGroupPCCL
from torch_pccl.c10d.torch_internals import forget_outside_group, register_outside_group
from torch_pccl.errors import AbortedError


def test_a_failing_collective_on_an_outside_group_raises_its_pccl_error(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    comm = Communicator(0, 1, 11, "127.0.0.1", 3.0)
    comm.connect([f"127.0.0.1:{comm.port}"])
    pg = ProcessGroupPCCL(comm, timeout_s=3.0)
    try:
        register_outside_group(pg, pg.rank())
        assert dist.get_backend(pg) == "pccl" and dist.get_rank(pg) == 0
        dist.all_reduce(torch.ones(2), group=pg)          # works as before
        comm.lanes[0].abort()
        with pytest.raises(AbortedError):
            dist.all_reduce(torch.ones(2), group=pg)
        forget_outside_group(pg)
        with pytest.raises(ValueError):
            dist.get_backend(pg)
    finally:
        pg.abort()
        dist.destroy_process_group()
