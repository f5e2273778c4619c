"""The master's status page, ``/api/status`` and ``/metrics`` over HTTP (aiohttp).

Served by ``MasterServer`` from its own event loop when it has an ``http_port``:

- ``GET /``: one self-contained HTML page (its CSS and JS, static/status.css and
  static/status.js, inlined; nothing fetched from elsewhere) rendered server-side from
  static/status.html and the status document, whose script re-fetches
  ``api/status`` every second and re-renders it; ``<body data-refreshes="N">`` counts its
  successful refreshes;
- ``GET /api/status``: the status document (master/status.py ``build``) as JSON;
- ``GET /metrics``: Prometheus text exposition, read from the status document at each
  scrape.

Read-only: no route changes the run. With a token (the run has a shared secret) every
request must carry it, as ``?token=`` or ``Authorization: Bearer``; the page passes on the
token it was loaded with. Strings in the status come from the network (peer ids,
addresses, events): the page escapes them (``html.escape`` here, ``textContent`` in its
script), and a per-response nonce in its Content-Security-Policy keeps any script but its
own from running. The protocol bounds their length (control/schemas.py).
"""

from __future__ import annotations

import hmac
import html
import json
import secrets
import time
from importlib import resources

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

from .counters import ROUND_BUCKETS_S

MAX_EVENTS_SHOWN = 100          # newest events on the page (the server keeps more)
REFRESH_MS = 1000               # the page's refresh period
FETCH_TIMEOUT_MS = 5000         # the page gives up on one fetch after this


def _static(name: str) -> str:
    """The text of ``static/<name>``, package data installed beside this module.

    Raises:
        OSError: the file is missing (an install without the package data).
    """
    return resources.files(__package__).joinpath("static").joinpath(name).read_text(
        encoding="utf-8")


# The page's template (``str.format`` fields: ``render_page``'s sections), its style and its
# script live in static/ as files of their own language; read once, when this module is
# imported (by a master when it first serves the page), and inlined into every page.
_PAGE = _static("status.html")
_CSS = _static("status.css")
# The script renders with textContent and createElement only: never innerHTML with data.
_SCRIPT = _static("status.js")


async def start(server, host: str, port: int, token: str | None) -> tuple[web.AppRunner, int]:
    """Serves the status page, ``/api/status`` and ``/metrics`` of ``server`` on the running
    event loop (the master's: handlers call ``server.status()`` directly).

    Args:
        server: the ``MasterServer``; only its ``status()`` is used.
        host: address to listen on.
        port: TCP port; 0 picks a free one.
        token: the secret every request must carry (``?token=`` or ``Authorization:
            Bearer``); None: no authentication.

    Returns:
        The runner (``await runner.cleanup()`` stops serving) and the bound port.

    Raises:
        OSError: the address cannot be bound.
    """
    routes = _Routes(server, token)
    app = web.Application(middlewares=[routes.authenticate])
    app.router.add_get("/", routes.page)
    app.router.add_get("/api/status", routes.api_status)
    app.router.add_get("/metrics", routes.metrics)
    # No access log: a request's URL may carry the token.
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_address=True).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, runner.addresses[0][1]


class _Routes:
    """The handlers, over one server and token."""

    def __init__(self, server, token: str | None):
        self.server = server
        self.token = None if token is None else token.encode("utf-8")
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StatusCollector(server))

    @web.middleware
    async def authenticate(self, request: web.Request, handler):
        """401 with a one-line body unless the request carries the token (when there is one)."""
        if self.token is not None:
            given = request.query.get("token")
            if given is None:
                scheme, _, value = request.headers.get("Authorization", "").partition(" ")
                given = value.strip() if scheme.lower() == "bearer" else ""
            if not hmac.compare_digest(given.encode("utf-8", "replace"), self.token):
                return web.Response(
                    status=401, text="401: this master's status needs its token "
                                     "(?token= or Authorization: Bearer)\n",
                    headers={"WWW-Authenticate": 'Bearer realm="pccl-master"', **_HEADERS})
        return await handler(request)

    async def page(self, request: web.Request) -> web.Response:
        """``GET /``: the status page, rendered from the status now."""
        nonce = secrets.token_urlsafe(16)
        csp = (f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
               "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "
               "frame-ancestors 'none'")
        return web.Response(text=render_page(self.server.status(), nonce),
                            content_type="text/html", charset="utf-8",
                            headers={"Content-Security-Policy": csp, **_HEADERS})

    async def api_status(self, request: web.Request) -> web.Response:
        """``GET /api/status``: the status document as JSON."""
        return web.json_response(self.server.status(), headers=_HEADERS)

    async def metrics(self, request: web.Request) -> web.Response:
        """``GET /metrics``: Prometheus text exposition (``StatusCollector``)."""
        return web.Response(body=generate_latest(self.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST, **_HEADERS})


