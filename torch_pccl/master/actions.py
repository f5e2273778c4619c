"""What one step of the master's state machine asks its server to do: ``Actions``."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Actions:
    """What the server must do after one state-machine step.

    Attributes:
        sends: ``(conn, message)`` in order; messages are protocol dicts.
        closes: connections to close after their queued messages are flushed.
        events: human-readable lines (joins, leaves, drops, epochs) for INFO logs.
        persist: the run's record (``MembershipState.run_record``: epoch, roster, shared
            state) changed; a master with a state file writes it before sending.
    """

    sends: list = dataclasses.field(default_factory=list)
    closes: list = dataclasses.field(default_factory=list)
    events: list = dataclasses.field(default_factory=list)
    persist: bool = False     # the run's record changed: rewrite the state file (run_record)

    def to(self, conn: int, kind: str) -> list[dict]:
        """The messages of type ``kind`` sent to ``conn`` (for tests)."""
        return [m for c, m in self.sends if c == conn and m["type"] == kind]

    def reply(self, conn: int, msg: dict, rid: int = -1) -> None:
        """Sends ``msg`` to ``conn`` as the answer to its request whose ``id`` was ``rid``
        (-1: it had none), so the peer can tell it from a late answer to an earlier one."""
        if rid >= 0:
            msg["id"] = rid
        self.sends.append((conn, msg))

    def refuse(self, conn: int, why: str, rid: int = -1, **flags: bool) -> None:
        """Answers request ``rid`` of ``conn`` with a non-fatal ``error`` saying ``why``;
        ``flags`` are the error's optional booleans (``update``: join the update round)."""
        self.reply(conn, {"type": "error", "fatal": False, "message": why, **flags}, rid)
