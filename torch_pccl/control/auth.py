"""The shared-secret challenge-response of the master's control connections, no I/O.

A peer with a secret opens its connection with ``auth`` (a fresh nonce); the master
answers ``challenge`` (its own fresh nonce and its proof); the peer checks that proof and
sends ``auth_proof``; only then does the master read the peer's ``hello``. Each proof is
HMAC-SHA256 (Python's ``hmac``, RFC 2104) keyed with the secret over a label naming the
prover's side, the protocol magic and version, and both nonces, so:

- a stranger without the secret cannot produce a proof over a nonce it has never seen
  (``secrets.token_bytes``: 32 bytes from the OS's CSPRNG, fresh per connection);
- a recorded exchange replayed to the master fails against the master's new nonce;
- the master proves the secret too, so a peer does not take orders from an impostor;
- the two labels keep either side's proof from being reflected back as the other's;
- both proofs cover the mode the peer asked for in its ``auth`` (``encrypt``: sealed
  records after the handshake, control/seal.py), so a man in the middle who flips that flag
  to force the connection into the clear makes both proofs fail. Without encryption the
  proof bytes are those of earlier releases.

Proofs are compared with ``hmac.compare_digest`` (constant time). The data plane runs the
same scheme natively (``native/src/auth.hpp``). Threat model: docs/security.md.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

NONCE_BYTES = 32
HEX_CHARS = 2 * NONCE_BYTES           # a nonce or an HMAC-SHA256 proof, as lowercase hex

_MASTER_LABEL = b"pccl-master v1 master proof"
_STATUS_LABEL = b"pccl-master v1 status page token"
_PEER_LABEL = b"pccl-master v1 peer proof"
ENCRYPT_MODE = b"aes-256-gcm"          # appended (after a NUL) to what the proofs cover


def new_nonce() -> str:
    """A fresh nonce from the OS's CSPRNG, as ``HEX_CHARS`` lowercase hex characters."""
    return secrets.token_hex(NONCE_BYTES)


def _proof(secret: bytes, label: bytes, peer_nonce: str, master_nonce: str,
           encrypt: bool) -> str:
    parts = [label, peer_nonce.encode("ascii"), master_nonce.encode("ascii")]
    if encrypt:
        parts.append(ENCRYPT_MODE)
    return hmac.new(secret, b"\0".join(parts), hashlib.sha256).hexdigest()


def master_proof(secret: bytes, peer_nonce: str, master_nonce: str, *,
                 encrypt: bool = False) -> str:
    """The master's proof for one connection: hex HMAC-SHA256 over its label, both nonces
    (hex text) and, when the peer asked for encryption, ``ENCRYPT_MODE``, joined by NULs."""
    return _proof(secret, _MASTER_LABEL, peer_nonce, master_nonce, encrypt)


def peer_proof(secret: bytes, peer_nonce: str, master_nonce: str, *,
               encrypt: bool = False) -> str:
    """The peer's proof for one connection: as ``master_proof``, under the peer's label."""
    return _proof(secret, _PEER_LABEL, peer_nonce, master_nonce, encrypt)


def same(proof: str, expected: str) -> bool:
    """Constant-time comparison of a received proof with the expected one."""
    return hmac.compare_digest(proof.encode("ascii"), expected.encode("ascii"))


def status_token(secret: bytes) -> str:
    """The token that opens the master's status page and metrics when the run has a secret:
    hex HMAC-SHA256 of a fixed label, so an operator can derive it from the secret (the
    master logs the page's address with it) without the secret itself going into URLs,
    browser histories or scrape configs."""
    return hmac.new(secret, _STATUS_LABEL, hashlib.sha256).hexdigest()
