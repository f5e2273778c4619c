"""The shared-secret challenge-response, where the master's callers have always imported it.

Its home is ``torch_pccl.control.auth``, which the master and its peers both import
without importing each other (issue 22); every public name stays importable here.
"""

from ..control.auth import (
    ENCRYPT_MODE,
    HEX_CHARS,
    NONCE_BYTES,
    master_proof,
    new_nonce,
    peer_proof,
    same,
    status_token,
)

__all__ = ["ENCRYPT_MODE", "HEX_CHARS", "NONCE_BYTES", "master_proof", "new_nonce",
           "peer_proof", "same", "status_token"]
