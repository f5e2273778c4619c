"""Sharded replicas (issue 39): the DiLoCo wrappers on a model whose parameters are DTensors,
and ``replica_layout``.

A replica sharded over 2 processes (FSDP2 ``fully_shard`` or tensor parallel over a 1-D CPU
mesh, gloo, in a pool of 2 spawned workers: tests/harness/pool.py, every wait bounded, the
workers killed at the end) runs each wrapper against a simulated second replica
(tests/harness/shards_code.py's ``SecondReplica``: the group across replicas, faked in each
process), and the same model unsharded runs in the same worker against the same second
replica. The wrappers must work on the local shards only (outer parameters, shared state
and error feedback shaped like them) and end on the unsharded run's outer parameters once
the shards are gathered:

- FSDP2 computes every forward and backward on the gathered parameters (each shard feeds
  the same batch, and the gradients' average over the 2 shards is exact), so its runs must
  be bit-identical to the unsharded ones;
- tensor parallel splits a matmul's inner sum in two: the results differ by float64
  rounding in summation order only (measured: at most 1.1e-16 after 5 inner steps), so
  they are compared at 1e-12, about ten thousand times that, while every outer parameter
  moves by more than 1e-3 (checked), as much as a mixed-up element would be off.

The sparse exchange (``compression=TopK``) chunks the flat buffer of the local shards,
whose chunk boundaries differ from the unsharded buffer's: there only its per-shard state
is checked.
"""

import re

import pytest
import torch

import torch_pccl.elastic.replica_layout as replica_layout_module

from harness.pool import WorkerPool
from torch_pccl.algorithms.diloco import ReplicaLayout, replica_layout, shards

pytestmark = pytest.mark.timeout(300)

SEED = 39
STEPS = 5                 # H = 2: two outer steps, and the last round left in flight
ATOL_SUMMATION_ORDER = 1e-12


@pytest.fixture(scope="module")
def shard_pair():
    """2 workers, gloo, world 2: the two shards of one replica."""
    pool = WorkerPool(2, "gloo", with_gloo=False)
    try:
        yield pool
    finally:
        pool.broken = True            # no graceful exit needed: terminate, kill, join
        pool.close()


def _run(pool, fn, *args):
    return pool.run(f"shards_code.{fn}", *args, deadline_s=120)


# -- the wrappers on the local shards ----------------------------------------------------


@pytest.mark.parametrize("kind", ["fsdp", "tp"])
def test_writes_to_the_local_shards_reach_the_forward(shard_pair, kind):
    # fsdp: fully_shard on the root only, so a forward without backward leaves every
    # parameter unsharded; the wrapper's writes must still reach the next forward.
    for rank, res in enumerate(_run(shard_pair, "writes_reach_forward", kind, SEED)):
        assert res["outer_numels"] == res["local_numels"], f"rank {rank}: {res}"
        assert sum(res["local_numels"]) < sum(res["global_numels"]), f"rank {rank}: {res}"
        for how in ("load_outer", "load_state_dict"):
            got, want = res[how]["loss"], res[how]["want"]
            assert got == pytest.approx(want, abs=ATOL_SUMMATION_ORDER, rel=0), (
                f"rank {rank}, {how}: the model computes loss {got}, the outer parameters "
                f"give {want}")


CASES = [("fsdp", w) for w in ("diloco", "diloco_int8", "diloco_quorum", "streaming", "async")]
CASES += [("fsdp_nested", "diloco"), ("tp", "diloco"), ("tp", "streaming"), ("tp", "async")]


@pytest.mark.parametrize("kind,wrapper", CASES, ids=[f"{k}-{w}" for k, w in CASES])
def test_sharded_replica_matches_the_unsharded_one(shard_pair, kind, wrapper):
    exact = kind != "tp"
    atol = 0.0 if exact else ATOL_SUMMATION_ORDER
    for rank, res in enumerate(_run(shard_pair, "run_sharded_and_unsharded", kind, wrapper,
                                    SEED, STEPS)):
        sharded = 0
        for name, p in res["params"].items():
            where = f"rank {rank}, {name}"
            assert p["dtensor"], f"{where}: not a DTensor"
            assert p["outer_shape"] == p["local_shape"], f"{where}: {p}"
            assert res["synced"][f"outer/{name}"] == p["local_shape"], where
            sharded += p["local_numel"] < p["global_numel"]
            assert p["moved"] > 1e-3, f"{where}: the outer parameters did not move: {p}"
            assert p["outer_diff"] <= atol, f"{where}: outer parameters off by {p['outer_diff']}"
            assert p["param_diff"] <= atol, f"{where}: model after finish() off by {p['param_diff']}"
        assert sharded >= 3, f"rank {rank}: {sharded} parameters split over the shards"
        assert res["losses"] == pytest.approx(res["ref_losses"], abs=atol, rel=0), rank


