"""The master's status page, /api/status and /metrics over real HTTP (master/http.py).

A MasterServer with ``http_port=0`` runs in its own thread; fake peers speak the control
protocol over raw sockets (hello, heartbeats carrying a ``report``, update); the test reads
the three routes with urllib. Every socket read and HTTP request has a timeout.
"""

import html.parser
import json
import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from torch_pccl.control import auth, protocol
from torch_pccl.master.server import MasterServer

pytestmark = pytest.mark.timeout(60)

WAIT_S = 5.0                     # bound on any single expected message or request
HOSTILE = "<script>x</script>"   # a peer id the page must escape
FAST = dict(heartbeat_interval_s=0.2, heartbeat_timeout_s=10.0, handshake_timeout_s=2.0)


class Peer:
    """A fake peer over a blocking socket: frames out, decoded master messages in."""

    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        self.decoder = protocol.Decoder(protocol.TO_PEER)
        self.inbox = []

    def send(self, msg):
        self.sock.sendall(protocol.encode(msg))

    def recv(self):
        while not self.inbox:
            data = self.sock.recv(65536)          # socket timeout: WAIT_S
            assert data, "master closed the connection"
            self.inbox += self.decoder.feed(data)
        return self.inbox.pop(0)

    def expect(self, kind):
        msg = self.recv()
        assert msg["type"] == kind, msg
        return msg

    def join(self, pid, port):
        self.send({"type": "hello", "magic": protocol.MAGIC, "version": protocol.VERSION,
                   "peer_id": pid, "data_addr": f"127.0.0.1:{port}"})
        return self.expect("welcome")

    def report(self, **report):
        """A heartbeat with ``report``; returns once the master has read it (the answer to
        a later query on the same connection)."""
        self.send({"type": "heartbeat", "report": report})
        self.send({"type": "pending"})
        self.expect("pending_count")

    def closed_by_master(self):
        while self.sock.recv(65536):
            pass

    def close(self):
        self.sock.close()


def get(url, headers=None):
    """(status, headers, body text) of a GET, HTTP errors included."""
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=WAIT_S) as r:
            return r.status, r.headers, r.read().decode("utf-8")
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode("utf-8")


