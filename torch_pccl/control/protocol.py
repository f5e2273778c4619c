"""The control protocol of the master and its peers: framing, no I/O.

A message is a 4-byte little-endian unsigned length ``N`` followed by ``N``
bytes of UTF-8 JSON holding one object with a ``"type"`` string. ``N`` must be
1 .. ``MAX_MESSAGE_BYTES``; it is checked as soon as the 4 length bytes are in,
before any payload byte is buffered, so a peer announcing 2 GiB costs nothing.

``Decoder`` is fed raw bytes and returns whole, validated messages (like
hiredis's ``redisReaderFeed``/``redisReaderGetReply``): it never touches a
socket, so it is tested byte by byte without a network. ``encode`` validates
before framing, so the master never sends a message its peers would reject.

Every message's schema lives in control/schemas.py (``SCHEMAS``, ``validate``). The
names of it that a connection's two ends use (the opening's ``MAGIC`` and ``VERSION``,
the direction sets ``TO_MASTER``/``TO_PEER``, ``SYNC_STRATEGIES``, ``parse_addr``) and
``ProtocolError`` are importable here too, so that a client needs this module alone.
"""

from __future__ import annotations

import json
import struct

from ..errors import PcclError, ProtocolError
from .schemas import MAGIC, SYNC_STRATEGIES, TO_MASTER, TO_PEER, VERSION, parse_addr, validate

# One control message is a few hundred bytes; an `assign` for 256 ranks with
# 64-character ids and IPv6 addresses stays under 64 KiB.
MAX_MESSAGE_BYTES = 65536
LENGTH = struct.Struct("<I")
"""A frame's length prefix (also a sealed record's: control/seal.py)."""
HEADER_BYTES = LENGTH.size


def _reject_constant(name):
    # json.loads accepts NaN/Infinity by default; they are not JSON.
    raise ValueError(f"{name} is not valid JSON")


def encode(msg: dict) -> bytes:
    """Validates ``msg`` and returns its frame (4-byte length + UTF-8 JSON).

    Raises:
        ProtocolError: the message fails ``validate`` or its JSON is longer
            than ``MAX_MESSAGE_BYTES`` bytes.
    """
    validate(msg)
    payload = json.dumps(msg, separators=(",", ":"), ensure_ascii=False,
                         allow_nan=False).encode("utf-8")
    if len(payload) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{msg['type']} message is {len(payload)} bytes, "
                            f"more than {MAX_MESSAGE_BYTES}")
    return LENGTH.pack(len(payload)) + payload


def decode_payload(payload: bytes, accept: frozenset | None = None) -> dict:
    """Decodes and validates one frame's payload (without its length prefix).

    Raises:
        ProtocolError: bad UTF-8, bad JSON, or ``validate`` fails.
    """
    try:
        text = payload.decode("utf-8")
        value = json.loads(text, parse_constant=_reject_constant)
    except UnicodeDecodeError as e:
        raise ProtocolError(f"payload is not UTF-8: {e.reason} at byte {e.start}") from None
    except (ValueError, RecursionError) as e:
        # ValueError covers JSONDecodeError and Python's int-digits limit;
        # RecursionError comes from ~64 K nested brackets.
        raise ProtocolError(f"payload is not JSON: {str(e)[:200]}") from None
    try:
        # JSON may escape a lone surrogate ("\\ud800"): json.loads returns a str that no
        # UTF-8 encoder takes, so the message could be neither logged nor sent on.
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise ProtocolError(f"payload has an unpaired surrogate escape (character {e.start} "
                            "of its JSON)") from None
    return validate(value, accept)


class Decoder:
    """Incremental frame reader: ``feed(bytes)`` -> complete validated messages.

    Buffers at most one partial frame (<= 4 + ``MAX_MESSAGE_BYTES`` bytes plus
    whatever one ``feed`` call brings). After an error the decoder is broken:
    every later ``feed`` raises the same error, because the stream has lost
    its framing and nothing after the bad frame can be trusted.

    ``push`` and ``pop`` do the same one message at a time, for a reader that
    stops reading plain frames after a given message (the switch-over to sealed
    records, control/seal.py): ``take_rest`` then hands it the bytes that came
    after that message in the same read.
    """

    def __init__(self, accept: frozenset | None = None):
        """Args: accept: message types allowed (``TO_MASTER``/``TO_PEER``; None = all)."""
        self._accept = accept
        self._buf = bytearray()
        self._error: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete frame held (non-zero at EOF = a truncated frame)."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[dict]:
        """Adds ``data`` and returns every message it completes, in order.

        Raises:
            ProtocolError: a length of 0 or above ``MAX_MESSAGE_BYTES`` (raised
                as soon as the 4 length bytes are in, before the payload), or
                a payload ``decode_payload`` rejects. Messages completed
                earlier in the same call are discarded with the stream.
        """
        self.push(data)
        out = []
        while (msg := self.pop()) is not None:
            out.append(msg)
        return out

    def push(self, data: bytes) -> None:
        """Adds ``data`` without decoding it; ``pop`` takes the messages out.

        Raises:
            ProtocolError: the decoder is broken (the earlier error again).
        """
        if self._error is not None:
            raise self._error
        self._buf += data

    def pop(self) -> dict | None:
        """The next complete message of the bytes pushed, or None until more come.

        Raises:
            ProtocolError: as ``feed``; the decoder is broken from then on.
        """
        if self._error is not None:
            raise self._error
        if len(self._buf) < HEADER_BYTES:
            return None
        try:
            (n,) = LENGTH.unpack_from(self._buf)
            self.check_length(n)
            if len(self._buf) < HEADER_BYTES + n:
                return None
            header = bytes(self._buf[:HEADER_BYTES])
            body = bytes(self._buf[HEADER_BYTES:HEADER_BYTES + n])
            del self._buf[:HEADER_BYTES + n]
            return decode_payload(self.unwrap(header, body), self._accept)
        except PcclError as e:
            self._error = e
            self._buf.clear()
            raise

    def check_length(self, n: int) -> None:
        """Checks a frame's length prefix ``n`` before its body is buffered; a reader of
        another framing over the same prefix (control/seal.py's records) overrides it.

        Raises:
            ProtocolError: ``n`` is 0 or above ``MAX_MESSAGE_BYTES``.
        """
        if n == 0 or n > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"frame length {n} outside 1 .. {MAX_MESSAGE_BYTES} bytes")

    def unwrap(self, header: bytes, body: bytes) -> bytes:
        """The JSON payload a frame carries: its ``body`` (the bytes after the 4-byte
        ``header``) as is; a sealed reader opens it instead."""
        return body

    def take_rest(self) -> bytes:
        """Hands over the bytes pushed and not yet decoded, and empties the buffer: what
        followed the last plain message belongs to the reader of what comes next."""
        rest = bytes(self._buf)
        self._buf.clear()
        return rest


__all__ = [
    "HEADER_BYTES",
    "LENGTH",
    "MAGIC",
    "MAX_MESSAGE_BYTES",
    "SYNC_STRATEGIES",
    "TO_MASTER",
    "TO_PEER",
    "VERSION",
    "Decoder",
    "ProtocolError",
    "decode_payload",
    "encode",
    "parse_addr",
]
