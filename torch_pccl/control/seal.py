"""Sealed records of the master's control connection after the handshake, no I/O.

When the run has a shared secret and the peer asks for it in its ``auth`` (``encrypt``;
on unless ``PCCL_ENCRYPT=0``), every message after the challenge-response
(control/auth.py) travels as a sealed record instead of a plain frame:

- Keys: HKDF-SHA256 (RFC 5869) with the secret as input keying material, salt = the
  peer's nonce then the master's (32 + 32 bytes, decoded from their hex), info = ``INFO``.
  Its 88 bytes are the peer->master key (32) and IV (12), then the master->peer key (32)
  and IV (12). Both nonces are fresh, so every connection has keys of its own.
- Record: a 4-byte little-endian length ``N`` (``protocol.LENGTH``, a plain frame's
  prefix), then ``N`` bytes of AES-256-GCM ciphertext and its 16-byte tag. The plaintext
  is the JSON payload a plain frame would carry; the 4 length bytes are the associated
  data. ``TAG_BYTES < N <= MAX_RECORD_BYTES``, checked as soon as the 4 bytes are in,
  before the body is buffered.
- Nonce: TLS 1.3's per-record nonce (RFC 8446, section 5.3): the direction's IV XOR the
  record's 64-bit sequence number, big-endian, left-padded with zeros to 12 bytes. Each
  direction numbers its records from 0, one up per record. The number is never sent, so a
  record altered, dropped, replayed or reordered on the way fails its tag.

``Sealer`` seals one direction; ``Opener``, a ``protocol.Decoder`` whose frames are
these records, opens the other. Any failure raises ``IntegrityError`` naming the other side, and
the opener stays broken: nothing after a bad record can be trusted. The cryptography is
pyca/cryptography's (OpenSSL's AES-GCM and HKDF); nothing here is hand-written but the
record layout above. docs/security.md describes it with the data plane's links.
"""

from __future__ import annotations

from typing import NamedTuple

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..errors import IntegrityError
from .protocol import HEADER_BYTES, LENGTH, MAX_MESSAGE_BYTES, Decoder

INFO = b"pccl-master v1 record keys"
"""HKDF's ``info``: binds the keys to this protocol and version."""
KEY_BYTES = 32                  # AES-256
IV_BYTES = 12                   # GCM's nonce
TAG_BYTES = 16                  # GCM's tag
MAX_RECORD_BYTES = MAX_MESSAGE_BYTES + TAG_BYTES
"""The largest ``N`` of a record: a plain frame's bound plus the tag."""
SIDES = ("peer", "master")
_SEQUENCES = 2 ** 64


class RecordKey(NamedTuple):
    """One direction's AES-256 key (``KEY_BYTES``) and IV (``IV_BYTES``)."""

    key: bytes
    iv: bytes


def record_keys(secret: bytes, peer_nonce: str, master_nonce: str,
                side: str) -> tuple[RecordKey, RecordKey]:
    """The keys of one connection, as ``side`` uses them.

    Args:
        secret: the run's shared secret (HKDF's input keying material).
        peer_nonce, master_nonce: the ``auth`` and ``challenge`` nonces (hex text).
        side: ``"peer"`` or ``"master"``: whose keys these are.

    Returns:
        (send, receive): the key this side seals with and the one it opens with.

    Raises:
        ValueError: ``side`` is not one of ``SIDES``, or a nonce is not hex.
    """
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    okm = HKDF(algorithm=hashes.SHA256(), length=2 * (KEY_BYTES + IV_BYTES),
               salt=bytes.fromhex(peer_nonce) + bytes.fromhex(master_nonce),
               info=INFO).derive(secret)
    to_master = RecordKey(okm[:KEY_BYTES], okm[KEY_BYTES:KEY_BYTES + IV_BYTES])
    rest = okm[KEY_BYTES + IV_BYTES:]
    to_peer = RecordKey(rest[:KEY_BYTES], rest[KEY_BYTES:])
    return (to_master, to_peer) if side == "peer" else (to_peer, to_master)


