"""The status page in a real browser: headless Chromium renders it, and its script keeps it
live, while three real pccl:// peers all-reduce.

``pccl-master`` runs as its own process with ``--http-port 0`` and a shared secret (so the
page's script must pass on the token it was loaded with); three peers join it and
all-reduce in a loop. A page left open in Chromium (read through the DevTools protocol)
and Chromium's ``--dump-dom`` of a fresh load both show the three peers with ranks 0, 1, 2
after the page's script refreshed at least once, and the quorum round that ranks 0 and 1
closed without rank 2 (participants with their tokens, rank 2 late). One peer is SIGKILLed; within the
heartbeat timeout (+ slack) its row is gone or red, on the open page (its script updated
it, no reload) and in a new dump. A screenshot is a PNG; ``/metrics`` parses. Skips,
naming the package, where Chromium is missing (.ci/run installs it). Every wait is
bounded; every process is killed in a finally.
"""

import asyncio
import html.parser
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import REPO
from harness.worker_process import WorkerProcess
from torch_pccl.control import auth

pytestmark = [pytest.mark.timeout(240), pytest.mark.pccl_only]

START_S = 90.0              # three peers importing torch on a loaded 2-core machine
HEARTBEAT_S, HEARTBEAT_TIMEOUT_S = 0.5, 3.0
SLACK_S = 15.0              # beyond the heartbeat timeout: a Chromium run or two
BROWSER_S = 60.0            # bound on one Chromium run
SECRET = "status-page-browser-test-secret"

# A peer: joins, says "ready" with its rank, all-reduces (paced, ~50 a second, so that
# three peers and Chromium share two cores) until its stdin closes; after a failed
# all-reduce (a peer SIGKILLed) it stays connected, heartbeating, until then.
PEER = r"""
import json, os, sys, threading
from datetime import timedelta
import torch, torch.distributed as dist
torch.set_num_threads(1)
def emit(**m):
    sys.stdout.write(json.dumps(m) + "\n"); sys.stdout.flush()
emit(event="started", pid=os.getpid())
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
dist.init_process_group("pccl", init_method="pccl://" + sys.argv[1],
                        timeout=timedelta(seconds=10))
emit(event="ready", rank=dist.get_rank(), world_size=dist.get_world_size())
if dist.get_rank() < 2:     # a DiLoCo quorum round (round 0) that rank 2 is late for
    from torch_pccl.elastic.topology import elastic_group
    elastic_group(None).membership.quorum(0, 100 * (dist.get_rank() + 1), 0, 2, 0.0, 30.0)
t = torch.empty(1024)
while not stop.wait(0.02):      # pacing, not synchronisation
    try:
        dist.all_reduce(t.fill_(1.0))
    except Exception as e:      # noqa: BLE001 - reported; the peer stays to be shown
        emit(event="failed", error=type(e).__name__)
        stop.wait()
"""


def chromium():
    return shutil.which("chromium") or (
        "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None)


def browser_argv(tmp_path, profile, *args):
    return [chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / profile}", *args]


def run_browser(tmp_path, *args):
    """Runs headless Chromium with ``args``; its stdout. Its whole process group is killed
    if it outlives ``BROWSER_S``."""
    argv = browser_argv(tmp_path, "chromium-profile", *args)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=BROWSER_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"chromium {args[-2:]} ran past {BROWSER_S} s") from None
    assert proc.returncode == 0, f"chromium exited {proc.returncode}: {err[-3000:]}"
    return out


def dump_dom(tmp_path, url):
    """The DOM after the page's script ran for 5 s of virtual time."""
    return run_browser(tmp_path, "--virtual-time-budget=5000", "--dump-dom", url)