# On every response: never cached, never sniffed, no Referer (a page URL may hold the token).
_HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer"}


class StatusCollector:
    """A ``prometheus_client`` collector reading ``server.status()`` at each scrape.

    Families (units in the names): ``pccl_world_size``, ``pccl_epoch``,
    ``pccl_pending_peers``, ``pccl_joins_total``, ``pccl_drops_total{cause}``,
    ``pccl_update_rounds_total``, ``pccl_update_round_seconds`` (histogram, buckets
    ``ROUND_BUCKETS_S``), ``pccl_sync_rounds_total``, ``pccl_sync_bytes_total`` (shared-state
    bytes the members' syncs moved), ``pccl_master_resumes_total``,
    ``pccl_master_requests_total{type}`` (messages members sent, heartbeats aside),
    ``pccl_master_resume_grace_seconds_left``, ``pccl_master_held_joiners``, and per peer
    ``pccl_peer_heartbeat_age_seconds{peer_id,rank}`` (rank -1: not a member),
    ``pccl_peer_bytes_sent_total{peer_id}``, ``pccl_peer_bytes_received_total{peer_id}``,
    ``pccl_peer_outer_step{peer_id}`` (the last three once the peer has reported them).

    The histogram's buckets and sum are the master's own counters
    (``state.Counters``), so the collector keeps nothing between scrapes.
    """

    def __init__(self, server):
        self.server = server

    def collect(self):
        """Yields the metric families of the status now."""
        s = self.server.status()
        c = s["counters"]
        yield GaugeMetricFamily("pccl_world_size", "Members of the current group.",
                                value=s["world_size"])
        yield GaugeMetricFamily("pccl_epoch", "Current epoch (group generation).",
                                value=s["epoch"])
        yield GaugeMetricFamily("pccl_pending_peers", "Peers waiting to be admitted.",
                                value=len(s["pending"]))
        yield CounterMetricFamily("pccl_joins", "Peers admitted into a group.", value=c["joins"])
        drops = CounterMetricFamily("pccl_drops", "Peers gone, by cause.", labels=["cause"])
        for cause, n in sorted(c["drops"].items()):
            drops.add_metric([cause], n)
        yield drops
        yield CounterMetricFamily("pccl_update_rounds", "Update rounds completed.",
                                  value=c["update_rounds"])
        cumulative, buckets = 0, []
        for le, n in zip((*(f"{b:g}" for b in ROUND_BUCKETS_S), "+Inf"), c["round_buckets"]):
            cumulative += n
            buckets.append((le, cumulative))
        yield HistogramMetricFamily("pccl_update_round_seconds",
                                    "Duration of update rounds, seconds.", buckets=buckets,
                                    sum_value=c["round_seconds_sum"])
        yield CounterMetricFamily("pccl_sync_rounds", "Shared-state sync rounds completed.",
                                  value=c["sync_rounds"])
        yield CounterMetricFamily("pccl_sync_bytes", "Bytes the members' shared-state syncs "
                                  "moved.", value=c["sync_bytes"])
        yield CounterMetricFamily("pccl_master_resumes", "Members that re-registered with "
                                  "this master after it (re)started.", value=c["resumes"])
        requests = CounterMetricFamily("pccl_master_requests", "Messages members sent, by "
                                       "type (heartbeats aside).", labels=["type"])
        for kind, n in sorted(c["requests"].items()):
            requests.add_metric([kind], n)
        yield requests
        r = s["restart"]
        yield GaugeMetricFamily("pccl_master_resume_grace_seconds_left",
                                "Seconds left of the resume grace window (0: none runs).",
                                value=r["grace_left_s"] or 0.0)
        yield GaugeMetricFamily("pccl_master_held_joiners",
                                "Joiners the resume grace window holds.", value=len(r["held"]))
        age = GaugeMetricFamily("pccl_peer_heartbeat_age_seconds",
                                "Seconds since the peer's last message.",
                                labels=["peer_id", "rank"])
        sent = CounterMetricFamily("pccl_peer_bytes_sent", "Bytes the peer's communicator "
                                   "sent.", labels=["peer_id"])
        received = CounterMetricFamily("pccl_peer_bytes_received", "Bytes the peer's "
                                       "communicator received.", labels=["peer_id"])
        step = GaugeMetricFamily("pccl_peer_outer_step", "The peer's last outer step.",
                                 labels=["peer_id"])
        for p in s["peers"]:
            if not p["peer_id"]:                # a connection that has not said hello
                continue
            age.add_metric([p["peer_id"], str(p["rank"])], p["heartbeat_age_s"])
            for family, key in ((sent, "bytes_sent"), (received, "bytes_received"),
                                (step, "step")):
                if p[key] is not None:
                    family.add_metric([p["peer_id"]], p[key])
        yield from (age, sent, received, step)