def record_nonce(iv: bytes, seq: int) -> bytes:
    """The AES-GCM nonce of record ``seq``: ``iv`` XOR ``seq`` as 12 big-endian bytes
    (RFC 8446, section 5.3).

    Raises:
        ValueError: ``seq`` outside 0 .. 2**64 - 1 (a direction never wraps around).
    """
    if not 0 <= seq < _SEQUENCES:
        raise ValueError(f"record sequence number {seq} outside 0 .. 2**64 - 1")
    return (int.from_bytes(iv, "big") ^ seq).to_bytes(IV_BYTES, "big")


class Sealer:
    """Seals one direction's records, numbering them from 0. Not thread-safe: the caller
    seals and sends under one lock, so records leave in the order they are numbered."""

    def __init__(self, key: RecordKey):
        """Args: key: this direction's key and IV (``record_keys``'s send)."""
        self._aead = AESGCM(key.key)
        self._iv = key.iv
        self._seq = 0

    def seal(self, payload: bytes) -> bytes:
        """The record carrying ``payload`` (a message's UTF-8 JSON).

        Raises:
            ValueError: ``payload`` is empty or longer than ``MAX_MESSAGE_BYTES``.
        """
        if not 1 <= len(payload) <= MAX_MESSAGE_BYTES:
            raise ValueError(f"a record carries 1 .. {MAX_MESSAGE_BYTES} bytes, "
                             f"not {len(payload)}")
        header = LENGTH.pack(len(payload) + TAG_BYTES)
        body = self._aead.encrypt(record_nonce(self._iv, self._seq), payload, header)
        self._seq += 1
        return header + body

    def seal_frame(self, frame: bytes) -> bytes:
        """The record carrying what the plain frame ``frame`` (``protocol.encode``) carries.

        Raises:
            ValueError: as ``seal``.
        """
        return self.seal(frame[HEADER_BYTES:])


class Opener(Decoder):
    """Opens the other direction's records in order: a ``protocol.Decoder`` whose frames
    are sealed records (``feed``, or ``push`` and ``pop``; ``buffered``). Buffers at most
    one partial record.

    Args:
        key: the other direction's key and IV (``record_keys``'s receive).
        accept: message types allowed (``protocol.TO_MASTER``/``TO_PEER``; None = all).
        other: who sends the records, for errors (``"the master at host:port"``).

    ``feed`` and ``pop`` raise ``IntegrityError`` when a record fails its tag (altered,
    dropped, replayed, reordered, or not sealed) or announces a length outside
    ``TAG_BYTES + 1 .. MAX_RECORD_BYTES``, and ``ProtocolError`` when a record opens to a
    payload ``decode_payload`` rejects. Either is sticky, as for every ``Decoder``.
    """

    def __init__(self, key: RecordKey, accept: frozenset | None, other: str):
        super().__init__(accept)
        self._aead = AESGCM(key.key)
        self._iv = key.iv
        self._seq = 0
        self._other = other

    def check_length(self, n: int) -> None:
        """Checks a record's length prefix before its body is buffered.

        Raises:
            IntegrityError: ``n`` outside ``TAG_BYTES + 1 .. MAX_RECORD_BYTES``.
        """
        if not TAG_BYTES < n <= MAX_RECORD_BYTES:
            raise IntegrityError(
                f"record {self._seq} from {self._other} announces {n} bytes, outside "
                f"{TAG_BYTES + 1} .. {MAX_RECORD_BYTES}: altered on the way, or not "
                f"sealed; the connection is dead")

    def unwrap(self, header: bytes, body: bytes) -> bytes:
        """Opens the next record (its length prefix is the associated data).

        Raises:
            IntegrityError: its tag does not verify under the next record number.
        """
        try:
            payload = self._aead.decrypt(record_nonce(self._iv, self._seq), body, header)
        except InvalidTag:
            raise IntegrityError(
                f"record {self._seq} from {self._other} failed its AES-256-GCM check: "
                f"altered, dropped, replayed or reordered on the way, or not sealed; "
                f"the connection is dead") from None
        self._seq += 1
        return payload
