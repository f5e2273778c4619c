"""Shared state with bit parity: ``sync_shared_state`` (docs/shared-state.md).

A *shared state* is a set of named CPU tensors that every peer of a group must
hold bit for bit (parameters, outer-optimizer buffers, the step counter). One
sync, a collective of the group:

1. every peer hashes each entry (xxh3-128, from the ``xxhash`` library) into a
   *manifest* (name, dtype, shape, hash per entry, sorted by name); its
   *content digest* is the xxh3-128 of that manifest;
2. every peer sends ``(revision, strategy, fresh, content)`` to the master,
   which elects the majority content (PCCL's "enforce popular" vote, arXiv
   2505.14065) and names the *sources* (peers holding it) and the *outdated*
   peers; when nobody is outdated the sync ends here, with no data-plane traffic;
3. otherwise the lowest source broadcasts the elected manifest; each peer
   all-gathers a fixed-size status (what it wants, or why it cannot take part);
4. each outdated peer's differing entries are cut into pieces that are spread
   over *all* sources and moved at once (``Communicator.transfer_batch``: one
   connection per source), staged, verified against the elected hashes, and
   copied into the caller's tensors only when every wanted entry verified and
   a final all-reduce shows that every peer finished;
5. a network failure (a source dies mid-transfer) rebuilds the group
   (``update_topology``) and runs the sync again; staged entries that verify
   are kept, so only what is missing is fetched again.

No tensor byte goes through the master or a c10d store.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import xxhash

from .. import config
from ..core.native import byte_view
from ..errors import (
    InvalidArgumentError,
    InvalidUsageError,
    MismatchError,
    OutOfMemoryError,
    ProtocolError,
    UpdateInProgressError,
)
from ..control.protocol import SYNC_STRATEGIES as STRATEGIES
from .manifest import (
    MAX_MANIFEST_BYTES,
    Entry,
    SharedState,
    bytes_of,
    content_digest,
    digest,
    entries_of,
    hash_tensor,
    layout_problem,
    manifest_of,
    parse_manifest,
    state_hashes,
)
from .topology import RETRYABLE_ERRORS, elastic_group, update_topology
from .transfer_plan import PIECE_BYTES, Piece, allocate, memory_headroom, plan_pieces

# Tag of the sync's data-plane messages ("SSYN"), apart from the application's.
_TAG = 0x5353594E
_MESSAGE_BYTES = 256          # status: room for one error message, UTF-8
_HEADER_WORDS = 2             # status: code, bytes wanted

# Status codes all-gathered after the manifest.
_OK, _WANTS, _MISMATCH, _NO_MEMORY, _REFUSED = range(5)


@dataclass(frozen=True)
class SyncResult:
    """What one ``sync_shared_state`` call did on this peer.

    Attributes:
        revision: the revision every peer holds now.
        content: the elected content digest (32 hex characters, xxh3-128 of
            the manifest); equal on every peer after the sync.
        bytes_sent: data-plane bytes this peer sent during the call (entries,
            manifest and status messages; headers included).
        bytes_received: data-plane bytes this peer received during the call.
        changed: names of the entries overwritten on this peer, sorted.
        sources: ranks that held the elected content in the last attempt.
        retries: topology updates done inside the call after network failures.
        seconds: wall time of the call.
    """

    revision: int
    content: str
    bytes_sent: int
    bytes_received: int
    changed: tuple[str, ...]
    sources: tuple[int, ...]
    retries: int
    seconds: float


# -- the sync ----------------------------------------------------------------


def sync_shared_state(state, revision: int, strategy: str = "enforce_popular", group=None,
                      allow_divergence: Iterable[str] = (),
                      timeout: float | timedelta | None = None,
                      max_retries: int = 3) -> SyncResult:
    """Makes every peer of ``group`` hold the elected bytes of ``state``; a collective.

    Every member calls it at the same point with its own ``state`` (same
    names, dtypes and shapes). Peers whose content differs from the majority
    (joiners, drifted peers) receive only their differing entries, striped
    over every peer that holds the elected content; entries are overwritten
    in place (``copy_`` under ``no_grad``), so a ``model.state_dict()``
    updates the model's parameters.

    Revision rule (checked by the master): the group's revision is the last
    one elected; a peer that has synced before in this group must pass that
    revision or the next one. A peer that has never synced here (a joiner)
    may pass any revision and adopts the elected one.

    Args:
        state: ``SharedState`` or mapping ``str -> torch.Tensor`` (contiguous,
            CPU, strided; any dtype and shape), e.g. ``model.state_dict()``
            merged with outer-optimizer buffers and a step tensor.
        revision: this peer's revision, an int >= 0 (e.g. the outer step).
        strategy: ``"enforce_popular"`` (vote; receive if outvoted),
            ``"receive_only"`` (no vote, never a source; receive if different)
            or ``"send_only"`` (vote, never receive: if outvoted this peer
            raises ``MismatchError`` and its tensors stay as they are).
        group: a group formed through a master (``init_method="pccl://..."``
            or a fixed world with the auto master); default the default group.
        allow_divergence: names excluded from hashing, comparison and
            transfer (added to a ``SharedState``'s own).
        timeout: deadline of the master's vote, seconds or timedelta (default
            60 s); the data-plane steps use the group's op timeout.
        max_retries: topology updates allowed after network failures (>= 0).

    Returns:
        SyncResult(revision, content, bytes_sent, bytes_received, changed,
        sources, retries, seconds).

    Raises:
        TypeError: a name is not a ``str``, a value is not a tensor.
        InvalidArgumentError: a non-CPU, non-contiguous or non-strided tensor,
            a bad strategy, revision or ``allow_divergence`` name.
        InvalidUsageError: the group has no master; the revision rule is
            broken; every member used ``receive_only``.
        MismatchError: names, dtypes or shapes differ between peers (on every
            peer, naming the entry; nothing written); or a ``send_only`` peer
            was outvoted (on that peer only).
        OutOfMemoryError: this peer cannot stage what it must receive (on
            this peer only; nothing written; the others finish normally).
        ProtocolError: a received entry or manifest does not match its hash.
        PeerLostError, PcclTimeoutError, ...: the network failed ``max_retries``
            + 1 times; the master could not be reached.
    """
    started = time.monotonic()
    if strategy not in STRATEGIES:
        raise InvalidArgumentError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if type(revision) is not int or not 0 <= revision < 2**63:
        raise InvalidArgumentError(f"revision must be an int in 0 .. 2**63 - 1, got {revision!r}")
    if type(max_retries) is not int or max_retries < 0:
        raise InvalidArgumentError(f"max_retries must be an int >= 0, got {max_retries!r}")
    tensors, _ = entries_of(state, allow_divergence)
    timeout_s = config.to_seconds(timeout, config.UPDATE_TIMEOUT_S)
    pg, membership = elastic_group(group)
    # A joiner's sync ends its admission: the sync after the round that admitted it
    # is this one (see peers_pending).
    membership.close_admission()
    pg.drain()
    hashes = {name: hash_tensor(t) for name, t in tensors.items()}
    manifest = manifest_of(tensors, hashes)
    content = digest(manifest)
    staged: dict[str, tuple[str, torch.Tensor]] = {}   # name -> (hash, verified bytes)
    sent = received = retries = 0
    while True:
        try:
            vote = membership.request_sync(revision, strategy, content, timeout_s)
        except UpdateInProgressError:
            # Members recovering from a loss opened an update round of this epoch: join
            # it (finishing their exchange here if it completed elsewhere), then vote again.
            if retries >= max_retries:
                raise
            update_topology(group, admit=False)
            retries += 1
            continue
        if vote["error"]:
            raise InvalidUsageError(f"shared-state sync refused: {vote['error']}")
        comm = pg.communicator
        before = _stats(comm)
        try:
            outcome = _Exchange(comm, tensors, hashes, manifest, content, strategy, vote,
                                staged).run()
        except RETRYABLE_ERRORS:
            if retries >= max_retries:
                raise
            outcome = None
        finally:
            after = _stats(comm)
            sent += max(0, after[0] - before[0])
            received += max(0, after[1] - before[1])
        if outcome is not None:
            break
        # Mid-sync: a peer admitted here would not be in this sync's vote.
        update_topology(group, admit=False)
        retries += 1
    outcome.raise_if_failed()
    membership.synced(vote["revision"], sent + received)
    return SyncResult(revision=vote["revision"], content=vote["content"], bytes_sent=sent,
                      bytes_received=received, changed=outcome.changed,
                      sources=tuple(vote["sources"]), retries=retries,
                      seconds=time.monotonic() - started)


@dataclass
class _Outcome:
    changed: tuple[str, ...] = ()
    error: Exception | None = None       # this peer's own failure (others finished)

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error


class _Exchange:
    """One attempt of the data-plane part of a sync, after the master's vote."""

    def __init__(self, comm, tensors, hashes, manifest, content, strategy, vote, staged):
        self.comm = comm
        self.me = comm.rank
        self.tensors = tensors
        self.hashes = hashes
        self.manifest = manifest
        self.content = content
        self.strategy = strategy
        self.vote = vote
        self.staged = staged

    def run(self) -> _Outcome:
        vote = self.vote
        if not vote["outdated"]:
            return _Outcome()
        entries = self._elected_manifest(vote["sources"][0])
        code, message, wanted, staging = self._status(entries)
        statuses = self._all_gather_status(code, message, wanted, len(entries))
        mismatched = [(r, msg) for r, (c, msg, _) in enumerate(statuses) if c == _MISMATCH]
        if mismatched:
            rank, msg = mismatched[0]
            raise MismatchError(f"shared state differs in layout between peers: {msg}"
                                + (f" ({len(mismatched)} peers differ)"
                                   if len(mismatched) > 1 else ""))
        wanting = {r: idx for r, (c, _, idx) in enumerate(statuses) if c == _WANTS}
        pieces = plan_pieces(wanting, [e.nbytes for e in entries], vote["sources"])
        try:
            self._move(pieces, entries, staging)
        except Exception:
            # Entries that arrived whole before the failure verify and are
            # kept: the retry fetches only the rest.
            self._verify(wanted, entries, staging)
            raise
        bad = self._verify(wanted, entries, staging)
        # Every peer reaches this only after its own transfers; a failure
        # anywhere (a source lost mid-transfer) fails it everywhere, so all
        # peers retry together and nobody commits half a sync.
        flag = torch.tensor([len(bad)], dtype=torch.int64)
        self.comm.all_reduce(flag, op=dist.ReduceOp.MAX, tag=_TAG)
        if bad:
            raise ProtocolError(f"shared-state entries {bad[:4]} did not match their elected "
                                f"hashes on arrival (sources {vote['sources']})")
        if flag.item():
            raise ProtocolError("a peer received shared-state entries that did not match "
                                "their elected hashes")
        if code == _REFUSED:
            return _Outcome(error=MismatchError(message))
        if code == _NO_MEMORY:
            return _Outcome(error=OutOfMemoryError(message))
        return _Outcome(changed=self._commit(entries))

    def _elected_manifest(self, lead: int) -> list[Entry]:
        comm = self.comm
        length = torch.tensor([len(self.manifest) if self.me == lead else 0], dtype=torch.int64)
        comm.broadcast(length, lead, tag=_TAG)
        n = int(length.item())
        if not 0 < n <= MAX_MANIFEST_BYTES:
            raise ProtocolError(f"rank {lead} announced a shared-state manifest of {n} bytes, "
                                f"outside 1 .. {MAX_MANIFEST_BYTES}")
        raw = torch.empty(n, dtype=torch.uint8)
        if self.me == lead:
            raw.copy_(torch.frombuffer(bytearray(self.manifest), dtype=torch.uint8))
        comm.broadcast(raw, lead, tag=_TAG)
        data = bytes(byte_view(raw))
        if digest(data) != self.vote["content"]:
            raise ProtocolError(f"the manifest from rank {lead} does not match the elected "
                                f"content digest {self.vote['content']}")
        return parse_manifest(data)

    def _status(self, entries: list[Entry]):
        """(code, message, wanted entry indices, staging buffers by index) of this peer."""
        if self.content == self.vote["content"]:
            return _OK, "", [], {}
        problem = layout_problem(self.tensors, entries, self.me)
        if problem:
            return _MISMATCH, problem, [], {}
        if self.strategy == "send_only":
            return _REFUSED, (f"rank {self.me} syncs with strategy send_only, but its shared "
                              f"state differs from the elected one (revision "
                              f"{self.vote['revision']}); it was not changed"), [], {}
        wanted = []
        for i, e in enumerate(entries):
            held = self.staged.get(e.name)
            if self.hashes[e.name] != e.hash and not (held and held[0] == e.hash):
                wanted.append(i)
        total = sum(entries[i].nbytes for i in wanted)
        buf = allocate(total)
        if buf is None:
            return _NO_MEMORY, (f"rank {self.me} cannot stage the {total} bytes of shared "
                                f"state it must receive (memory headroom "
                                f"{memory_headroom()} bytes); it was not changed"), [], {}
        staging, off = {}, 0
        for i in wanted:
            staging[i] = buf[off:off + entries[i].nbytes]
            off += entries[i].nbytes
        return (_WANTS if wanted else _OK), "", wanted, staging

    def _all_gather_status(self, code, message, wanted, n_entries):
        """Every peer's (code, message, wanted indices); fixed-size records."""
        bitmap_bytes = (n_entries + 7) // 8
        size = 8 * _HEADER_WORDS + _MESSAGE_BYTES + bitmap_bytes
        mine = torch.zeros(size, dtype=torch.uint8)
        header = mine[:8 * _HEADER_WORDS].view(torch.int64)
        header[0] = code
        header[1] = len(wanted)
        text = message.encode("utf-8")[:_MESSAGE_BYTES]
        bits = bytearray(bitmap_bytes)
        for i in wanted:
            bits[i // 8] |= 1 << (i % 8)
        tail = bytearray(text) + bytearray(_MESSAGE_BYTES - len(text)) + bits
        mine[8 * _HEADER_WORDS:] = torch.frombuffer(tail, dtype=torch.uint8)
        every = torch.empty(size * self.comm.world_size, dtype=torch.uint8)
        self.comm.all_gather(mine, every, tag=_TAG)
        out = []
        for r in range(self.comm.world_size):
            rec = every[r * size:(r + 1) * size]
            raw = bytes(byte_view(rec))
            c = int.from_bytes(raw[:8], "little", signed=True)
            msg = raw[16:16 + _MESSAGE_BYTES].rstrip(b"\0").decode("utf-8", "replace")
            b = raw[16 + _MESSAGE_BYTES:]
            idx = [i for i in range(n_entries) if b[i // 8] >> (i % 8) & 1] \
                if c == _WANTS else []
            out.append((c, msg, idx))
        return out

    def _move(self, pieces: list[Piece], entries: list[Entry], staging) -> None:
        ops = []
        for p in pieces:
            if p.source == self.me:
                src = bytes_of(self.tensors[entries[p.entry].name])
                ops.append((True, src[p.offset:p.offset + p.length], p.receiver, _TAG))
            elif p.receiver == self.me:
                ops.append((False, staging[p.entry][p.offset:p.offset + p.length], p.source,
                            _TAG))
        if ops:
            self.comm.transfer_batch(ops)

    def _verify(self, wanted, entries, staging) -> list[str]:
        bad = []
        for i in wanted:
            e = entries[i]
            got = xxhash.xxh3_128_hexdigest(byte_view(staging[i]))
            if got == e.hash:
                self.staged[e.name] = (e.hash, staging[i])
            else:
                bad.append(e.name)
        return bad

    def _commit(self, entries: list[Entry]) -> tuple[str, ...]:
        changed = []
        with torch.no_grad():
            for e in entries:
                if self.hashes[e.name] == e.hash:
                    continue
                _, data = self.staged[e.name]
                bytes_of(self.tensors[e.name]).copy_(data)
                self.hashes[e.name] = e.hash
                changed.append(e.name)
        return tuple(sorted(changed))


def _stats(comm) -> tuple[int, int]:
    try:
        return comm.stats()
    except Exception:  # noqa: BLE001 - a closed communicator counts nothing more
        return (0, 0)


__all__ = [
    "MAX_MANIFEST_BYTES",
    "PIECE_BYTES",
    "STRATEGIES",
    "Piece",
    "SharedState",
    "SyncResult",
    "content_digest",
    "memory_headroom",
    "plan_pieces",
    "state_hashes",
    "sync_shared_state",
]