def test_sparse_exchange_keeps_error_feedback_per_local_shard(shard_pair):
    for rank, res in enumerate(_run(shard_pair, "run_sharded_and_unsharded", "fsdp",
                                    "diloco_topk", SEED, STEPS)):
        local = sum(p["local_numel"] for p in res["params"].values())
        assert res["accumulators"] == [local], f"rank {rank}: {res['accumulators']}"
        for name, p in res["params"].items():
            assert res["synced"][f"outer/{name}"] == p["local_shape"], (rank, name)
            assert p["moved"] > 1e-3, (rank, name, p)


# -- replica_layout ----------------------------------------------------------------------


def test_replica_layout_is_the_same_on_every_shard_and_tells_layouts_apart(shard_pair):
    results = _run(shard_pair, "layouts", SEED)
    assert results[0] == results[1], "the two shards of one replica disagree"
    res = results[0]
    digests = {k: v[0] for k, v in res.items()}
    # fsdp and tp: the same names, shapes and dtypes; only the placements differ.
    assert len(set(digests[k] for k in ("fsdp", "tp", "fsdp_4_shards", "plain"))) == 4, digests
    # A forward without backward leaves FSDP2's root unsharded: the layout is unchanged.
    assert digests["fsdp_after_forward"] == digests["fsdp"]
    assert "Shard(dim=0)" in res["fsdp"][1] and "mesh (2,)" in res["fsdp"][1], res["fsdp"]
    assert "Shard(dim=1)" in res["tp"][1] and "Replicate()" in res["tp"][1], res["tp"]


class Net(torch.nn.Module):
    def __init__(self, width=4, dtype=torch.float32, frozen=False):
        super().__init__()
        self.a = torch.nn.Linear(3, width, dtype=dtype)
        self.b = torch.nn.Linear(width, 2, dtype=dtype)
        if frozen:
            self.b.bias.requires_grad_(False)


def test_replica_layout_of_plain_models():
    layout = replica_layout(Net(), 1)
    assert isinstance(layout, ReplicaLayout)
    assert re.fullmatch(r"[0-9a-f]{32}", layout.digest), layout.digest
    assert layout == replica_layout(Net(), 1), "another instance (other values), same layout"
    assert layout.description == "1 shard; 4 tensors, 26 elements, float32"
    others = [replica_layout(Net(), 2), replica_layout(Net(width=5), 1),
              replica_layout(Net(dtype=torch.float64), 1), replica_layout(Net(frozen=True), 1)]
    renamed = Net()
    renamed.c = renamed.a
    del renamed.a
    others.append(replica_layout(renamed, 1))
    digests = [layout.digest] + [o.digest for o in others]
    assert len(set(digests)) == len(digests), digests


def test_replica_layout_description_is_short():
    mixed = torch.nn.Sequential(*[torch.nn.Linear(2, 2, dtype=dt) for _ in range(30) for dt in
                                  (torch.float32, torch.float64, torch.bfloat16)])
    assert replica_layout(mixed, 8).description == \
        "8 shards; 180 tensors, 540 elements, float32+float64+bfloat16"
    # Many different placements (a DTensor's are listed once per distinct kind): cut at 200.
    entries = [{"name": f"w{i}", "shape": [2], "dtype": "float32",
                "placements": [f"Shard(dim={i})"], "mesh": [2]} for i in range(40)]
    text = replica_layout_module._describe(2, entries)
    assert len(text) == 200 and text.endswith("..."), text


def test_replica_layout_rejects_bad_arguments():
    for shards in (0, -1, 1.0, True, "2"):
        with pytest.raises(ValueError, match="shards must be an int >= 1"):
            replica_layout(Net(), shards)
    frozen = Net().requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter with requires_grad"):
        replica_layout(frozen, 1)
