"""The master's framing and schemas (torch_pccl/control/protocol.py, schemas.py): no sockets."""

import json
import struct
import sys

import pytest

import torch_pccl
from torch_pccl.control import protocol
from torch_pccl.control.protocol import MAX_MESSAGE_BYTES, Decoder, ProtocolError, encode

pytestmark = pytest.mark.timeout(30)

HELLO = {"type": "hello", "magic": "pccl-master", "version": 1, "peer_id": "node-a/0",
         "data_addr": "10.0.0.2:41000", "meta": {"host": "a", "gpus": 0}}
ASSIGN = {"type": "assign", "epoch": 3, "comm_id": 2**64 - 1, "rank": 1, "world_size": 2,
          "addrs": ["10.0.0.2:41000", "[fe80::1]:41001"], "peer_ids": ["a", "b"],
          "joined": ["b"], "left": ["c"]}
DIGEST = "0123456789abcdef" * 2
SYNC = {"type": "sync", "epoch": 2, "revision": 2**63 - 1, "strategy": "enforce_popular",
        "fresh": False, "content": DIGEST}
SYNC_RESULT = {"type": "sync_result", "epoch": 2, "revision": 7, "content": DIGEST,
               "sources": [0, 2], "outdated": [1], "error": ""}
SYNC_FAILED = dict(SYNC_RESULT, content="", sources=[], outdated=[], error="x" * 4096)
GOOD = [
    HELLO,
    {"type": "heartbeat"},
    {"type": "pending"},
    {"type": "pending", "epoch": 3, "ops": 0, "index": 2},
    {"type": "update", "epoch": 0},
    {"type": "update", "epoch": 4, "admit": False, "done": 7},
    {"type": "update", "epoch": 4, "admit": False, "done": 7, "busy": True},
    SYNC,
    dict(SYNC, strategy="receive_only", fresh=True, revision=0, epoch=0),
    dict(SYNC, strategy="send_only"),
    {"type": "leave"},
    {"type": "welcome", "peer_id": "a", "state": "pending", "epoch": 0,
     "heartbeat_interval_s": 1.0},
    {"type": "pending_count", "count": 2},
    ASSIGN,
    dict(ASSIGN, done=[3, 2], busy=[True, True]),
    {"type": "wake", "epoch": 3},
    {"type": "wake", "epoch": 3, "update": True},
    {"type": "awake", "epoch": 3, "ops": -1, "index": -1},
    {"type": "awake", "epoch": 3, "ops": 40, "index": 1},
    SYNC_RESULT,
    dict(SYNC_RESULT, quiet=True),
    SYNC_FAILED,
    {"type": "error", "message": "nope", "fatal": False},
    {"type": "error", "message": "join the round", "fatal": False, "update": True},
    {"type": "error", "message": "authentication failed: x", "fatal": True, "auth": True},
    {"type": "auth", "magic": "pccl-master", "version": 1, "nonce": "0a" * 32},
    {"type": "auth_proof", "proof": "f" * 64},
    {"type": "challenge", "nonce": "1" * 64, "proof": "2" * 64},
]


def frame(payload: bytes, length: int | None = None) -> bytes:
    return struct.pack("<I", len(payload) if length is None else length) + payload


def raw(obj) -> bytes:
    return frame(json.dumps(obj).encode())


@pytest.mark.parametrize("msg", GOOD, ids=lambda m: m["type"])
def test_round_trip(msg):
    data = encode(msg)
    assert struct.unpack_from("<I", data)[0] == len(data) - 4
    assert Decoder().feed(data) == [decoded(msg)]


def decoded(msg):
    """``msg`` as the decoder returns it: optional fields it lacks read their defaults."""
    defaults = {"pending": dict(epoch=-1, ops=-1, index=-1),
                "update": dict(admit=True, done=-1, busy=False),
                "assign": dict(done=(), busy=(), replicas=(), shards=()),
                "sync_result": dict(quiet=False),
                "wake": dict(update=False),
                "error": dict(update=False, auth=False, stopping=False, replaced=False,
                              replica=False, layout=False),
                "hello": dict(meta={}),
                "auth": dict(encrypt=False)}
    return dict(defaults.get(msg["type"], {}), **msg)


