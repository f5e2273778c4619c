"""The master's state file (``pccl-master --state-file PATH``): the run on disk.

A master restarted with the file knows the run at once: the current epoch, its comm_id and
roster (peer id and data address by rank) and the shared state's revision and content
digest (``MembershipState.run_record``). It adopts that epoch before the first connection,
so joiners become pending peers of the run's group from their first hello and no resume
grace window is needed (docs/membership.md, "When the master restarts").

The file is JSON, rewritten whole whenever the record changes (a new epoch, a successful
sync, a member bringing a newer revision): written to a temporary file in the same
folder, flushed and fsynced, then renamed over the old one (``os.replace``), and the
folder fsynced, so a reader sees the old record or the new one, never a mix, even after
a crash. It names peers' addresses: it is created readable by its owner only.

It is read back as untrusted input: bounded in size before reading, and every field
checked as the protocol checks a re-registration (``control.schemas.validate_resume``).
"""

from __future__ import annotations

import json
import os
import re

from ..control.schemas import validate_resume
from ..errors import ProtocolError

FORMAT = "pccl-master-state"
VERSION = 1
MAX_BYTES = 1 << 20
"""A state file larger than this (bytes) is refused unread: a roster of 1,024 ranks takes
about 120 KiB."""

_CONTENT = re.compile(r"(?:[0-9a-f]{32})?")


def save(path: str, record: dict) -> None:
    """Writes ``record`` (``MembershipState.run_record()``) to ``path`` atomically.

    Raises:
        OSError: the folder cannot be written (the old file, if any, is left intact).
    """
    data = json.dumps({"format": FORMAT, "version": VERSION, **record},
                      separators=(",", ":")).encode()
    folder = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)       # the rename itself survives a crash
    finally:
        os.close(dfd)


def load(path: str) -> dict | None:
    """The record in ``path``, or None when there is no such file (a new run).

    Returns:
        A dict with ``epoch`` (>= 1), ``comm_id`` (0 .. 2^64-1), ``peer_ids`` and
        ``addrs`` (one per rank, same length >= 1), ``revision`` (-1: no sync yet) and
        ``content`` (32 lowercase hex, or "" before the first sync).

    Raises:
        ValueError: the file is larger than ``MAX_BYTES``, not JSON, of another format or
            version, or a field is missing or out of bounds (the message names it).
        OSError: it exists but cannot be read.
    """
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return None
    with f:
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise ValueError(f"state file {path}: larger than {MAX_BYTES} bytes")
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"state file {path}: not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise ValueError(f"state file {path}: not a {FORMAT} file of version {VERSION}")
    content = doc.get("content")
    if not isinstance(content, str) or not _CONTENT.fullmatch(content):
        raise ValueError(f"state file {path}: 'content' must be 32 lowercase hex or empty")
    try:
        checked = validate_resume({k: doc.get(k) for k in
                                   ("epoch", "comm_id", "peer_ids", "addrs", "revision")}
                                  | {"rank": 0, "last_key": [-1, -1]})
    except ProtocolError as e:
        raise ValueError(f"state file {path}: {e}") from None
    return {"epoch": checked["epoch"], "comm_id": checked["comm_id"],
            "peer_ids": checked["peer_ids"], "addrs": checked["addrs"],
            "revision": checked["revision"], "content": content}
