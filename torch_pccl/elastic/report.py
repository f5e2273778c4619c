"""What a member's heartbeats tell the master's status page: ``PeerReport``.

Its last outer step, the bytes its shared-state syncs moved, its row of
``optimize_topology``'s measured link rates, and, read from the epoch's communicator,
its data-plane bytes, the op running and the ring order (protocol ``_report``).
"""

from __future__ import annotations

from ..errors import PcclError


class PeerReport:
    """The status-page fields this member accumulates."""

    def __init__(self):
        self._step: int | None = None
        self._sync_bytes = 0
        self._link_rates: list[float] | None = None

    def step(self, step: int) -> None:
        """The outer step this peer has reached (a DiLoCo wrapper tells it)."""
        self._step = step

    def synced(self, moved_bytes: int) -> None:
        """A shared-state sync moved ``moved_bytes`` bytes (sent and received)."""
        self._sync_bytes += moved_bytes

    def links(self, rates: list[float]) -> None:
        """This rank's row of measured link rates, bytes/s by rank."""
        self._link_rates = list(rates)

    def build(self, comm) -> dict:
        """The report: ``step``, ``sent``/``received`` (data-plane bytes of ``comm``, the
        epoch's communicator, or None), the native ``op`` running (``"idle"``), the
        ``ring`` order, ``links`` (bytes/s to each rank, -1 unmeasured) and
        ``sync_bytes``. Never waits for an op in flight."""
        out = {"sync_bytes": self._sync_bytes}
        if self._step is not None:
            out["step"] = self._step
        if self._link_rates is not None:
            out["links"] = [float(r) for r in self._link_rates]
        if comm is not None:
            try:
                out["sent"], out["received"] = comm.stats()
            except PcclError:
                pass        # closed (a failed connect, or the group shut down)
            out["op"] = comm.current_op or "idle"
            out["ring"] = list(comm.last_ring_order)
        return out