class PeerRows(html.parser.HTMLParser):
    """The page's peer rows: ``rows`` [(attrs, [cell text], [cell classes])]."""

    def __init__(self):
        super().__init__()
        self.rows, self._cell = [], None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "tr" and "peer" in (attrs.get("class") or "").split():
            self.rows.append((attrs, [], []))
        elif tag == "td" and self.rows and self._cell is None:
            self._cell = []
            self.rows[-1][2].append(attrs.get("class") or "")

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None:
            self.rows[-1][1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def peer_rows(page):
    parser = PeerRows()
    parser.feed(page)
    return parser.rows


@pytest.fixture
def master():
    thread = MasterServer("127.0.0.1", 0, world_size=2, http_port=0, secret=b"",
                          **FAST).start_in_thread()
    peers = []
    try:
        yield thread, peers
    finally:
        for p in peers:
            p.close()
        thread.stop()


def test_status_page_api_and_metrics_show_the_peers_and_their_reports(master):
    thread, peers = master
    base = f"http://127.0.0.1:{thread.server.http_port}"
    a, b, late, quitter = (Peer(thread.port) for _ in range(4))
    peers += [a, b, late, quitter]
    a.join("alpha", 40001)
    b.join(HOSTILE, 40002)
    assert [p.expect("assign")["rank"] for p in (a, b)] == [0, 1]
    assert late.join("late", 40003)["state"] == "pending"
    quitter.join("quitter", 40004)
    quitter.send({"type": "leave"})
    quitter.closed_by_master()
    a.report(step=7, sent=123456, received=654321, op="all_reduce", ring=[1, 0],
             links=[-1, 2.5e6])
    b.report(step=7, sent=5, received=6, links=[1.5e6, -1], sync_bytes=4096)

    status, headers, body = get(base + "/api/status")
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    s = json.loads(body)
    assert (s["epoch"], s["world_size"], s["ring_order"]) == (1, 2, [1, 0])
    assert s["master"]["address"] == thread.address
    by_id = {p["peer_id"]: p for p in s["peers"]}
    assert [(p["peer_id"], p["rank"], p["state"]) for p in s["peers"][:2]] == [
        ("alpha", 0, "accepted"), (HOSTILE, 1, "accepted")]
    assert by_id["alpha"]["address"] == "127.0.0.1:40001"
    assert {k: by_id["alpha"][k] for k in ("step", "bytes_sent", "bytes_received", "op")} == {
        "step": 7, "bytes_sent": 123456, "bytes_received": 654321, "op": "all_reduce"}
    assert not by_id["alpha"]["stale"] and by_id["alpha"]["heartbeat_age_s"] < WAIT_S
    assert s["pending"] == ["late"] and s["counters"]["sync_bytes"] == 4096
    assert s["bandwidth"] == {"peer_ids": ["alpha", HOSTILE],
                              "matrix": [[None, 2.5e6], [1.5e6, None]]}
    assert s["counters"]["drops"] == {"left": 1}
    assert any("quitter" in ev["text"] for ev in s["events"])

    status, headers, page = get(base + "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    # The hostile id is shown, escaped, and nowhere unescaped (page and CSP nonce'd script).
    assert HOSTILE not in page and "&lt;script&gt;x&lt;/script&gt;" in page
    nonce = headers["Content-Security-Policy"].split("'nonce-")[1].split("'")[0]
    assert page.count("<script") == 1 and f'<script nonce="{nonce}">' in page
    assert 'data-refreshes="0"' in page and 'fetch("api/status"' in page   # a relative URL
    rows = peer_rows(page)
    assert [(r[0]["data-peer-id"], r[0]["data-rank"]) for r in rows] == [
        ("alpha", "0"), (HOSTILE, "1"), ("late", "-")]
    alpha_cells = rows[0][1]
    assert alpha_cells[:4] == ["alpha", "127.0.0.1:40001", "0", "accepted"]
    assert alpha_cells[5:] == ["7", "120.6 KiB", "639.0 KiB", "all_reduce"]
    assert rows[0][0]["class"] == "peer" and rows[0][2][4] == "age"   # not stale
    assert '<td class="num">2.5</td>' in page and '<td class="num">1.5</td>' in page  # MB/s
    assert "<polyline" in page or not s["history"]

    # An update round admits "late": world 3, epoch 2, one round timed.
    a.send({"type": "update", "epoch": 1})
    b.send({"type": "update", "epoch": 1})
    assert [p.expect("assign")["epoch"] for p in (a, b, late)] == [2, 2, 2]
    status, headers, text = get(base + "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(text)}

    def value(family, sample_name=None, **labels):
        got = [x.value for x in fams[family].samples
               if x.name == (sample_name or family) and x.labels == labels]
        assert len(got) == 1, (family, labels, fams[family].samples)
        return got[0]

    s = json.loads(get(base + "/api/status")[2])
    assert value("pccl_world_size") == 3 and value("pccl_epoch") == 2
    assert value("pccl_pending_peers") == 0
    assert value("pccl_joins", "pccl_joins_total") == s["counters"]["joins"] == 3
    assert value("pccl_drops", "pccl_drops_total", cause="left") == 1
    assert value("pccl_update_rounds", "pccl_update_rounds_total") == 1
    assert fams["pccl_update_round_seconds"].type == "histogram"
    assert value("pccl_update_round_seconds", "pccl_update_round_seconds_count") == 1
    assert 0 <= value("pccl_update_round_seconds", "pccl_update_round_seconds_sum") < WAIT_S
    assert value("pccl_update_round_seconds", "pccl_update_round_seconds_bucket",
                 le="+Inf") == 1
    assert value("pccl_sync_rounds", "pccl_sync_rounds_total") == 0
    assert value("pccl_sync_bytes", "pccl_sync_bytes_total") == 4096
    assert value("pccl_master_resumes", "pccl_master_resumes_total") == 0
    assert value("pccl_peer_bytes_sent", "pccl_peer_bytes_sent_total", peer_id="alpha") == 123456
    assert value("pccl_peer_bytes_received", "pccl_peer_bytes_received_total",
                 peer_id=HOSTILE) == 6
    assert value("pccl_peer_outer_step", peer_id="alpha") == 7
    ages = {x.labels["peer_id"]: x.labels["rank"]
            for x in fams["pccl_peer_heartbeat_age_seconds"].samples}
    assert ages == {"alpha": "0", HOSTILE: "1", "late": "2"}
    # A second scrape does not count the same round twice.
    fams = {f.name: f for f in text_string_to_metric_families(get(base + "/metrics")[2])}
    assert value("pccl_update_round_seconds", "pccl_update_round_seconds_count") == 1


def test_the_page_and_metrics_show_the_grace_window_and_the_joiners_it_holds():
    thread = MasterServer("127.0.0.1", 0, http_port=0, secret=b"", resume_grace_s=30.0,
                          **FAST).start_in_thread()
    joiner = Peer(thread.port)
    try:
        assert joiner.join("held-one", 40005)["state"] == "pending"
        base = f"http://127.0.0.1:{thread.server.http_port}"
        s = json.loads(get(base + "/api/status")[2])
        assert s["restart"]["held"] == ["held-one"] and 0 < s["restart"]["grace_left_s"] <= 30
        assert s["restart"]["summary"].startswith("resume grace window: ")
        page = get(base + "/")[2]
        assert '<p id="restart">resume grace window: ' in page and "holding 1 joiner" in page
        fams = {f.name: f for f in text_string_to_metric_families(get(base + "/metrics")[2])}
        assert fams["pccl_master_held_joiners"].samples[0].value == 1
        assert 0 < fams["pccl_master_resume_grace_seconds_left"].samples[0].value <= 30
        assert any("held: resume grace window" in ev["text"] for ev in s["events"])
    finally:
        joiner.close()
        thread.stop()


def test_with_a_secret_every_route_needs_the_status_token():
    secret = b"status page secret"
    token = auth.status_token(secret)
    thread = MasterServer("127.0.0.1", 0, http_port=0, secret=secret, **FAST).start_in_thread()
    try:
        base = f"http://127.0.0.1:{thread.server.http_port}"
        for path in ("/", "/api/status", "/metrics", "/nowhere"):
            for headers, url in (({}, base + path),
                                 ({}, f"{base}{path}?token={'0' * len(token)}"),
                                 ({"Authorization": "Bearer wrong"}, base + path),
                                 ({"Authorization": f"Basic {token}"}, base + path)):
                status, got, body = get(url, headers)
                assert status == 401, (path, headers, url)
                assert body.count("\n") == 1 and token not in body
                assert got["WWW-Authenticate"].startswith("Bearer")
        for path in ("/", "/api/status", "/metrics"):
            assert get(f"{base}{path}?token={token}")[0] == 200
            assert get(base + path, {"Authorization": f"Bearer {token}"})[0] == 200
        assert json.loads(get(f"{base}/api/status?token={token}")[2])["world_size"] == 0
        # GET only: nothing changes the run.
        req = urllib.request.Request(f"{base}/api/status?token={token}", data=b"{}",
                                     method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=WAIT_S)
        assert e.value.code == 405
    finally:
        thread.stop()