@pytest.mark.parametrize("fields", [{"epoch": 1}, {"epoch": 1, "ops": 2}, {"ops": 0, "index": 0},
                                    {"epoch": 1, "ops": -1, "index": 0}])
def test_a_pending_key_is_whole(fields):
    with pytest.raises(ProtocolError):
        encode(dict(fields, type="pending"))


def test_optional_meta_defaults_to_empty_dict():
    hello = {k: v for k, v in HELLO.items() if k != "meta"}
    assert Decoder().feed(encode(hello)) == [dict(hello, meta={})]


def test_unknown_extra_fields_are_ignored():
    assert Decoder().feed(raw({"type": "heartbeat", "future": 1})) == [{"type": "heartbeat"}]


def test_byte_by_byte_feeding_yields_each_message_once():
    stream = b"".join(encode(m) for m in GOOD)
    d = Decoder()
    out = []
    for i in range(len(stream)):
        got = d.feed(stream[i:i + 1])
        out += got
        # A message comes out exactly when its last byte arrives.
        assert d.buffered == 0 or not got
    assert out == [decoded(m) for m in GOOD]
    assert d.buffered == 0


def test_several_messages_in_one_feed_and_a_partial_tail():
    stream = b"".join(encode(m) for m in GOOD)
    d = Decoder()
    assert d.feed(stream + encode(HELLO)[:7]) == [decoded(m) for m in GOOD]
    assert d.buffered == 7
    assert d.feed(encode(HELLO)[7:]) == [HELLO]


def test_direction_filter():
    assert Decoder(protocol.TO_MASTER).feed(encode(HELLO)) == [HELLO]
    with pytest.raises(ProtocolError, match="unknown message type"):
        Decoder(protocol.TO_MASTER).feed(encode(ASSIGN))
    with pytest.raises(ProtocolError, match="unknown message type"):
        Decoder(protocol.TO_PEER).feed(encode(HELLO))
    assert Decoder(protocol.TO_MASTER).feed(encode(SYNC)) == [SYNC]
    assert Decoder(protocol.TO_PEER).feed(encode(SYNC_RESULT)) == [decoded(SYNC_RESULT)]
    with pytest.raises(ProtocolError, match="unknown message type"):
        Decoder(protocol.TO_MASTER).feed(encode(SYNC_RESULT))
    with pytest.raises(ProtocolError, match="unknown message type"):
        Decoder(protocol.TO_PEER).feed(encode(SYNC))


def test_protocol_error_is_a_pccl_protocol_error():
    assert issubclass(ProtocolError, torch_pccl.ProtocolError)
    assert issubclass(ProtocolError, torch_pccl.PcclError)


@pytest.mark.parametrize("length", [0, MAX_MESSAGE_BYTES + 1, 2**31, 2**32 - 1])
def test_bad_length_rejected_from_the_header_alone(length):
    d = Decoder()
    # Only the 4 length bytes are sent: the error must not wait for a payload.
    assert d.feed(struct.pack("<I", length)[:3]) == []
    with pytest.raises(ProtocolError, match="frame length"):
        d.feed(struct.pack("<I", length)[3:])
    assert d.buffered == 0


def test_max_length_is_accepted():
    pad = "x" * (MAX_MESSAGE_BYTES - len(json.dumps({"type": "heartbeat", "p": ""})))
    data = raw({"type": "heartbeat", "p": pad})
    assert len(data) == 4 + MAX_MESSAGE_BYTES
    assert Decoder().feed(data) == [{"type": "heartbeat"}]


def test_oversize_feed_does_not_buffer_the_payload():
    # The huge length is refused before any payload byte is kept.
    d = Decoder()
    with pytest.raises(ProtocolError):
        d.feed(struct.pack("<I", 2**31) + b"\0" * 1000)
    assert d.buffered == 0


def test_decoder_stays_broken_after_an_error():
    d = Decoder()
    with pytest.raises(ProtocolError):
        d.feed(frame(b"garbage"))
    with pytest.raises(ProtocolError):
        d.feed(encode(HELLO))


