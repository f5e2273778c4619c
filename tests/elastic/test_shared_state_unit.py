"""Shared-state sync (issue 4), the parts that need no process group: entry hashes,
the content digest, the transfer plan (``plan_pieces``) and the argument checks
``sync_shared_state`` makes before any communication."""

import itertools
from collections import defaultdict

import pytest
import torch
import xxhash

import torch_pccl
from torch_pccl.elastic.shared_state import (
    STRATEGIES,
    Piece,
    SharedState,
    content_digest,
    plan_pieces,
    state_hashes,
    sync_shared_state,
)

pytestmark = [pytest.mark.timeout(60)]

HEX = set("0123456789abcdef")


def raw(t):
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def sample_state():
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(5, 3, generator=g),
        "bf16": torch.randn(17, generator=g).to(torch.bfloat16),
        "f16": torch.randn(2, 2, generator=g).to(torch.float16),
        "f64": torch.randn(3, generator=g, dtype=torch.float64),
        "i64": torch.arange(-3, 9, dtype=torch.int64),
        "u8": torch.arange(0, 250, 7, dtype=torch.uint8),
        "flag": torch.tensor([True, False, True]),
        "step": torch.tensor(41, dtype=torch.int64),     # 0-dim
        "empty": torch.empty(0, 4),                      # no bytes
    }


def clone(state):
    return {k: v.clone() for k, v in state.items()}


# -- state_hashes ----------------------------------------------------------------


def test_state_hashes_are_xxh3_128_of_the_bytes_for_every_dtype_and_shape():
    state = sample_state()
    hashes = state_hashes(state)
    assert set(hashes) == set(state)
    for name, t in state.items():
        h = hashes[name]
        assert len(h) == 32 and set(h) <= HEX, (name, h)
        assert h == xxhash.xxh3_128_hexdigest(raw(t)), name
    assert hashes["empty"] == xxhash.xxh3_128_hexdigest(b"")
    # Also exported at the top level (the API).
    assert torch_pccl.state_hashes(state) == hashes


