"""A sharded replica's process sees its shard's ring of the master's epoch
(torch_pccl/elastic/assignment.py: ``Assignment.ring``, ``ring_comm_id``). Pure."""

import pytest

from torch_pccl.elastic.assignment import Assignment, ring_comm_id


def epoch(rank, done=()):
    # Replicas a, b, c of 2 shards each, as the master orders a fresh group.
    return Assignment(epoch=3, comm_id=0x1234, rank=rank, world_size=6,
                      addrs=tuple(f"10.0.0.{i}:{4000 + i}" for i in range(6)),
                      peer_ids=("a0", "a1", "b0", "b1", "c0", "c1"),
                      joined=("c0", "c1"), left=("d0", "d1"), done=done,
                      replicas=("a", "a", "b", "b", "c", "c"), shards=(0, 1, 0, 1, 0, 1))


def test_each_shard_sees_its_own_ring_in_replica_order():
    ring, ranks = epoch(3, done=(2, 2, 2, 1, -1, -1)).ring(1)
    assert ranks == (1, 3, 5)
    assert (ring.rank, ring.world_size) == (1, 3)
    assert ring.peer_ids == ("a1", "b1", "c1")
    assert ring.addrs == ("10.0.0.1:4001", "10.0.0.3:4003", "10.0.0.5:4005")
    assert ring.joined == ("c1",) and ring.done == (2, 1, -1)
    assert ring.epoch == 3
    # Every replica is at the same ring rank in every ring.
    zero, _ = epoch(2).ring(0)
    assert zero.rank == ring.rank and zero.peer_ids == ("a0", "b0", "c0")


def test_rings_have_communicator_ids_of_their_own():
    assert epoch(0).ring(0)[0].comm_id == 0x1234
    ids = {ring_comm_id(0x1234, s) for s in range(8)}
    assert len(ids) == 8 and all(0 <= i < 2**64 for i in ids)
    assert ring_comm_id(0x1234, 3) == ring_comm_id(0x1234, 3)
    assert ring_comm_id(0x1235, 3) != ring_comm_id(0x1234, 3)


def test_a_member_of_another_shard_or_a_plain_epoch_has_no_ring():
    with pytest.raises(ValueError):
        epoch(3).ring(0)
    plain = Assignment(epoch=1, comm_id=1, rank=0, world_size=1, addrs=("h:1",),
                       peer_ids=("p",), joined=(), left=())
    with pytest.raises(ValueError):
        plain.ring(0)
