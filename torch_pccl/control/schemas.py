"""Every control message's schema: its fields, their checks and bounds, no I/O.

A message of the control protocol is one JSON object with a ``"type"`` string (its framing:
control/protocol.py). ``SCHEMAS`` below maps every type to its fields; docs/membership.md
has the table. ``validate`` checks one decoded message against it: unknown extra fields are
ignored (a later minor revision may add optional ones); a missing field, a wrong type or an
unknown ``"type"`` is an error. ``encode`` and the ``Decoder`` (control/protocol.py) call
it, so neither end sends or accepts a message outside these schemas.

Malformed messages raise ``torch_pccl.errors.ProtocolError`` (a ``PcclError``), the
package's one protocol error; ``torch_pccl.errors`` does not load the native extension.
"""

from __future__ import annotations

import math

from .address import parse_address
from ..errors import ProtocolError

MAGIC = "pccl-master"
VERSION = 1
MAX_PEER_ID_CHARS = 64
MAX_ADDR_CHARS = 300

# Message types by direction.
TO_MASTER = frozenset({"auth", "auth_proof", "hello", "heartbeat", "pending", "update",
                       "sync", "leave", "unreached", "ready", "awake"})
TO_PEER = frozenset({"challenge", "welcome", "pending_count", "assign", "sync_result",
                     "error", "member_lost", "quorum", "wake"})

# How a peer takes part in a shared-state sync (the `sync` message's strategy).
SYNC_STRATEGIES = ("enforce_popular", "receive_only", "send_only")
DIGEST_CHARS = 32                   # a content digest: xxh3-128 as lowercase hex
MAX_ERROR_CHARS = 4096


# ---------------------------------------------------------------------------
# field checks: each returns the (possibly normalised) value or raises


SHOWN_CHARS = 64
"""At most this much of a received value is quoted in an error (the master's reply and log)."""


def shown(value, limit: int = SHOWN_CHARS) -> str:
    """A value received from the network as an error message may quote it: its repr cut to
    ``limit`` characters (and its length said), an integer of more than 256 bits or a
    container named by type only. So a peer cannot make the master echo megabytes back,
    nor push its error reply past ``MAX_ERROR_CHARS``."""
    if type(value) is int:
        text = str(value) if value.bit_length() <= 256 else f"<an integer of {value.bit_length()} bits>"
    elif value is None or type(value) in (str, float, bool):
        text = repr(value)
    else:
        text = f"<a JSON {type(value).__name__}>"
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text)} characters)"
    return text