BAD_PAYLOADS = {
    "not_utf8": b"\xff\xfe{}",
    "not_json": b"hello there",
    "truncated_json": b'{"type": "heartbe',
    "nan": b'{"type": "update", "epoch": NaN}',
    "array": b"[1, 2]",
    "string": b'"hello"',
    "no_type": b"{}",
    "type_not_str": b'{"type": 5}',
    "unknown_type": b'{"type": "shutdown"}',
    "deep_nesting": b'{"type":"hello","meta":' + b"[" * 30000 + b"]" * 30000 + b"}",
    "huge_int": b'{"type":"update","epoch":' + b"9" * 5000 + b"}",
}


@pytest.mark.parametrize("name", sorted(BAD_PAYLOADS))
def test_malformed_payload_rejected(name):
    payload = BAD_PAYLOADS[name]
    assert len(payload) <= MAX_MESSAGE_BYTES
    with pytest.raises(ProtocolError):
        Decoder().feed(frame(payload))


BAD_FIELDS = {
    "wrong_magic": dict(HELLO, magic="PCCL"),
    "wrong_version": dict(HELLO, version=2),
    "version_bool": dict(HELLO, version=True),
    "missing_peer_id": {k: v for k, v in HELLO.items() if k != "peer_id"},
    "empty_peer_id": dict(HELLO, peer_id=""),
    "long_peer_id": dict(HELLO, peer_id="p" * 65),
    "control_char_peer_id": dict(HELLO, peer_id="a\nb"),
    "peer_id_int": dict(HELLO, peer_id=7),
    "addr_no_port": dict(HELLO, data_addr="10.0.0.2"),
    "addr_port_zero": dict(HELLO, data_addr="10.0.0.2:0"),
    "addr_port_big": dict(HELLO, data_addr="10.0.0.2:70000"),
    "addr_bare_ipv6": dict(HELLO, data_addr="fe80::1:5000"),
    "addr_no_host": dict(HELLO, data_addr=":5000"),
    "meta_list": dict(HELLO, meta=[1]),
    "epoch_str": {"type": "update", "epoch": "1"},
    "epoch_negative": {"type": "update", "epoch": -1},
    "epoch_float": {"type": "update", "epoch": 1.0},
    "epoch_missing": {"type": "update"},
    "assign_rank_out_of_range": dict(ASSIGN, rank=2),
    "assign_addrs_short": dict(ASSIGN, addrs=["10.0.0.2:1"]),
    "assign_busy_without_done": dict(ASSIGN, busy=[False, True]),
    "assign_busy_short": dict(ASSIGN, done=[1, 1], busy=[True]),
    "update_busy_int": {"type": "update", "epoch": 1, "busy": 1},
    "assign_comm_id_65_bits": dict(ASSIGN, comm_id=2**64),
    "welcome_bad_state": {"type": "welcome", "peer_id": "a", "state": "gone", "epoch": 0,
                          "heartbeat_interval_s": 1.0},
    "error_fatal_int": {"type": "error", "message": "x", "fatal": 1},
    "sync_bad_strategy": dict(SYNC, strategy="enforce_majority"),
    "sync_strategy_int": dict(SYNC, strategy=0),
    "sync_content_upper_hex": dict(SYNC, content=DIGEST.upper()),
    "sync_content_31_chars": dict(SYNC, content=DIGEST[:31]),
    "sync_content_33_chars": dict(SYNC, content=DIGEST + "0"),
    "sync_content_not_hex": dict(SYNC, content="g" * 32),
    "sync_content_empty": dict(SYNC, content=""),
    "sync_epoch_bool": dict(SYNC, epoch=True),
    "sync_revision_negative": dict(SYNC, revision=-1),
    "sync_revision_2_63": dict(SYNC, revision=2**63),
    "sync_revision_bool": dict(SYNC, revision=False),
    "sync_fresh_int": dict(SYNC, fresh=0),
    **{f"sync_missing_{f}": {k: v for k, v in SYNC.items() if k != f}
       for f in ("epoch", "revision", "strategy", "fresh", "content")},
    "sync_result_content_bad_hex": dict(SYNC_RESULT, content="z" * 32),
    "auth_nonce_short": {"type": "auth", "magic": "pccl-master", "version": 1, "nonce": "0" * 63},
    "auth_nonce_upper": {"type": "auth", "magic": "pccl-master", "version": 1, "nonce": "A" * 64},
    "auth_wrong_magic": {"type": "auth", "magic": "x", "version": 1, "nonce": "0" * 64},
    "auth_proof_int": {"type": "auth_proof", "proof": 7},
    "challenge_no_proof": {"type": "challenge", "nonce": "0" * 64},
    "sync_result_no_content_without_error": dict(SYNC_RESULT, content=""),
    "sync_result_content_with_error": dict(SYNC_RESULT, error="failed"),
    "sync_result_error_too_long": dict(SYNC_FAILED, error="x" * 4097),
    "sync_result_error_int": dict(SYNC_RESULT, error=0),
    "sync_result_sources_negative": dict(SYNC_RESULT, sources=[-1]),
    "sync_result_sources_bool": dict(SYNC_RESULT, sources=[True]),
    "sync_result_outdated_not_list": dict(SYNC_RESULT, outdated=1),
    "sync_result_epoch_bool": dict(SYNC_RESULT, epoch=False),
    **{f"sync_result_missing_{f}": {k: v for k, v in SYNC_RESULT.items() if k != f}
       for f in ("epoch", "revision", "content", "sources", "outdated", "error")},
}