class Dom(html.parser.HTMLParser):
    """From a dumped DOM: ``refreshes`` (the body's data-refreshes) and ``rows`` {peer id:
    (rank, stale)} of the peers table (stale: the row or its heartbeat cell is red)."""

    def __init__(self, text):
        super().__init__()
        self.refreshes, self.rows, self._row = None, {}, None
        self.quorum, self._cell = [], None      # [round, participants, late] per row
        self.feed(text)

    def handle_data(self, data):
        if self._cell is not None:
            self.quorum[-1][self._cell] += data

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = (attrs.get("class") or "").split()
        if tag == "body":
            self.refreshes = int(attrs["data-refreshes"])
        elif tag == "tr" and "peer" in classes:
            self._row = attrs["data-peer-id"]
            self.rows[self._row] = (attrs["data-rank"], "stale" in classes)
        elif tag == "td" and self._row is not None and "stale" in classes:
            self.rows[self._row] = (self.rows[self._row][0], True)
        elif tag == "tr" and "data-round" in attrs:
            self.quorum.append([attrs["data-round"], "", ""])
        elif tag == "td" and self.quorum and ("participants" in classes or "late" in classes):
            self._cell = 1 if "participants" in classes else 2

    def handle_endtag(self, tag):
        if tag == "tr":
            self._row = None
        elif tag == "td":
            self._cell = None


# What the test reads of the page in a live browser: the body's refresh count (0 while the
# page loads) and the peer rows (id, rank, stale: the row or its heartbeat cell red).
READ_PAGE = """JSON.stringify({
  refreshes: Number((document.body && document.body.dataset.refreshes) || 0),
  rows: Object.fromEntries(Array.from(document.querySelectorAll("#peers tr.peer"), tr =>
    [tr.dataset.peerId, [tr.dataset.rank,
                         tr.classList.contains("stale") || !!tr.querySelector("td.stale")]])),
  quorum: Array.from(document.querySelectorAll("#quorum tr[data-round]"), tr =>
    [tr.dataset.round, tr.querySelector("td.participants").textContent,
     tr.querySelector("td.late").textContent])
})"""


