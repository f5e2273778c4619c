"""The master over real TCP (torch_pccl/master/server.py and the pccl-master CLI).

Every wait is bounded: clients read with a timeout and each test body runs
under asyncio.wait_for, so a broken master fails a test instead of hanging it.
"""

import asyncio
import json
import contextlib
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest

from torch_pccl.control import protocol
from torch_pccl.master import run_file
from torch_pccl.master.server import MasterServer, start_in_thread

pytestmark = pytest.mark.timeout(60)

WAIT_S = 5.0   # bound on any single expected event
FAST = dict(heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0, handshake_timeout_s=0.5)


def run(coro, timeout_s=20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def hello(pid, port=40000, **extra):
    msg = {"type": "hello", "magic": protocol.MAGIC, "version": protocol.VERSION,
           "peer_id": pid, "data_addr": f"127.0.0.1:{port}"}
    msg.update(extra)
    return msg


class Client:
    """A test peer: raw frames out, decoded master messages in, every read bounded."""

    def __init__(self, reader, writer):
        self.reader = reader
        self.writer = writer
        self.decoder = protocol.Decoder(protocol.TO_PEER)
        self.inbox = []

    open_clients = []    # closed by `serving` when the test ends

    @classmethod
    async def connect(cls, port):
        client = cls(*await asyncio.open_connection("127.0.0.1", port))
        cls.open_clients.append(client)
        return client

    async def send(self, msg):
        await self.send_raw(protocol.encode(msg))

    async def send_raw(self, data):
        self.writer.write(data)
        await self.writer.drain()

    async def recv(self, timeout_s=WAIT_S):
        """The next message; AssertionError on EOF or timeout."""
        while not self.inbox:
            data = await asyncio.wait_for(self.reader.read(65536), timeout_s)
            assert data, "master closed the connection"
            self.inbox += self.decoder.feed(data)
        return self.inbox.pop(0)

    async def expect(self, kind, timeout_s=WAIT_S):
        msg = await self.recv(timeout_s)
        assert msg["type"] == kind, msg
        return msg

    async def closed_by_master(self, timeout_s=WAIT_S):
        """Reads until EOF (within timeout_s); returns every message received before it."""
        out = list(self.inbox)
        self.inbox = []
        while True:
            try:
                data = await asyncio.wait_for(self.reader.read(65536), timeout_s)
            except ConnectionResetError:
                return out
            if not data:
                return out
            out += self.decoder.feed(data)

    async def join(self, pid, port=40000):
        await self.send(hello(pid, port))
        return await self.expect("welcome")

    def close(self):
        self.writer.close()


@contextlib.asynccontextmanager
async def serving(**kwargs):
    """A started MasterServer on 127.0.0.1; stops it and closes the test's clients after."""
    server = MasterServer("127.0.0.1", 0, **{**FAST, **kwargs})
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
        for client in Client.open_clients:
            client.close()
        Client.open_clients.clear()


def test_three_clients_through_a_round():
    async def body():
        async with serving(world_size=2) as server:
            a, b, c = [await Client.connect(server.port) for _ in range(3)]
            assert (await a.join("a", 40001))["state"] == "pending"
            await b.join("b", 40002)
            assigns = [await x.expect("assign") for x in (a, b)]
            assert [m["rank"] for m in assigns] == [0, 1]
            assert all(m["epoch"] == 1 and m["world_size"] == 2 for m in assigns)
            assert (await c.join("c", 40003)) == {
                "type": "welcome", "peer_id": "c", "state": "pending", "epoch": 1,
                "heartbeat_interval_s": 0.2}
            await a.send({"type": "pending"})
            assert (await a.expect("pending_count"))["count"] == 1
            await a.send({"type": "heartbeat"})
            await a.send({"type": "update", "epoch": 1})
            await b.send({"type": "update", "epoch": 1})
            got = [await x.expect("assign") for x in (a, b, c)]
            assert [m["rank"] for m in got] == [0, 1, 2]
            for m in got:
                assert m["epoch"] == 2 and m["world_size"] == 3
                assert m["peer_ids"] == ["a", "b", "c"]
                assert m["addrs"] == ["127.0.0.1:40001", "127.0.0.1:40002", "127.0.0.1:40003"]
                assert m["joined"] == ["c"] and m["left"] == []
            assert len({m["comm_id"] for m in got}) == 1
            # A clean leave: the master closes the connection without an error.
            await c.send({"type": "leave"})
            assert await c.closed_by_master() == []
            # ... and the next round names c in `left`.
            await a.send({"type": "update", "epoch": 2})
            await b.send({"type": "update", "epoch": 2})
            m = await a.expect("assign")
            assert m["epoch"] == 3 and m["world_size"] == 2 and m["left"] == ["c"]
            snap = server.snapshot()
            assert snap["epoch"] == 3 and [p["peer_id"] for p in snap["peers"]] == ["a", "b"]
    run(body())


def raw_frame(obj) -> bytes:
    """A frame of any JSON object, valid or not (``protocol.encode`` refuses bad ones)."""
    payload = json.dumps(obj).encode()
    return struct.pack("<I", len(payload)) + payload


BAD_CLIENTS = {
    "garbage": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "length_2_31": struct.pack("<I", 2**31),      # no payload ever follows
    "wrong_version": protocol.encode(hello("v")).replace(b'"version":1', b'"version":9'),
    "wrong_magic": protocol.encode(hello("m")).replace(b"pccl-master", b"pccl-mastex"),
    "not_hello_first": protocol.encode({"type": "update", "epoch": 0}),
    "nothing": b"",
    "truncated_then_silent": protocol.encode(hello("t"))[:10],
    # Values the error must quote without echoing them whole (and still fit its reply).
    "huge_magic": raw_frame(dict(hello("hm"), magic="x" * 5000)),
    "huge_version": raw_frame(dict(hello("hv"), version=10 ** 4000)),
    "huge_epoch": raw_frame({"type": "hello", "magic": protocol.MAGIC, "version": 1,
                             "peer_id": "he", "data_addr": "127.0.0.1:1",
                             "meta": {"x": "y" * 30_000}}) + raw_frame(
        {"type": "update", "epoch": -(10 ** 3000)}),
}


def test_bad_clients_are_disconnected_while_good_ones_complete_a_round(caplog):
    caplog.set_level(logging.INFO, logger="torch_pccl.master")

    async def body():
        async with serving(world_size=2) as server:
            bad = {}
            for name, data in BAD_CLIENTS.items():
                bad[name] = await Client.connect(server.port)
                if data:
                    await bad[name].send_raw(data)
            # The good peers run bootstrap and a round while the bad ones are pending.
            a, b = await Client.connect(server.port), await Client.connect(server.port)
            await a.join("a")
            await b.join("b")
            await a.expect("assign")
            await b.expect("assign")
            await a.send({"type": "update", "epoch": 1})
            await b.send({"type": "update", "epoch": 1})
            assert (await a.expect("assign"))["epoch"] == 2
            assert (await b.expect("assign"))["epoch"] == 2

            # Every bad client is closed; the handshake deadline (0.5 s) bounds the silent ones.
            t0 = time.monotonic()
            results = await asyncio.gather(*(c.closed_by_master() for c in bad.values()))
            assert time.monotonic() - t0 < 3.0
            errors = {name: [m for m in msgs if m["type"] == "error"]
                      for name, msgs in zip(bad, results)}
            for name, errs in errors.items():
                assert len(errs) == 1 and errs[0]["fatal"], (name, errs)
            assert "version 9" in errors["wrong_version"][0]["message"]
            assert "frame length" in errors["length_2_31"][0]["message"]
            assert "no hello" in errors["nothing"][0]["message"]
            assert "no hello" in errors["truncated_then_silent"][0]["message"]
            for name, quoted in (("huge_magic", "(5002 characters)"),
                                 ("huge_version", "bits>"), ("huge_epoch", "bits>")):
                message = errors[name][0]["message"]
                assert quoted in message and len(message) < 300, (name, message[:400])

            # Still serving: a newcomer joins and the good peers are untouched.
            late = await Client.connect(server.port)
            assert (await late.join("late"))["state"] == "pending"
            await a.send({"type": "pending"})
            assert (await a.expect("pending_count"))["count"] == 1
            assert server.snapshot()["world_size"] == 2
    run(body())
    # Protocol errors are logged with the remote address.
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("127.0.0.1:" in w and "version 9" in w for w in warnings), warnings
    assert any("frame length" in w for w in warnings), warnings
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any(line.startswith("epoch 2:") for line in infos), infos


def test_truncated_frame_at_eof_is_logged_and_dropped(caplog):
    caplog.set_level(logging.INFO, logger="torch_pccl.master")

    async def body():
        async with serving(world_size=0) as server:
            a = await Client.connect(server.port)
            await a.join("a")
            await a.expect("assign")
            t = await Client.connect(server.port)
            await t.send_raw(protocol.encode(hello("t"))[:-3])
            t.writer.write_eof()
            assert await t.closed_by_master() == []
            # The master still answers a.
            await a.send({"type": "pending"})
            assert (await a.expect("pending_count"))["count"] == 0
    run(body())
    assert any("inside a frame" in r.getMessage() for r in caplog.records)


def test_silent_member_is_dropped_and_the_survivor_regroups():
    async def body():
        async with serving(world_size=2, heartbeat_interval_s=0.1,
                           heartbeat_timeout_s=1.0) as server:
            a, b = await Client.connect(server.port), await Client.connect(server.port)
            await a.join("a")
            await b.join("b")
            await a.expect("assign")
            await b.expect("assign")
            stop = asyncio.Event()

            async def beat():
                while not stop.is_set():
                    await a.send({"type": "heartbeat"})
                    try:
                        await asyncio.wait_for(stop.wait(), 0.1)
                    except asyncio.TimeoutError:
                        pass
            beater = asyncio.create_task(beat())
            msgs = await b.closed_by_master()       # b never heartbeats
            assert "heartbeat timeout" in msgs[0]["message"]
            # a hears of it at once (it may be blocked in a collective with b).
            lost = await a.expect("member_lost")
            assert (lost["epoch"], lost["peer_id"], lost["rank"]) == (1, "b", 1)
            assert "heartbeat timeout" in lost["reason"]
            await a.send({"type": "update", "epoch": 1})
            m = await a.expect("assign")
            assert m["world_size"] == 1 and m["left"] == ["b"]
            stop.set()
            await beater
    run(body())


@pytest.mark.parametrize("how", ["send_timeout", "queue_full"])
def test_peer_that_does_not_take_its_messages_is_dropped(how, caplog):
    caplog.set_level(logging.WARNING, logger="torch_pccl.master")
    # Filling real socket buffers would take megabytes; instead the server's
    # drain() for this peer never completes, as with a peer that stopped reading.
    kwargs = ({"send_timeout_s": 0.3} if how == "send_timeout"
              else {"send_timeout_s": 30.0, "max_queued_messages": 4})

    async def body():
        async with serving(world_size=0, **kwargs) as server:
            a = await Client.connect(server.port)
            await a.join("a")
            await a.expect("assign")
            slow = await Client.connect(server.port)
            await slow.join("slow")
            [conn] = [c for c in server._conns.values() if c.cid == 2]
            never = asyncio.get_running_loop().create_future()

            async def stuck_drain():
                await never
            conn.writer.drain = stuck_drain
            for _ in range(8):
                await slow.send({"type": "pending"})
            await slow.closed_by_master()
            assert [p["peer_id"] for p in server.snapshot()["peers"]] == ["a"]
            await a.send({"type": "pending"})          # the others are still served
            assert (await a.expect("pending_count"))["count"] == 0
    run(body())
    expected = "within 0.3 s" if how == "send_timeout" else "queued and unsent"
    assert any(expected in r.getMessage() for r in caplog.records), caplog.text


def test_stop_tells_peers_and_closes():
    async def body():
        async with serving() as server:
            a = await Client.connect(server.port)
            await a.join("a")
            await server.stop()
            msgs = await a.closed_by_master()
            assert msgs[-1] == {"type": "error", "fatal": True, "update": False,
                                "auth": False, "stopping": True, "replaced": False,
                                "replica": False, "layout": False,
                                "message": "master is shutting down"}
    run(body())


def _sync_recv(sock, decoder, deadline_s=WAIT_S):
    sock.settimeout(deadline_s)
    msgs = []
    while not msgs:
        data = sock.recv(65536)
        assert data
        msgs = decoder.feed(data)
    return msgs


def test_start_in_thread():
    master = start_in_thread("127.0.0.1", 0, world_size=0)
    try:
        assert master.port > 0 and master.address == f"127.0.0.1:{master.port}"
        with socket.create_connection(("127.0.0.1", master.port), timeout=WAIT_S) as s:
            s.sendall(protocol.encode(hello("embedded")))
            d = protocol.Decoder(protocol.TO_PEER)
            msgs = _sync_recv(s, d)
            while len(msgs) < 2:
                msgs += _sync_recv(s, d)
            assert [m["type"] for m in msgs] == ["welcome", "assign"]
            snap = master.snapshot()
            assert snap["epoch"] == 1 and snap["peers"][0]["peer_id"] == "embedded"
            # A second master cannot bind the same port: the error reaches the caller.
            with pytest.raises(OSError):
                start_in_thread("127.0.0.1", master.port)
    finally:
        master.stop()
    master.stop()     # idempotent
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", master.port), timeout=WAIT_S).close()


def test_sync_round_with_master_clients():
    from concurrent.futures import ThreadPoolExecutor

    from torch_pccl.errors import PcclError, PcclTimeoutError
    from torch_pccl.elastic.master_client import MasterClient

    a_digest, b_digest = "a" * 32, "b" * 32
    master = start_in_thread("127.0.0.1", 0, world_size=3, quiet_epochs=True, **FAST)
    clients = []
    try:
        for i in range(3):
            clients.append(MasterClient(master.address, f"127.0.0.1:{41000 + i}",
                                        peer_id=f"p{i}", timeout_s=WAIT_S))
        assert [c.wait_assignment(WAIT_S).rank for c in clients] == [0, 1, 2]

        def sync_all(votes, voters=clients):
            # Each client blocks in request_sync until the last vote is in.
            with ThreadPoolExecutor(len(voters)) as pool:
                futures = [pool.submit(c.request_sync, 1, *vote, timeout_s=WAIT_S)
                           for c, vote in zip(voters, votes)]
                return [f.result(timeout=2 * WAIT_S) for f in futures]

        first = sync_all([(1, "enforce_popular", True, a_digest),
                          (1, "receive_only", True, b_digest),
                          (1, "send_only", True, a_digest)])
        # Every member voted, nobody is pending: the result grants the epoch quiet.
        assert first == [{"type": "sync_result", "epoch": 1, "revision": 1,
                          "content": a_digest, "sources": [0, 2], "outdated": [1],
                          "error": "", "quiet": True}] * 3
        assert master.snapshot()["shared_state"] == {"revision": 1, "content": a_digest}

        second = sync_all([(3, "enforce_popular", False, a_digest),    # R + 2
                           (2, "enforce_popular", False, a_digest),
                           (2, "enforce_popular", False, a_digest)])
        assert all(r == second[0] for r in second)
        assert second[0]["error"].startswith("peer p0 (rank 0) syncs revision 3, but the "
                                             "shared state is at revision 1")
        assert (second[0]["content"], second[0]["sources"]) == ("", [])
        assert master.snapshot()["shared_state"] == {"revision": 1, "content": a_digest}

        with pytest.raises(PcclError, match="refused the sync: sync for epoch 7"):
            clients[0].request_sync(7, 1, "enforce_popular", False, a_digest, WAIT_S)
        assert clients[0].pending_count(WAIT_S) == 0     # the connection still works

        # p0 gives up waiting; its vote still counts once the others vote, and the
        # late result (content b) must not answer p0's next sync.
        with pytest.raises(PcclTimeoutError):
            clients[0].request_sync(1, 2, "enforce_popular", False, b_digest, 0.2)
        late = sync_all([(2, "receive_only", False, b_digest)] * 2, voters=clients[1:])
        assert [r["content"] for r in late] == [b_digest] * 2
        # The master sent p0's late result before this answer: it has arrived now.
        assert clients[0].pending_count(WAIT_S) == 0
        third = sync_all([(2, "enforce_popular", False, a_digest)] * 3)
        assert [r["content"] for r in third] == [a_digest] * 3
    finally:
        for c in clients:
            c.close()
        master.stop()


def _master_command():
    script = os.path.join(os.path.dirname(sys.executable), "pccl-master")
    if os.path.exists(script):
        return [script]
    return [sys.executable, "-m", "torch_pccl.master"]


def test_cli_prints_its_address_serves_and_stops_on_sigterm():
    args = ["--host", "127.0.0.1", "--port", "0", "--heartbeat-timeout", "5",
            "--round-timeout", "9"]
    proc = subprocess.Popen(_master_command() + args, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60.0)   # includes importing torch
        assert ready, "pccl-master printed nothing within 60 s"
        line = proc.stdout.readline().strip()
        assert line.startswith("pccl-master listening on 127.0.0.1:"), line
        port = int(line.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as s:
            s.sendall(protocol.encode(hello("cli")))
            welcome = _sync_recv(s, protocol.Decoder(protocol.TO_PEER))[0]
            # Held by the default resume grace window (heartbeat timeout 5 s + 1 s): this
            # master cannot know whether members of an earlier group will re-register.
            assert welcome["type"] == "welcome" and welcome["state"] == "pending", welcome
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        err = proc.stderr.read()
        assert "peer cli" in err                    # INFO log of the join
        assert "joiners are held for 6 s (resume grace window)" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=15)
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.parametrize("args", [["--heartbeat-timeout", "0.5", "--heartbeat-interval", "1"],
                                  ["--port", "70000"]])
def test_cli_rejects_bad_options(args):
    from torch_pccl.master.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2


def test_cli_refuses_a_damaged_state_file_naming_it(tmp_path):
    state = tmp_path / "run.json"
    state.write_text('{"format": "pccl-master-state", "version": 1, "epoch": 0}')
    proc = subprocess.run(_master_command() + ["--host", "127.0.0.1", "--port", "0",
                                               "--state-file", str(state)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc
    assert f"state file {state}" in proc.stderr and "content" in proc.stderr, proc.stderr


def test_a_master_with_a_state_file_rewrites_it_at_every_epoch_and_sync(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from torch_pccl.elastic.master_client import MasterClient

    state = str(tmp_path / "run.json")
    master = start_in_thread("127.0.0.1", 0, world_size=2, state_file=state, **FAST)
    clients = []
    try:
        assert run_file.load(state) is None         # no group yet: nothing to keep
        for i in range(2):
            clients.append(MasterClient(master.address, f"127.0.0.1:{42000 + i}",
                                        peer_id=f"m{i}", timeout_s=WAIT_S))
        for c in clients:
            c.wait_assignment(WAIT_S)
        first = run_file.load(state)
        assert first["epoch"] == 1 and first["peer_ids"] == ["m0", "m1"]
        assert first["addrs"] == ["127.0.0.1:42000", "127.0.0.1:42001"]
        assert (first["revision"], first["content"]) == (-1, "")
        with ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(c.request_sync, 1, 1, "enforce_popular", True, "c" * 32,
                                  WAIT_S) for c in clients]:
                assert f.result()["error"] == ""
        assert run_file.load(state) == dict(first, revision=1, content="c" * 32)
        with ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(c.request_update, 1, WAIT_S) for c in clients]:
                f.result()
        second = run_file.load(state)
        assert second["epoch"] == 2 and second["comm_id"] != first["comm_id"]
        assert second["revision"] == 1
        for c in clients:
            c.close()
        master.stop()
        # A master started on the file knows the run before anyone connects.
        master = start_in_thread("127.0.0.1", 0, state_file=state, resume_grace_s=30.0,
                                 **FAST)
        snap = master.snapshot()
        assert (snap["epoch"], snap["comm_id"]) == (2, second["comm_id"])
        assert snap["shared_state"] == {"revision": 1, "content": "c" * 32}
        assert snap["restart"]["source"] == "state file"
        assert snap["restart"]["resuming"] == ["m0", "m1"]
        assert snap["restart"]["grace_until"] is None
    finally:
        for c in clients:
            c.close()
        master.stop()


def test_cli_takes_the_secret_from_the_peers_settings(tmp_path):
    """An operator who exports PCCL_SECRET_FILE as the README shows and starts pccl-master
    without --secret-file gets a master that requires the secret (and refuses a peer that
    does not prove it)."""
    secret = tmp_path / "secret"
    secret.write_text("the run's secret, 16+ chars\n")
    env = dict(os.environ, PCCL_SECRET_FILE=str(secret))
    env.pop("PCCL_SECRET", None)
    proc = subprocess.Popen(_master_command() + ["--host", "127.0.0.1", "--port", "0",
                                                 "--resume-grace", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60.0)
        assert ready, "pccl-master printed nothing within 60 s"
        port = int(proc.stdout.readline().strip().rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as s:
            s.sendall(protocol.encode(hello("no-secret")))
            err = _sync_recv(s, protocol.Decoder(protocol.TO_PEER))[0]
            assert err["type"] == "error" and err["auth"], err
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert "shared secret required" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=15)


def test_quorum_rounds_with_master_clients_ready_sent_ahead_or_asked():
    """Quorum rounds through a real master and ``MasterClient``s: p0 sends its ready ahead
    (``send_ready``) and later only waits; p1 asks (``request_quorum``); p2 is never ready
    and finds the announcement without asking (``closed_quorum``). A ready sent ahead for
    another epoch is refused at the wait, and the connection still works."""
    from concurrent.futures import ThreadPoolExecutor

    from torch_pccl.errors import PcclError
    from torch_pccl.elastic.master_client import MasterClient

    master = start_in_thread("127.0.0.1", 0, world_size=3, **FAST)
    clients = []
    try:
        for i in range(3):
            clients.append(MasterClient(master.address, f"127.0.0.1:{41100 + i}",
                                        peer_id=f"p{i}", timeout_s=WAIT_S))
        assert [c.wait_assignment(WAIT_S).rank for c in clients] == [0, 1, 2]
        p0, p1, p2 = clients
        p0.send_ready(1, 5, 30, 0, 2, 0.0)
        with ThreadPoolExecutor(2) as pool:
            asked = pool.submit(p1.request_quorum, 1, 5, 20, 1, 2, 0.0, WAIT_S)
            ahead = pool.submit(p0.request_quorum, 1, 5, 999, 0, 2, 0.0, WAIT_S)
            got = [ahead.result(timeout=2 * WAIT_S), asked.result(timeout=2 * WAIT_S)]
        for m in got:
            assert (m["round"], m["peer_ids"], m["tokens"], m["stale"]) == \
                (5, ["p0", "p1"], [30, 20], [0, 1])    # p0's tokens: those sent ahead
        late = None
        deadline = time.monotonic() + WAIT_S
        while late is None and time.monotonic() < deadline:
            late = p2.closed_quorum(5)
            time.sleep(0.01)        # polling what the reader thread stores
        assert late is not None and late["peer_ids"] == ["p0", "p1"]
        assert master.snapshot()["quorum"]["closed"][-1]["late"] == ["p2"]
        p0.send_ready(7, 6, 1, 0, 2, 0.0)           # not the current epoch
        with pytest.raises(PcclError, match="refused the ready"):
            p0.request_quorum(7, 6, 1, 0, 2, 0.0, WAIT_S)
        assert p0.pending_count(WAIT_S) == 0        # the connection still works
    finally:
        for c in clients:
            c.close()
        master.stop()
