"""What the master's status page, ``/api/status`` and ``/metrics`` show (master/http.py).

A pure view: ``build`` turns the state machine's snapshot, the clock and the
server's ``StatusLog`` (recent events, sampled history) into one JSON-able
dict. Peers feed it through the ``report`` of the heartbeats they already send
(control/schemas.py ``_report``); nothing here touches the data path.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

# A peer whose last message is older than this many heartbeat intervals is shown stale
# (red); the master drops it at the heartbeat timeout.
STALE_INTERVALS = 2.0


class StatusLog:
    """The master's recent events and its world-size and throughput history.

    Args:
        max_events: events kept (oldest dropped first).
        max_points: history samples kept.
        sample_s: seconds between two history samples.
    """

    def __init__(self, max_events: int = 200, max_points: int = 720, sample_s: float = 2.0):
        self.started_at = time.time()
        self.events: collections.deque = collections.deque(maxlen=max_events)
        self.history: collections.deque = collections.deque(maxlen=max_points)
        self.sample_s = float(sample_s)
        self._last: tuple[float, int] | None = None   # (wall time, total bytes) of last sample

    def event(self, text: str, wall: float | None = None) -> None:
        """Records one event line (the lines the master logs) at ``wall`` (Unix seconds)."""
        self.events.append({"time": time.time() if wall is None else wall, "text": text})

    def sample(self, snapshot: Callable[[], dict], wall: float | None = None) -> None:
        """Adds a history point (world size, bytes/s sent by the members since the last
        point) if ``sample_s`` has passed since the last one; ``snapshot()`` (the state's)
        is taken only then."""
        wall = time.time() if wall is None else wall
        if self._last is not None and wall - self._last[0] < self.sample_s:
            return
        snapshot = snapshot()
        total = _total_sent(snapshot)
        rate = 0.0
        if self._last is not None and wall > self._last[0]:
            rate = max(0.0, (total - self._last[1]) / (wall - self._last[0]))
        self._last = (wall, total)
        self.history.append({"time": wall, "world_size": snapshot["world_size"],
                             "bytes_per_s": rate})


def _total_sent(snapshot: dict) -> int:
    return sum(p["report"].get("sent", 0) for p in snapshot["peers"]
               if p["state"] in ("accepted", "resuming"))


def build(snapshot: dict, now: float, log: StatusLog, address: str) -> dict:
    """The status document (schema in docs/status-page.md).

    Args:
        snapshot: ``MembershipState.snapshot()``.
        now: the state machine's clock now (seconds, same origin as ``last_seen``).
        log: the server's events and history.
        address: the master's control address (``host:port``).

    Returns:
        A JSON-able dict: the group (``comm_id``, ``epoch``, ``world_size``,
        ``ring_order``), ``peers`` (members by rank, then pending and joining
        connections), ``pending``, ``shared_state``, ``quorum`` (the DiLoCo quorum
        rounds: the open one and the latest closed ones, master/quorum.py), ``restart`` (the restart rules
        now: see ``_restart``), ``bandwidth`` (None until measured), ``events``
        (oldest first), ``history`` and ``counters``.
    """
    interval = snapshot["heartbeat_interval_s"]
    peers = []
    for p in snapshot["peers"]:
        report = p["report"]
        age = max(0.0, now - p["last_seen"])
        peers.append({
            "peer_id": p["peer_id"], "state": p["state"], "rank": p["rank"],
            "address": p["data_addr"] or p["addr"], "control_address": p["addr"],
            "heartbeat_age_s": round(age, 3), "stale": age > STALE_INTERVALS * interval,
            "step": report.get("step"), "bytes_sent": report.get("sent"),
            "bytes_received": report.get("received"), "op": report.get("op"),
            "sync_bytes": report.get("sync_bytes"),
        })
    members = sorted((p for p in peers if p["state"] in ("accepted", "resuming")),
                     key=lambda p: p["rank"])
    others = [p for p in peers if p["state"] not in ("accepted", "resuming")]
    by_rank = {p["rank"]: p for p in snapshot["peers"] if p["state"] in ("accepted", "resuming")}
    world = len(members)
    ring = by_rank.get(0, {}).get("report", {}).get("ring")
    if not ring or sorted(ring) != list(range(world)):
        ring = list(range(world))
    return {
        "master": {"address": address, "started_at": log.started_at,
                   "uptime_s": round(time.time() - log.started_at, 1)},
        "comm_id": f"{snapshot['comm_id']:016x}",
        "epoch": snapshot["epoch"],
        "world_size": snapshot["world_size"],
        "ring_order": ring,
        "heartbeat_interval_s": interval,
        "heartbeat_timeout_s": snapshot["heartbeat_timeout_s"],
        "peers": members + others,
        "pending": [p["peer_id"] for p in others if p["state"] == "pending"],
        "shared_state": snapshot["shared_state"],
        "quorum": snapshot["quorum"],
        "restart": _restart(snapshot["restart"], now),
        "bandwidth": _bandwidth(by_rank, world),
        "events": list(log.events),
        "history": list(log.history),
        "counters": snapshot["counters"],
    }


def _restart(view: dict, now: float) -> dict:
    """The restart rules as the page shows them (docs/membership.md, "When the master
    restarts"): ``source`` (how this master learnt the run: "state file",
    "re-registration", or None), ``grace_left_s`` (seconds left of the resume grace
    window; None when none runs), ``held`` (joiners it holds), ``resuming`` (members not
    re-registered yet), ``resumed`` (members that did) and ``summary``, one line."""
    left = None if view["grace_until"] is None else round(max(0.0, view["grace_until"] - now), 1)
    if left is not None:
        summary = (f"resume grace window: {left:g} s left; holding {len(view['held'])} "
                   f"joiner(s) until members of an earlier group re-register or it ends")
    elif view["source"] is None:
        summary = "no earlier group: the current one was formed here"
    else:
        summary = (f"run taken back from the {view['source']}: {len(view['resumed'])} "
                   f"member(s) re-registered, {len(view['resuming'])} not yet")
    return {"source": view["source"], "grace_left_s": left, "held": list(view["held"]),
            "resuming": list(view["resuming"]), "resumed": list(view["resumed"]),
            "summary": summary}


def _bandwidth(by_rank: dict, world: int) -> dict | None:
    """The measured link rates, bytes/s: ``matrix[i][j]`` from rank i to rank j (None where
    not measured), or None when no member has measured any."""
    rows = []
    for rank in range(world):
        links = by_rank.get(rank, {}).get("report", {}).get("links") or []
        rows.append([links[j] if j < len(links) and links[j] >= 0 and j != rank else None
                     for j in range(world)])
    if not any(v is not None for row in rows for v in row):
        return None
    return {"peer_ids": [by_rank[r]["peer_id"] for r in range(world) if r in by_rank],
            "matrix": rows}