def _int(value, name, lo=0, hi=2**63 - 1):
    # bool is an int subclass in Python; JSON true is not an epoch.
    if type(value) is not int:
        raise ProtocolError(f"field {name!r} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ProtocolError(f"field {name!r} = {shown(value)} is outside {lo} .. {hi}")
    return value


def _str(value, name, max_chars=1024):
    if type(value) is not str:
        raise ProtocolError(f"field {name!r} must be a string, got {type(value).__name__}")
    if len(value) > max_chars:
        raise ProtocolError(f"field {name!r} is longer than {max_chars} characters")
    return value


def _bool(value, name):
    if type(value) is not bool:
        raise ProtocolError(f"field {name!r} must be a boolean, got {type(value).__name__}")
    return value


def _number(value, name):
    # math.isfinite converts an int to float, which raises OverflowError past 1.8e308.
    if type(value) not in (int, float) or (type(value) is float and not math.isfinite(value)) \
            or value <= 0 or value > 1e9:
        raise ProtocolError(f"field {name!r} must be a positive number of seconds")
    return value


def _grace(value, name):
    if type(value) not in (int, float) or not 0 <= value <= 86400:
        raise ProtocolError(f"field {name!r} must be a number of seconds in 0 .. 86400")
    return value


def _peer_id(value, name):
    _str(value, name, MAX_PEER_ID_CHARS)
    # Ids end up in logs and in every member's `assign`: no control characters.
    if not value or not value.isprintable():
        raise ProtocolError(f"field {name!r} must be 1 .. {MAX_PEER_ID_CHARS} printable characters")
    return value


def parse_addr(addr: str) -> tuple[str, int]:
    """Splits ``"host:port"`` or ``"[v6host]:port"`` into ``(host, port)`` (``control.address``).

    Raises:
        ProtocolError: not that shape, empty host, or port outside 1 .. 65535.
    """
    try:
        return parse_address(addr)
    except ValueError as e:
        raise ProtocolError(str(e)) from None


def _addr(value, name):
    _str(value, name, MAX_ADDR_CHARS)
    if not value.isprintable():
        raise ProtocolError(f"field {name!r} has control characters")
    parse_addr(value)
    return value


def _dict(value, name):
    if type(value) is not dict:
        raise ProtocolError(f"field {name!r} must be an object, got {type(value).__name__}")
    return value


def _list_of(check):
    def _check(value, name):
        if type(value) is not list:
            raise ProtocolError(f"field {name!r} must be a list, got {type(value).__name__}")
        return [check(v, f"{name}[{i}]") for i, v in enumerate(value)]
    return _check


def _magic(value, name):
    if value != MAGIC:
        raise ProtocolError(f"bad magic {shown(value)}: this is a pccl-master port "
                            f"(expected {MAGIC!r})")
    return value


def _version(value, name):
    _int(value, name, 0, 2**31)
    if value != VERSION:
        raise ProtocolError(f"unsupported protocol version {shown(value)}; this master speaks "
                            f"{VERSION}")
    return value


def _digest(value, name, allow_empty=False):
    _str(value, name, DIGEST_CHARS)
    if allow_empty and value == "":
        return value
    if len(value) != DIGEST_CHARS or value.strip("0123456789abcdef"):
        raise ProtocolError(f"field {name!r} must be {DIGEST_CHARS} lowercase hex characters")
    return value


def _hex64(value, name):
    # A nonce or an HMAC-SHA256 proof (control/auth.py): 64 lowercase hex characters.
    _str(value, name, 64)
    if len(value) != 64 or value.strip("0123456789abcdef"):
        raise ProtocolError(f"field {name!r} must be 64 lowercase hex characters")
    return value


def _strategy(value, name):
    if value not in SYNC_STRATEGIES:
        raise ProtocolError(f"field {name!r} must be one of {', '.join(SYNC_STRATEGIES)}, "
                            f"got {shown(value)}")
    return value


def _error_text(value, name):
    return _str(value, name, MAX_ERROR_CHARS)


def _state(value, name):
    if value not in ("pending", "accepted"):
        raise ProtocolError(f"field {name!r} must be 'pending' or 'accepted', got {shown(value)}")
    return value


MAX_SHARDS = 4096
"""The most shards a replica may have (a hello's ``replica.shards``)."""
MAX_LAYOUT_CHARS = 200
"""The longest layout description a hello may carry (it is quoted in a refusal)."""


def _replica(value, name):
    """A sharded replica's process (docs/sharded-replicas.md): the replica's id, this
    process's shard index, the replica's shard count, and the model's layout (a digest that
    every replica of the group must share, and its description for a refusal's message)."""
    _dict(value, name)
    out = {"id": _peer_id(value.get("id"), f"{name}.id"),
           "shards": _int(value.get("shards"), f"{name}.shards", 1, MAX_SHARDS)}
    out["shard"] = _int(value.get("shard"), f"{name}.shard", 0, out["shards"] - 1)
    out["layout"] = _digest(value.get("layout", ""), f"{name}.layout", allow_empty=True)
    text = _str(value.get("description", ""), f"{name}.description", MAX_LAYOUT_CHARS)
    if not text.isprintable():
        raise ProtocolError(f"field {name}.description must be printable characters")
    out["description"] = text
    return out


def _resume(value, name):
    """A member's re-registration with a master that came back (docs/membership.md, "When
    the master dies"): the assignment it holds, its shared-state revision, and the last
    pending-query key it answered alone while the master was away."""
    _dict(value, name)
    if not value:
        return {}
    out = {}
    for field, check in (("epoch", lambda v, n: _int(v, n, 1)),
                         ("comm_id", lambda v, n: _int(v, n, 0, 2**64 - 1)),
                         ("rank", _int),
                         ("peer_ids", _list_of(_peer_id)),
                         ("addrs", _list_of(_addr)),
                         ("revision", lambda v, n: _int(v, n, -1)),
                         ("last_key", _list_of(lambda v, n: _int(v, n, -1)))):
        if field not in value:
            raise ProtocolError(f"field {name!r} lacks {field!r}")
        out[field] = check(value[field], f"{name}.{field}")
    n = len(out["peer_ids"])
    if not 1 <= n == len(out["addrs"]) or out["rank"] >= n or len(out["last_key"]) != 2:
        raise ProtocolError(f"field {name!r}: rank, peer_ids, addrs and last_key disagree")
    return out


def validate_resume(value) -> dict:
    """A ``resume`` record (see ``_resume``) checked as the hello's field is: the
    state file (master/run_file.py) keeps the run in this shape.

    Raises:
        ProtocolError: a field missing, of the wrong type or out of bounds.
    """
    return _resume(value, "resume")


MAX_REPORT_RANKS = 1024            # ring order and bandwidth row of a status report
MAX_OP_CHARS = 64


def _rate(value, name):
    # A measured link rate in bytes/s; -1: not measured.
    if type(value) not in (int, float) or (type(value) is float and not math.isfinite(value)) \
            or not -1 <= value <= 1e15:
        raise ProtocolError(f"field {name!r} must be a rate in bytes/s (or -1)")
    return float(value)


def _report(value, name):
    """What a peer shows on the master's status page, sent on its heartbeat: its last outer
    step, the bytes its communicator sent and received, the op it is in, the ring order and
    its row of measured link rates (``optimize_topology``), and the bytes its shared-state
    syncs moved. Every field optional and bounded; unknown fields are dropped."""
    _dict(value, name)
    out = {}
    for field, check in (("step", lambda v, n: _int(v, n, -1)),
                         ("sent", _int),
                         ("received", _int),
                         ("sync_bytes", _int),
                         ("op", lambda v, n: _str(v, n, MAX_OP_CHARS)),
                         ("ring", _list_of(_int)),
                         ("links", _list_of(_rate))):
        if field in value:
            out[field] = check(value[field], f"{name}.{field}")
    if "op" in out and not out["op"].isprintable():
        raise ProtocolError(f"field {name}.op has control characters")
    for field in ("ring", "links"):
        if len(out.get(field, ())) > MAX_REPORT_RANKS:
            raise ProtocolError(f"field {name}.{field} has more than {MAX_REPORT_RANKS} entries")
    return out


def _request_id(value, name):
    # A request's `id` (pending, update, sync), echoed by its answer (pending_count,
    # assign, sync_result, error) so that a late answer to an earlier request can never
    # be taken for a newer one's.
    return _int(value, name, 0, 2**53)


_REQUIRED = object()
_ABSENT = object()      # an optional field left out of the decoded message when absent

# type -> {field: (check, default)}; _REQUIRED marks a mandatory field, _ABSENT an
# optional one that stays out of the decoded message when not sent. Public so that the
# fuzz tests can draw field names from it; read it, never change it.
SCHEMAS = {
    # peer -> master
    # With a shared secret, a connection opens with auth -> challenge -> auth_proof
    # (control/auth.py) before the hello; without one it opens with the hello.
    # `encrypt`: the peer asks for sealed records after the handshake (control/seal.py);
    # both proofs cover it (control/auth.py), so a flipped flag fails them.
    "auth": {
        "magic": (_magic, _REQUIRED),
        "version": (_version, _REQUIRED),
        "nonce": (_hex64, _REQUIRED),
        "encrypt": (_bool, False),
    },
    "auth_proof": {"proof": (_hex64, _REQUIRED)},
    "hello": {
        "magic": (_magic, _REQUIRED),
        "version": (_version, _REQUIRED),
        "peer_id": (_peer_id, _REQUIRED),
        "data_addr": (_addr, _REQUIRED),
        "meta": (_dict, None),
        # A member of an epoch re-registering with a restarted master (``_resume``); {}: none.
        "resume": (_resume, _ABSENT),
        # A process of a sharded replica (``_replica``); absent: a peer of its own.
        "replica": (_replica, _ABSENT),
    },
    # `report`: what the status page shows of this peer (``_report``); none: nothing new.
    "heartbeat": {"report": (_report, _ABSENT)},
    # With `epoch`, `ops` and `index` (all three or none): the `index`-th query a member
    # makes after its `ops`-th collective of `epoch`. The master fixes the answer to each
    # such key when it is first asked, so every member gets the same one wherever and
    # whenever it asks (docs/membership.md, "Where the checks may go"). Without them: the
    # count now.
    "pending": {"epoch": (_int, -1), "ops": (_int, -1), "index": (_int, -1),
                "id": (_request_id, _ABSENT)},
    # `admit` false: a recovery round (a member was lost mid-step); pending peers stay
    # pending until a round every member opens with admit true.
    # `done`: the all-or-nothing exchanges this member completed in `epoch` (-1: none
    # tracked); the master hands every member's count back in the `assign`. `busy`: the
    # member comes from inside its next exchange (docs/membership.md, "Quiet epochs").
    "update": {"epoch": (_int, _REQUIRED), "admit": (_bool, True),
               "done": (lambda v, n: _int(v, n, -1), -1), "busy": (_bool, False),
               "id": (_request_id, _ABSENT)},
    "sync": {
        "epoch": (_int, _REQUIRED),
        "revision": (_int, _REQUIRED),
        "strategy": (_strategy, _REQUIRED),
        "fresh": (_bool, _REQUIRED),
        "content": (_digest, _REQUIRED),
        "id": (_request_id, _ABSENT),
    },
    "leave": {},
    # After connecting `epoch` failed: the ranks of that epoch this member could not
    # connect with. The master drops those it admitted in that epoch.
    "unreached": {"epoch": (_int, _REQUIRED), "ranks": (_list_of(_int), _REQUIRED)},
    # A DiLoCo member with a quorum option has done its inner steps for quorum round
    # `round` (the shared-state revision the round starts from, equal on every member),
    # having trained on `tokens` since it last took part, `stale` rounds ago; `min_peers` and `grace_s` are its quorum rule
    # (master/quorum.py).
    # The answer to a `wake`: this member answers its pending queries of `epoch` from the
    # master again; (`ops`, `index`) is the last key it answered alone under the epoch's
    # quiet grant ((-1, -1): none). See "Quiet epochs" in docs/membership.md.
    "awake": {"epoch": (_int, _REQUIRED), "ops": (lambda v, n: _int(v, n, -1), _REQUIRED),
              "index": (lambda v, n: _int(v, n, -1), _REQUIRED)},
    "ready": {"epoch": (_int, _REQUIRED), "round": (_int, _REQUIRED),
              "tokens": (_int, _REQUIRED), "stale": (_int, 0),
              "min_peers": (lambda v, n: _int(v, n, 1, 2**31 - 1), _REQUIRED),
              "grace_s": (_grace, _REQUIRED), "id": (_request_id, _ABSENT)},
    # master -> peer
    "challenge": {"nonce": (_hex64, _REQUIRED), "proof": (_hex64, _REQUIRED)},
    "welcome": {
        "peer_id": (_peer_id, _REQUIRED),
        "state": (_state, _REQUIRED),
        "epoch": (_int, _REQUIRED),
        "heartbeat_interval_s": (_number, _REQUIRED),
    },
    # `quiet`: the answer a member gave alone while the master was away, or one given
    # while members are still re-registering: every member skips what depends on it
    # (a DiLoCo boundary's shared-state sync), as the ones that answered alone did.
    "pending_count": {"count": (_int, _REQUIRED), "id": (_request_id, _ABSENT),
                      "quiet": (_bool, _ABSENT)},
    "assign": {
        "epoch": (_int, _REQUIRED),
        "comm_id": (lambda v, n: _int(v, n, 0, 2**64 - 1), _REQUIRED),
        "rank": (_int, _REQUIRED),
        "world_size": (lambda v, n: _int(v, n, 1, 2**31 - 1), _REQUIRED),
        "addrs": (_list_of(_addr), _REQUIRED),
        "peer_ids": (_list_of(_peer_id), _REQUIRED),
        "joined": (_list_of(_peer_id), _REQUIRED),
        "left": (_list_of(_peer_id), _REQUIRED),
        # Per rank of the new epoch: the `done` its member sent for the epoch it leaves
        # (-1: none, a joiner); empty when the master has none to tell.
        "done": (_list_of(lambda v, n: _int(v, n, -1)), ()),
        # Per rank, aligned with `done`: the `busy` its member sent (false for a joiner).
        "busy": (_list_of(_bool), ()),
        # Sharded replicas: per rank, its replica's id and its shard index (each member
        # connects the ring of its own shard index: docs/sharded-replicas.md); empty when
        # no member is part of one.
        "replicas": (_list_of(_peer_id), ()),
        "shards": (_list_of(lambda v, n: _int(v, n, 0, MAX_SHARDS - 1)), ()),
        "id": (_request_id, _ABSENT),
    },
    # The epoch's quiet grant ends (a peer is pending): answer `awake`, then ask again.
    # `update`: a member opened an update round: join it at the next step.
    "wake": {"epoch": (_int, _REQUIRED), "update": (_bool, False)},
    "sync_result": {
        "epoch": (_int, _REQUIRED),
        "revision": (_int, _REQUIRED),
        "content": (lambda v, n: _digest(v, n, allow_empty=True), _REQUIRED),
        "sources": (_list_of(_int), _REQUIRED),
        "outdated": (_list_of(_int), _REQUIRED),
        "error": (_error_text, _REQUIRED),
        # A quiet grant: every member voted, the round elected, nobody is pending; from
        # now the members answer their pending queries alone (no master round trip, no
        # vote at a DiLoCo boundary) until the master's `wake` (docs/membership.md).
        "quiet": (_bool, False),
        "id": (_request_id, _ABSENT),
    },
    "error": {
        "message": (_error_text, _REQUIRED),
        "fatal": (_bool, _REQUIRED),
        # True: members of this epoch opened an update round; join it, then retry.
        "update": (_bool, False),
        # True: the connection failed the shared-secret exchange (control/auth.py).
        "auth": (_bool, False),
        # True: the master is stopping; a member keeps training and waits for it to be
        # restarted on the same address (docs/membership.md, "When the master dies").
        "stopping": (_bool, False),
        # True: refused for good, the peer's group is not the run's group at this master
        # (a re-registration the group moved on from, or a group of joiners that gave way
        # to a resumed one): the peer raises GroupReplacedError and does not reconnect.
        "replaced": (_bool, False),
        # True: dropped because another process of this peer's sharded replica was lost;
        # the peer raises ReplicaLostError (it may rejoin as a new replica).
        "replica": (_bool, False),
        # True: refused at admission, its replica's layout differs from the group's; the
        # peer raises ReplicaLayoutError.
        "layout": (_bool, False),
        "id": (_request_id, _ABSENT),
    },
    # Quorum round `round` closed: its participants (peer ids, in this order) and the
    # tokens each trained on and the rounds each missed before (`stale`); every other
    # member joins the round's exchange with none. `pending`: peers waiting for admission
    # when it closed (the members' boundary after the round admits them if > 0).
    "quorum": {"round": (_int, _REQUIRED), "peer_ids": (_list_of(_peer_id), _REQUIRED),
               "tokens": (_list_of(_int), _REQUIRED), "stale": (_list_of(_int), _REQUIRED),
               "pending": (_int, 0), "id": (_request_id, _ABSENT)},
    # A member of `epoch` was dropped (heartbeat, lost connection, missed round):
    # the others abort that epoch's collectives at once instead of waiting for
    # its bytes until their op deadline.
    "member_lost": {
        "epoch": (_int, _REQUIRED),
        "peer_id": (_peer_id, _REQUIRED),
        "rank": (_int, _REQUIRED),
        "reason": (_error_text, _REQUIRED),
    },
}
assert set(SCHEMAS) == TO_MASTER | TO_PEER


def validate(msg, accept: frozenset | None = None) -> dict:
    """Checks one decoded message against its schema.

    Args:
        msg: the decoded JSON value.
        accept: the message types allowed here (``TO_MASTER`` on the master,
            ``TO_PEER`` on a peer); None allows every known type.

    Returns:
        A new dict with the known fields only, optional ones filled with their
        defaults (``hello.meta`` becomes ``{}``).

    Raises:
        ProtocolError: not an object, no/unknown ``type``, a type not in
            ``accept``, a missing field or a field of the wrong type or range.
    """
    if type(msg) is not dict:
        raise ProtocolError(f"a message must be a JSON object, got {type(msg).__name__}")
    kind = msg.get("type")
    if type(kind) is not str:
        raise ProtocolError("message has no string 'type' field")
    schema = SCHEMAS.get(kind)
    if schema is None or (accept is not None and kind not in accept):
        raise ProtocolError(f"unknown message type {kind[:64]!r}")
    out = {"type": kind}
    for name, (check, default) in schema.items():
        if name in msg:
            out[name] = check(msg[name], name)
        elif default is _REQUIRED:
            raise ProtocolError(f"{kind} message lacks field {name!r}")
        elif default is _ABSENT:
            continue
        else:
            out[name] = {} if default is None else default
    if kind == "pending" and len({out["epoch"] < 0, out["ops"] < 0, out["index"] < 0}) != 1:
        raise ProtocolError("pending: give epoch, ops and index together, or none of them")
    if kind == "assign":
        n = out["world_size"]
        if len(out["addrs"]) != n or len(out["peer_ids"]) != n or out["rank"] >= n:
            raise ProtocolError("assign: rank, addrs and peer_ids disagree with world_size")
        if (out["done"] and len(out["done"]) != n) or \
                (out["busy"] and len(out["busy"]) != len(out["done"])):
            raise ProtocolError("assign: done or busy disagrees with world_size")
        if len(out["replicas"]) != len(out["shards"]) or (out["shards"] and
                                                          len(out["shards"]) != n):
            raise ProtocolError("assign: replicas and shards disagree with world_size")
    if kind == "sync_result" and (out["error"] == "") == (out["content"] == ""):
        raise ProtocolError("sync_result: content must be empty exactly when error is set")
    return out
