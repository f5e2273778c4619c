"""Membership: a group's link to its master (client, data-plane listener, assignment)."""

from __future__ import annotations

from .master_client import Assignment, MasterClient


class Membership:
    """A group's link to the master: the client, the data-plane listener, the current assignment."""

    def __init__(self, client: MasterClient, listener, assignment: Assignment, master=None):
        self.client = client
        self.listener = listener
        self.assignment = assignment
        self.master = master  # the MasterThread this process hosts for the job, if any
        # The revision of this peer's last completed sync_shared_state; None
        # until then (the master's election treats the peer as fresh).
        self.shared_revision: int | None = None

    def close(self, leave: bool = True) -> None:
        """Leaves the master (``leave``: a clean departure) or disconnects; closes the listener,
        and stops the master if this process hosts it (see ``auto_master_membership``).

        Close every communicator created on the listener first. Never raises.
        """
        if leave:
            self.client.leave()
        else:
            self.client.close()
        self.listener.close()
        master, self.master = self.master, None
        if master is not None:
            try:
                master.stop()
            except Exception:  # noqa: BLE001 - closing must not raise; the thread is a daemon
                pass
