"""The master protocol's decoder under Hypothesis: whatever arrives, only ProtocolError.

Bounded in every suite run (``PCCL_FUZZ_EXAMPLES``, default 300 per target, a few seconds);
raise it for a longer run, e.g. ``PCCL_FUZZ_EXAMPLES=100000 python -m pytest
tests/master/test_master_fuzz.py``. Properties, for arbitrary bytes split arbitrarily and for
frames of arbitrary JSON objects with known and unknown types and fields:
- ``Decoder.feed`` returns validated messages or raises ``ProtocolError``, nothing else;
- it never holds more than one frame's bytes (``MAX_MESSAGE_BYTES`` + the length prefix);
- a ProtocolError's text fits the master's fatal ``error`` reply (``encode`` accepts it), so
  a bad peer is always told why;
- every message it returns encodes again and decodes to itself.
"""

import json
import os
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torch_pccl.control import protocol, schemas
from torch_pccl.control.protocol import MAX_MESSAGE_BYTES, Decoder, ProtocolError, encode

pytestmark = pytest.mark.timeout(600)

EXAMPLES = int(os.environ.get("PCCL_FUZZ_EXAMPLES", "300"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

FIELDS = sorted({name for schema in schemas.SCHEMAS.values() for name in schema})
TYPES = sorted(protocol.TO_MASTER | protocol.TO_PEER)
json_scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-2**70, max_value=2**70)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=100)
                | st.sampled_from([protocol.MAGIC, protocol.VERSION, "pending", "accepted",
                                   "127.0.0.1:1", "[::1]:2", "0" * 32, "enforce_popular"]))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=5)
                           | st.dictionaries(st.text(max_size=10), inner, max_size=5),
                           max_leaves=20)


def frame(payload: bytes) -> bytes:
    return struct.pack("<I", len(payload)) + payload


def feed_all(decoder: Decoder, chunks) -> list[dict]:
    """Feeds ``chunks`` in order; returns the messages, or raises the first ProtocolError."""
    out = []
    for chunk in chunks:
        out += decoder.feed(chunk)
        assert decoder.buffered <= MAX_MESSAGE_BYTES + protocol.HEADER_BYTES
    return out


def check_error(exc: ProtocolError) -> None:
    # The master answers a bad message with this text in a fatal error: it must fit.
    encode({"type": "error", "fatal": True, "message": str(exc)})


def check_messages(messages) -> None:
    for msg in messages:
        assert Decoder().feed(encode(msg)) == [msg]


@SETTINGS
@given(st.lists(st.binary(max_size=200), max_size=6))
def test_arbitrary_bytes(chunks):
    try:
        check_messages(feed_all(Decoder(), chunks))
    except ProtocolError as exc:
        check_error(exc)


@SETTINGS
@given(st.sampled_from(TYPES + ["", "x" * 70]),
       st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), json_values, max_size=8),
       st.integers(min_value=1, max_value=64), st.sampled_from([None, protocol.TO_MASTER,
                                                                protocol.TO_PEER]))
def test_arbitrary_objects_of_every_type(kind, fields, cut, accept):
    data = frame(json.dumps(dict(fields, type=kind)).encode())
    chunks = [data[i:i + cut] for i in range(0, len(data), cut)]
    try:
        check_messages(feed_all(Decoder(accept), chunks))
    except ProtocolError as exc:
        check_error(exc)


@SETTINGS
@given(st.sampled_from(TYPES), st.text(max_size=6000), st.integers())
def test_long_and_huge_values_are_quoted_briefly(kind, text, number):
    for value in (text, number, 10 ** 1200 + number, [text] * 3):
        obj = {"type": kind, "magic": value, "version": value, "epoch": value, "state": value,
               "strategy": value, "peer_id": value}
        try:
            Decoder().feed(frame(json.dumps(obj).encode()))
        except ProtocolError as exc:
            check_error(exc)
            assert len(str(exc)) < 600, str(exc)[:700]