# -- the page ----------------------------------------------------------------------------

def human_bytes(n: float | None) -> str:
    """``n`` bytes in binary units (``12.3 MiB``); ``-`` for None. The page's script has
    the same function (``human``)."""
    if n is None:
        return "-"
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"


def _clock(t: float) -> str:
    """Unix seconds as ``HH:MM:SS`` UTC (the page's script: ``clock``)."""
    return time.strftime("%H:%M:%S", time.gmtime(t))


def _dash(v) -> str:
    return "-" if v is None or v == "" else str(v)


def _e(v) -> str:
    return html.escape(_dash(v), quote=True)


def _peer_row(p: dict) -> str:
    member = p["state"] in ("accepted", "resuming")
    stale = " stale" if p["stale"] else ""
    cells = [
        f'<td class="id">{_e(p["peer_id"] or "(connecting)")}</td>',
        f"<td>{_e(p['address'])}</td>",
        f'<td class="rank">{_e(p["rank"] if member else None)}</td>',
        f'<td class="state">{_e(p["state"])}</td>',
        f'<td class="age{stale}">{p["heartbeat_age_s"]:.1f} s</td>',
        f'<td class="num">{_e(p["step"])}</td>',
        f'<td class="num">{html.escape(human_bytes(p["bytes_sent"]))}</td>',
        f'<td class="num">{html.escape(human_bytes(p["bytes_received"]))}</td>',
        f"<td>{_e(p['op'])}</td>",
    ]
    return (f'<tr class="peer{stale}" data-peer-id="{_e(p["peer_id"])}" '
            f'data-rank="{_e(p["rank"] if member else None)}">{"".join(cells)}</tr>')


def _bandwidth(bw: dict | None) -> str:
    if bw is None:
        return ""
    ids = bw["peer_ids"]
    head = "".join(f"<th>{_e(pid)}</th>" for pid in ids)
    rows = []
    for i, row in enumerate(bw["matrix"]):
        cells = "".join(f'<td class="num">{"-" if v is None else f"{v / 1e6:.1f}"}</td>'
                        for v in row)
        rows.append(f"<tr><th>{_e(ids[i] if i < len(ids) else i)}</th>{cells}</tr>")
    return f"<thead><tr><th>from \\ to</th>{head}</tr></thead><tbody>{''.join(rows)}</tbody>"


def _quorum_open(rnd: dict | None) -> str:
    """The open quorum round in one line (the script's ``quorumOpen``)."""
    if rnd is None:
        return "no round open"
    return (f"round {rnd['round']} open: ready {', '.join(rnd['ready']) or 'none'}; "
            f"waiting for {', '.join(rnd['waiting']) or 'none'} (at least "
            f"{rnd['min_peers']}, grace {rnd['grace_s']:g} s)")


def _quorum(q: dict) -> str:
    """The latest closed quorum rounds, newest first: who took part, who was late."""
    head = ("<thead><tr><th>round</th><th>participants (tokens)</th><th>late</th>"
            "<th>closed after</th></tr></thead>")
    rows = []
    for r in reversed(q["closed"]):
        parts = ", ".join(f"{pid} ({t})" for pid, t in zip(r["peer_ids"], r["tokens"]))
        rows.append(f'<tr data-round="{_e(r["round"])}"><td class="num">{_e(r["round"])}</td>'
                    f'<td class="participants">{_e(parts)}</td>'
                    f'<td class="late">{_e(", ".join(r["late"]) or None)}</td>'
                    f'<td class="num">{r["seconds"]:.2f} s</td></tr>')
    return f"{head}<tbody>{''.join(rows)}</tbody>"