class LivePage:
    """The page kept open in headless Chromium (never reloaded), read through the DevTools
    protocol: what a person watching it sees change."""

    def __init__(self, tmp_path, url):
        self.proc = subprocess.Popen(
            browser_argv(tmp_path, "live-profile", "--remote-debugging-port=0", url),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        lines = queue.Queue()

        def read_stderr():
            for line in self.proc.stderr:
                lines.put(line)
            lines.put(None)
        threading.Thread(target=read_stderr, daemon=True).start()
        deadline = time.monotonic() + BROWSER_S
        m = None
        while m is None:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"chromium: no DevTools address within {BROWSER_S} s")
            assert line is not None, "chromium exited before giving its DevTools address"
            m = re.search(r"DevTools listening on (ws://\S+)", line)
        devtools = m.group(1).split("/devtools/")[0].replace("ws://", "http://")
        with urllib.request.urlopen(devtools + "/json/list", timeout=10) as r:
            targets = [t for t in json.load(r) if t["type"] == "page"]
        assert len(targets) == 1, targets
        self.ws_url = targets[0]["webSocketDebuggerUrl"]

    def read(self):
        """``{"refreshes": n, "rows": {peer id: [rank, stale]}}`` of the page now."""
        async def evaluate():
            async with aiohttp.ClientSession() as session:
                async with session.ws_connect(self.ws_url, max_msg_size=0) as ws:
                    await ws.send_json({"id": 1, "method": "Runtime.evaluate",
                                        "params": {"expression": READ_PAGE,
                                                   "returnByValue": True}})
                    while True:
                        msg = await ws.receive_json()
                        if msg.get("id") == 1:
                            return json.loads(msg["result"]["result"]["value"])
        return asyncio.run(asyncio.wait_for(evaluate(), 10))

    def wait(self, predicate, timeout_s, what):
        """The page's state once ``predicate(state)`` holds; polls every 0.2 s."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.read()
            if predicate(state):
                return state
            assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s: {state}"
            threading.Event().wait(0.2)     # the poll period

    def close(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


def start_master(tmp_path):
    """``python -m torch_pccl.master`` with the status page; (process, control address,
    page URL with the token)."""
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    with open(tmp_path / "master.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch_pccl.master", "--host", "127.0.0.1", "--port", "0",
             "--world-size", "3", "--http-port", "0", "--secret-file", str(secret_file),
             "--resume-grace", "0",
             "--heartbeat-interval", str(HEARTBEAT_S), "--heartbeat-timeout",
             str(HEARTBEAT_TIMEOUT_S)],
            stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO)
    lines = [proc.stdout.readline() for _ in range(2)]     # bounded by the timeout mark
    assert "listening on" in lines[0] and "status page on" in lines[1], (
        lines, (tmp_path / "master.log").read_text())
    addr = lines[0].split()[-1]
    url = lines[1].split()[-1]
    return proc, addr, f"{url}?token={auth.status_token(SECRET.encode())}"


def test_status_page_in_headless_chromium_lists_live_peers_and_marks_a_killed_one(tmp_path):
    if chromium() is None:
        pytest.skip("chromium not installed: .ci/run installs the Debian package 'chromium' "
                    "(apt-get install chromium) for this real-browser test of the status page")
    master, peers, live = None, [], None
    try:
        master, addr, url = start_master(tmp_path)
        env = dict(os.environ, PCCL_SECRET=SECRET, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH"))
                                              if p))
        env.pop("PCCL_SECRET_FILE", None)
        for i in range(3):
            peers.append(WorkerProcess(f"peer{i}", [sys.executable, "-c", PEER, addr],
                                       dict(env, PCCL_PEER_ID=f"peer{i}"),
                                       tmp_path / f"peer{i}.stderr"))
        for p in peers:
            p.recv(START_S, "started")
        ranks = {p.name: p.recv(START_S, "ready")["rank"] for p in peers}
        assert sorted(ranks.values()) == [0, 1, 2]

        names = {name: str(rank) for name, rank in ranks.items()}

        # A page left open: its script fills in the three peers and keeps refreshing.
        live = LivePage(tmp_path, url)
        state = live.wait(lambda st: st["refreshes"] >= 1 and len(st["rows"]) == 3,
                          SLACK_S, "the open page refreshed, listing three peers")
        assert {pid: rank for pid, (rank, _) in state["rows"].items()} == names, state

        # The DOM Chromium dumps after running the page's script: the same.
        dom = Dom(dump_dom(tmp_path, url))
        assert dom.refreshes is not None and dom.refreshes >= 1, "the page's script never refreshed"
        assert {pid: rank for pid, (rank, _) in dom.rows.items()} == names, dom.rows
        assert not any(stale for _, stale in dom.rows.values()), dom.rows
        # The quorum round ranks 0 and 1 closed without rank 2, on both pages.
        by_rank = {rank: name for name, rank in ranks.items()}
        # Participants in peer-id order (the master's), each with its tokens.
        parts = sorted([(by_rank[0], 100), (by_rank[1], 200)])
        round0 = ["0", ", ".join(f"{pid} ({t})" for pid, t in parts), by_rank[2]]
        state = live.wait(lambda st: st["quorum"] == [round0], SLACK_S,
                          "the open page showing the quorum round")
        assert dom.quorum == [round0], dom.quorum

        shot = tmp_path / "page.png"
        run_browser(tmp_path, f"--screenshot={shot}", "--window-size=1280,900", url)
        png = shot.read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000

        victim = peers[1]
        survivors = {p.name for p in peers if p is not victim}
        refreshes = live.read()["refreshes"]
        victim.kill(signal.SIGKILL)
        # The open page, never reloaded, drops the victim's row or turns it red.
        state = live.wait(lambda st: st["rows"].get(victim.name, [None, True])[1],
                          HEARTBEAT_TIMEOUT_S + SLACK_S,
                          f"the open page showing {victim.name} gone or stale")
        assert state["refreshes"] > refreshes and survivors <= set(state["rows"]), state
        # ... and so does a new load of it.
        dom = Dom(dump_dom(tmp_path, url))
        row = dom.rows.get(victim.name)
        assert row is None or row[1], dom.rows
        assert dom.refreshes >= 1 and survivors <= set(dom.rows), dom.rows

        with urllib.request.urlopen(url.replace("/?", "/metrics?"), timeout=10) as r:
            fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
        for name in ("pccl_world_size", "pccl_epoch", "pccl_joins", "pccl_drops",
                     "pccl_update_round_seconds", "pccl_peer_heartbeat_age_seconds"):
            assert name in fams, sorted(fams)
        assert fams["pccl_joins"].samples[0].value == 3
        ages = fams["pccl_peer_heartbeat_age_seconds"].samples
        assert {x.labels["peer_id"] for x in ages} >= survivors
    finally:
        if live is not None:
            live.close()
        for p in peers:
            p.close()
        if master is not None:
            master.terminate()
            try:
                master.wait(15)
            except subprocess.TimeoutExpired:
                master.kill()
                master.wait(15)