@pytest.mark.parametrize("name", sorted(BAD_FIELDS))
def test_bad_fields_rejected_on_decode_and_encode(name):
    msg = BAD_FIELDS[name]
    with pytest.raises(ProtocolError):
        Decoder().feed(raw(msg))
    with pytest.raises(ProtocolError):
        encode(msg)


def test_wrong_version_message_names_both_versions():
    with pytest.raises(ProtocolError, match="version 2; this master speaks 1"):
        Decoder().feed(raw(dict(HELLO, version=2)))


def test_encode_refuses_oversize_messages():
    with pytest.raises(ProtocolError, match="more than"):
        encode({"type": "error", "fatal": False, "message": "x"} | {"pad": "y" * MAX_MESSAGE_BYTES})


@pytest.mark.parametrize("addr,expected", [
    ("127.0.0.1:29600", ("127.0.0.1", 29600)),
    ("node-3.example:1", ("node-3.example", 1)),
    ("[::1]:65535", ("::1", 65535)),
])
def test_parse_addr(addr, expected):
    assert protocol.parse_addr(addr) == expected


def test_no_native_extension_needed():
    # The master must run where the data plane is not built.
    import subprocess
    code = ("import sys, torch_pccl.master; "
            "sys.exit('torch_pccl._pccl_native' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def _frame_text(text: str) -> bytes:
    payload = text.encode()
    return struct.pack("<I", len(payload)) + payload


def test_heartbeat_interval_beyond_float_range_is_a_protocol_error():
    # Found by benchmarks/fuzz_master_protocol.py: math.isfinite(int) raised OverflowError.
    msg = ('{"type":"welcome","peer_id":"a","state":"pending","epoch":0,'
           '"heartbeat_interval_s":' + "9" * 400 + "}")
    with pytest.raises(ProtocolError, match="heartbeat_interval_s"):
        Decoder().feed(_frame_text(msg))


@pytest.mark.parametrize("msg", [
    '{"type":"error","message":"\\ud800","fatal":true}',
    '{"type":"hello","magic":"pccl-master","version":1,"peer_id":"a",'
    '"data_addr":"127.0.0.1:1","meta":{"k":"\\udc00"}}'])
def test_a_lone_surrogate_escape_is_a_protocol_error(msg):
    # Found by benchmarks/fuzz_master_protocol.py: accepted, then not encodable as UTF-8.
    with pytest.raises(ProtocolError, match="surrogate"):
        Decoder().feed(_frame_text(msg))


def test_a_surrogate_pair_escape_is_one_character():
    msg = '{"type":"error","message":"\\ud83d\\ude00","fatal":true}'
    assert Decoder().feed(_frame_text(msg))[0]["message"] == "\U0001F600"