# The chart's geometry (SVG user units), shared with the script through `chart_geometry`.
_CHART = {"w": 640, "h": 180, "left": 44, "right": 84, "top": 12, "bottom": 24}


def _chart(history: list) -> str:
    """The world size and throughput history as SVG (the script's ``chart`` draws the same)."""
    g = _CHART
    iw, ih = g["w"] - g["left"] - g["right"], g["h"] - g["top"] - g["bottom"]
    parts = [f'<rect class="frame" x="{g["left"]}" y="{g["top"]}" width="{iw}" height="{ih}"/>']
    if history:
        t0, t1 = history[0]["time"], history[-1]["time"]
        span = max(t1 - t0, 1e-9)
        max_ws = max(max(h["world_size"] for h in history), 1)
        max_bw = max(max(h["bytes_per_s"] for h in history), 1.0)

        def line(key, top):
            return " ".join(f"{g['left'] + iw * (h['time'] - t0) / span:.1f},"
                            f"{g['top'] + ih * (1 - h[key] / top):.1f}" for h in history)
        parts.append(f'<polyline class="ws" points="{line("world_size", max_ws)}"/>')
        parts.append(f'<polyline class="bw" points="{line("bytes_per_s", max_bw)}"/>')
        labels = [(g["left"] - 4, g["top"] + 10, "end", "ws", f"{max_ws}"),
                  (g["left"] - 4, g["top"] + ih, "end", "ws", "0"),
                  (g["w"] - g["right"] + 4, g["top"] + 10, "start", "bw",
                   f"{human_bytes(max_bw)}/s"),
                  (g["left"], g["h"] - 6, "start", "", f"last {span:.0f} s"),
                  (g["w"] - g["right"] - 80, g["h"] - 6, "end", "ws", "world size"),
                  (g["w"] - g["right"], g["h"] - 6, "end", "bw", "throughput")]
        for x, y, anchor, cls, text in labels:
            parts.append(f'<text class="{cls}" x="{x}" y="{y}" text-anchor="{anchor}">'
                         f"{html.escape(text)}</text>")
    return "".join(parts)


def render_page(s: dict, nonce: str) -> str:
    """The status page for status document ``s``: its content rendered here (shown before
    the script's first refresh, and without script), the script re-rendering it from
    ``api/status``. ``nonce``: the Content-Security-Policy nonce of its style and script."""
    drops = ", ".join(f"{k} {v}" for k, v in sorted(s["counters"]["drops"].items())) or "none"
    c = s["counters"]
    sections = {
        "comm-id": _e(s["comm_id"]), "epoch": _e(s["epoch"]),
        "world-size": _e(s["world_size"]),
        "ring-order": _e(" \u2192 ".join(map(str, s["ring_order"])) or None),
        "master-address": _e(s["master"]["address"]),
        "uptime": _e(f"{s['master']['uptime_s']:.0f} s"),
        "peers": "".join(_peer_row(p) for p in s["peers"]),
        "pending": "".join(f"<li>{_e(pid)}</li>" for pid in s["pending"]) or "<li>none</li>",
        "shared-revision": _e(s["shared_state"]["revision"]),
        "shared-digest": _e(s["shared_state"]["content"]),
        "restart": _e(s["restart"]["summary"]),
        "quorum": _quorum(s["quorum"]),
        "quorum-open": _e(_quorum_open(s["quorum"]["open"])),
        "quorum-hidden": "" if s["quorum"]["open"] or s["quorum"]["closed"] else " hidden",
        "bandwidth": _bandwidth(s["bandwidth"]),
        "bandwidth-hidden": " hidden" if s["bandwidth"] is None else "",
        "chart": _chart(s["history"]), "chart-w": _CHART["w"], "chart-h": _CHART["h"],
        "events": "".join(f'<li><time>{_clock(ev["time"])}</time> {_e(ev["text"])}</li>'
                          for ev in reversed(s["events"][-MAX_EVENTS_SHOWN:])),
        "counters": _e(f"joins {c['joins']}; drops: {drops}; update rounds "
                       f"{c['update_rounds']}; sync rounds {c['sync_rounds']}; resumes "
                       f"{c['resumes']}"),
    }
    config = {"refreshMs": REFRESH_MS, "fetchTimeoutMs": FETCH_TIMEOUT_MS,
              "maxEvents": MAX_EVENTS_SHOWN, "chart": _CHART}
    return _PAGE.format(nonce=nonce, css=_CSS, script=_SCRIPT,
                        config=html.escape(json.dumps(config)), **sections)