def test_state_hashes_are_stable_and_see_every_single_byte():
    state = sample_state()
    first = state_hashes(state)
    assert state_hashes(state) == first                 # stable across calls
    assert state_hashes(clone(state)) == first          # depends on bytes, not identity
    for name, t in state.items():
        n = t.numel() * t.element_size()
        for pos in sorted({0, n // 2, n - 1}) if n else ():
            changed = clone(state)
            changed[name].reshape(-1).view(torch.uint8)[pos] ^= 0x01     # one bit
            h = state_hashes(changed)
            assert h[name] != first[name], (name, pos)
            assert {k: v for k, v in h.items() if k != name} == {
                k: v for k, v in first.items() if k != name}


def test_state_hashes_of_float_specials_follow_bytes_not_values():
    # +0.0 == -0.0 and NaN != NaN as values; the hash is of the bytes.
    a = {"x": torch.tensor([0.0, float("nan")])}
    b = {"x": torch.tensor([-0.0, float("nan")])}
    assert state_hashes(a) != state_hashes(b)
    assert state_hashes(a) == state_hashes(clone(a))


def test_state_hashes_leave_out_allow_divergence_and_accept_shared_state():
    state = sample_state()
    full = state_hashes(state)
    part = state_hashes(state, allow_divergence=("w", "step"))
    assert set(part) == set(state) - {"w", "step"}
    assert all(part[k] == full[k] for k in part)
    assert state_hashes(SharedState(state, allow_divergence=("w",))) == {
        k: v for k, v in full.items() if k != "w"}


# -- content_digest --------------------------------------------------------------


def test_content_digest_changes_with_name_dtype_shape_and_value():
    state = sample_state()
    d = content_digest(state)
    assert len(d) == 32 and set(d) <= HEX
    assert content_digest(clone(state)) == d

    renamed = clone(state)
    renamed["w2"] = renamed.pop("w")
    assert content_digest(renamed) != d

    # Same bytes, other dtype: float32 zeros and int32 zeros are the same bytes.
    zeros_f = {"z": torch.zeros(4, dtype=torch.float32)}
    zeros_i = {"z": torch.zeros(4, dtype=torch.int32)}
    assert state_hashes(zeros_f) == state_hashes(zeros_i)
    assert content_digest(zeros_f) != content_digest(zeros_i)

    # Same bytes, other shape.
    reshaped = clone(state)
    reshaped["w"] = reshaped["w"].reshape(3, 5).contiguous()
    assert state_hashes(reshaped)["w"] == state_hashes(state)["w"]
    assert content_digest(reshaped) != d
    assert content_digest({"s": torch.tensor(1.0)}) != content_digest({"s": torch.tensor([1.0])})
    assert content_digest({"e": torch.empty(0, 4)}) != content_digest({"e": torch.empty(4, 0)})

    value = clone(state)
    value["i64"][3] += 1
    assert content_digest(value) != d

    extra = clone(state)
    extra["more"] = torch.zeros(1)
    assert content_digest(extra) != d
    fewer = clone(state)
    del fewer["flag"]
    assert content_digest(fewer) != d


def test_content_digest_ignores_insertion_order_and_allow_divergence_entries():
    state = sample_state()
    d = content_digest(state)
    for perm in itertools.islice(itertools.permutations(state), 0, 50, 7):
        assert content_digest({k: state[k] for k in perm}) == d
    assert content_digest(dict(reversed(list(state.items())))) == d

    a = clone(state)
    b = clone(state)
    b["w"].add_(1.0)                       # diverged, but allowed to
    b["rng"] = torch.arange(3)             # only on one side, but allowed to differ
    assert content_digest(a) != content_digest(b)
    da = content_digest(a, allow_divergence=("w",))
    assert da == content_digest(b, allow_divergence=("w", "rng"))
    assert da == content_digest(SharedState(b, allow_divergence=("w", "rng")))
    assert da == content_digest({k: v for k, v in a.items() if k != "w"})


# -- plan_pieces -----------------------------------------------------------------


def check_plan(pieces, wanted, nbytes, sources, piece_bytes):
    """Every wanted byte exactly once, only wanted bytes, within piece_bytes, balanced."""
    assert all(isinstance(p, Piece) for p in pieces)
    covered = defaultdict(list)
    load = defaultdict(lambda: defaultdict(int))
    for p in pieces:
        assert p.receiver in wanted and p.entry in wanted[p.receiver], p
        assert p.source in sources, p
        assert 0 < p.length <= piece_bytes, p
        assert 0 <= p.offset and p.offset + p.length <= nbytes[p.entry], p
        covered[(p.receiver, p.entry)].append((p.offset, p.length))
        load[p.receiver][p.source] += p.length
    for receiver, entries in wanted.items():
        for e in entries:
            spans = sorted(covered.pop((receiver, e), []))
            end = 0
            for off, length in spans:
                assert off == end, f"receiver {receiver} entry {e}: gap or overlap at {off}"
                end += length
            assert end == nbytes[e], f"receiver {receiver} entry {e}: {end} of {nbytes[e]} bytes"
        total = sum(nbytes[e] for e in entries)
        if total:
            per_source = [load[receiver][s] for s in sources]
            assert sum(per_source) == total
            assert max(per_source) - min(per_source) <= piece_bytes, (receiver, per_source)
    assert not covered
    return load


def test_plan_covers_every_wanted_byte_once_and_spreads_over_sources():
    nbytes = [10_000, 1, 4096, 0, 12_288, 999, 4097, 100_000]
    piece = 4096
    cases = [
        ({3: [0, 1, 2, 3, 4, 5, 6, 7]}, [0, 1, 2]),
        ({0: [7], 5: [0, 4]}, [1, 2, 3]),
        ({2: [1]}, [0]),
        ({4: [0, 7], 5: [2, 6], 6: [3]}, [0, 1, 2, 3]),
        ({1: []}, [0]),
    ]
    for wanted, sources in cases:
        pieces = plan_pieces(wanted, nbytes, sources, piece)
        check_plan(pieces, wanted, nbytes, sources, piece)
        assert plan_pieces(wanted, nbytes, sources, piece) == pieces     # deterministic


def test_plan_balances_a_large_download_over_all_sources():
    nbytes = [48 << 20, 3 << 20, (5 << 20) + 3]
    sources = [0, 1, 2]
    pieces = plan_pieces({3: [0, 1, 2]}, nbytes, sources, 4 << 20)
    load = check_plan(pieces, {3: [0, 1, 2]}, nbytes, sources, 4 << 20)
    assert all(load[3][s] > 0 for s in sources)
    # Default piece size: also bounded, also spread.
    pieces = plan_pieces({3: [0]}, nbytes, sources)
    assert len({p.source for p in pieces}) == 3
    assert max(p.length for p in pieces) < nbytes[0]


def test_plan_gives_no_piece_for_zero_byte_entries():
    assert plan_pieces({1: [0, 1]}, [0, 0], [0], 8) == []
    pieces = plan_pieces({1: [0, 1, 2]}, [0, 5, 0], [0], 8)
    assert [(p.entry, p.offset, p.length) for p in pieces] == [(1, 0, 5)]


def test_plan_piece_boundaries():
    pieces = plan_pieces({1: [0]}, [16], [0], 8)
    assert [(p.offset, p.length) for p in pieces] == [(0, 8), (8, 8)]
    pieces = plan_pieces({1: [0]}, [17], [0], 8)
    assert [(p.offset, p.length) for p in pieces] == [(0, 8), (8, 8), (16, 1)]
    pieces = plan_pieces({2: [0]}, [16], [0, 1], 1)
    check_plan(pieces, {2: [0]}, [16], [0, 1], 1)
    assert sum(p.source == 0 for p in pieces) == sum(p.source == 1 for p in pieces) == 8


def test_plan_rejects_bad_input():
    with pytest.raises(ValueError):
        plan_pieces({0: [0]}, [10], [0, 1], 4)           # a receiver that is also a source
    with pytest.raises(ValueError):
        plan_pieces({2: [0]}, [10], [], 4)               # nobody to fetch from
    with pytest.raises(ValueError):
        plan_pieces({2: [1]}, [10], [0], 4)              # no such entry
    with pytest.raises(ValueError):
        plan_pieces({2: [0]}, [10], [0], 0)              # piece_bytes must be > 0


# -- sync_shared_state: argument checks before any communication -------------------
#
# No process group exists in this process: a check that came after the group
# lookup would raise InvalidUsageError (or ValueError from c10d) instead, so
# each expected exception below also shows that the check comes first.


def good_state():
    return {"w": torch.zeros(4), "step": torch.tensor(0)}


@pytest.mark.parametrize("state, exc, match", [
    ({"w": torch.zeros(4, 4).t()}, torch_pccl.InvalidArgumentError, "contiguous"),
    ({"w": torch.zeros(4, device="meta")}, torch_pccl.InvalidArgumentError, "CPU"),
    ({"w": torch.zeros(4).to_sparse()}, torch_pccl.InvalidArgumentError, "'w'"),
    ({1: torch.zeros(4)}, TypeError, "str"),
    ({"w": [0.0, 1.0]}, TypeError, "tensor"),
    ([torch.zeros(4)], TypeError, "mapping"),
])
def test_sync_rejects_bad_state_first(state, exc, match):
    with pytest.raises(exc, match=match):
        sync_shared_state(state, 0)
    if exc is torch_pccl.InvalidArgumentError:
        assert issubclass(exc, ValueError)


@pytest.mark.parametrize("kwargs, match", [
    (dict(strategy="bogus"), "strategy"),
    (dict(strategy="ENFORCE_POPULAR"), "strategy"),
    (dict(revision=-1), "revision"),
    (dict(revision=2**63), "revision"),
    (dict(revision=1.0), "revision"),
    (dict(revision=True), "revision"),
    (dict(max_retries=-1), "max_retries"),
    (dict(allow_divergence=("nope",)), "nope"),
])
def test_sync_rejects_bad_arguments_first(kwargs, match):
    kwargs = {"revision": 0, **kwargs}
    with pytest.raises(ValueError, match=match) as info:
        sync_shared_state(good_state(), **kwargs)
    assert isinstance(info.value, torch_pccl.InvalidArgumentError)


def test_sync_rejects_bad_allow_divergence_in_shared_state():
    with pytest.raises(torch_pccl.InvalidArgumentError, match="nope"):
        SharedState(good_state(), allow_divergence=("nope",))


def test_sync_without_a_process_group_is_invalid_usage():
    assert not torch.distributed.is_initialized()
    with pytest.raises(torch_pccl.InvalidUsageError):
        sync_shared_state(good_state(), 0)


def test_sync_on_a_group_without_master_is_invalid_usage():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(torch_pccl.InvalidUsageError):
            sync_shared_state(good_state(), 0)
    finally:
        dist.destroy_process_group()


def test_sync_on_a_pccl_group_without_master_is_invalid_usage(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("PCCL_MASTER", "0")
    dist.init_process_group("pccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(torch_pccl.InvalidUsageError, match="master"):
            sync_shared_state(good_state(), 0)
    finally:
        dist.destroy_process_group()


# -- a world of one in this process (fixed world, the auto master in a thread) -------


def test_world_of_one_syncs_without_traffic_and_keeps_the_revision_rule():
    import torch.distributed as dist

    dist.init_process_group("pccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        state = sample_state()
        before = {k: raw(v) for k, v in state.items()}
        res = sync_shared_state(state, 5)
        assert isinstance(res, torch_pccl.SyncResult)
        assert (res.revision, res.content, res.bytes_sent, res.bytes_received, res.changed,
                res.sources, res.retries) == (5, content_digest(state), 0, 0, (), (0,), 0)
        assert res.seconds >= 0
        assert {k: raw(v) for k, v in state.items()} == before
        assert sync_shared_state(state, 5).revision == 5          # the same revision again
        assert sync_shared_state(SharedState(state, ("w",)), 6).content == content_digest(
            state, allow_divergence=("w",))
        with pytest.raises(torch_pccl.InvalidUsageError, match="revision"):
            sync_shared_state(state, 8)
        with pytest.raises(torch_pccl.InvalidUsageError, match="revision"):
            sync_shared_state(state, 5)
        with pytest.raises(torch_pccl.InvalidUsageError, match="receive_only"):
            sync_shared_state(state, 6, strategy="receive_only")
        assert sync_shared_state(state, 7, strategy="send_only").revision == 7
        assert {k: raw(v) for k, v in state.items()} == before
    finally:
        dist.destroy_process_group()


def test_public_api():
    import dataclasses

    assert STRATEGIES == ("enforce_popular", "receive_only", "send_only")
    fields = [f.name for f in dataclasses.fields(torch_pccl.SyncResult)]
    assert fields == ["revision", "content", "bytes_sent", "bytes_received", "changed",
                      "sources", "retries", "seconds"]
    assert torch_pccl.SyncResult.__dataclass_params__.frozen
    for name in ("sync_shared_state", "state_hashes", "content_digest", "SharedState",
                 "SyncResult"):
        assert hasattr(torch_pccl, name), name
