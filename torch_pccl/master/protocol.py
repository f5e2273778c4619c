"""The control protocol, where the master's callers have always imported it.

Its home is ``torch_pccl.control.protocol``, which the master and its peers both import
without importing each other (issue 22); every public name stays importable here.
"""

from ..control.protocol import (
    DIGEST_CHARS,
    HEADER_BYTES,
    MAGIC,
    MAX_ADDR_CHARS,
    MAX_ERROR_CHARS,
    MAX_MESSAGE_BYTES,
    MAX_OP_CHARS,
    MAX_PEER_ID_CHARS,
    MAX_REPORT_RANKS,
    SCHEMAS,
    SHOWN_CHARS,
    SYNC_STRATEGIES,
    TO_MASTER,
    TO_PEER,
    VERSION,
    Decoder,
    ProtocolError,
    decode_payload,
    encode,
    parse_addr,
    parse_address,
    shown,
    validate,
    validate_resume,
)

__all__ = [
    "DIGEST_CHARS",
    "HEADER_BYTES",
    "MAGIC",
    "MAX_ADDR_CHARS",
    "MAX_ERROR_CHARS",
    "MAX_MESSAGE_BYTES",
    "MAX_OP_CHARS",
    "MAX_PEER_ID_CHARS",
    "MAX_REPORT_RANKS",
    "SCHEMAS",
    "SHOWN_CHARS",
    "SYNC_STRATEGIES",
    "TO_MASTER",
    "TO_PEER",
    "VERSION",
    "Decoder",
    "ProtocolError",
    "decode_payload",
    "encode",
    "parse_addr",
    "parse_address",
    "shown",
    "validate",
    "validate_resume",
]
