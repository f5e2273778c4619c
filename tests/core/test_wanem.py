"""The WAN emulator (tests/harness/wanem.py): delay, rate, queue and loss really apply.

The link model is checked alone (pure arithmetic, through the C forwarder's ``--model``
test mode: a C compiler only); the rest sends plain socket traffic between namespaces
through the forwarder (root and /dev/net/tun only, skipped with the reason otherwise). Only
relative properties are asserted: a time against the configured delay, a throughput against
the configured rate, one stream against four.
"""

import json
import os
import struct
import subprocess
import sys

import pytest

from harness import HARNESS
from harness.wanem import Link, WanemUnavailable, forwarder_binary

pytestmark = pytest.mark.timeout(90)

WORKER = os.path.join(HARNESS, "wanem_worker.py")
DEADLINE_S = 30.0  # for any one probe: far above what each needs, so only a hang trips it
MBIT = 1e6 / 8  # bytes per second in one Mbit/s


# --------------------------------------------------------------------------- the model alone


@pytest.fixture(scope="module")
def model():
    """``run(*lines) -> [answer, ...]``: the C link model (``wanem_forwarder --model``), one
    answer per command line; skips where no C compiler can build it."""
    try:
        exe = forwarder_binary()
    except WanemUnavailable as e:
        pytest.skip(f"WAN emulator unavailable: {e}")

    def run(*lines: str) -> list[str]:
        proc = subprocess.run([exe, "--model"], input="\n".join(lines) + "\n",
                              capture_output=True, text=True, timeout=DEADLINE_S)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.splitlines()

    return run


def link_line(delay_ms=0.0, rate_mbit=0.0, loss=0.0, queue_ms=50.0, seed=0):
    return f"link {delay_ms!r} {rate_mbit!r} {loss!r} {queue_ms!r} {seed}"


def test_model_serialises_at_the_rate_then_delays(model):
    out = model(link_line(delay_ms=5, rate_mbit=10),  # 1250 bytes take 1 ms
                *["admit 0 1250 1"] * 3, "admit 1.0 1250 1",
                link_line(delay_ms=5), "admit 2.0 65536 1")  # unlimited rate
    assert out[0] == out[5] == "ok"
    assert [float(x) for x in out[1:4]] == pytest.approx([0.006, 0.007, 0.008])
    assert float(out[4]) == pytest.approx(1.006)  # an idle link has no backlog
    assert float(out[6]) == pytest.approx(2.005)


def test_model_tail_drops_beyond_the_queue(model):
    # 100 ms at 10 Mbit/s is 125,000 bytes, raised to MIN_QUEUE_BYTES.
    out = model("constants", link_line(rate_mbit=10, queue_ms=100), *["admit 0 1250 1"] * 200,
                "stats")
    min_queue_bytes = json.loads(out[0])["min_queue_bytes"]
    answers, stats = out[2:-1], json.loads(out[-1])
    assert set(answers[answers.index("queue"):]) == {"queue"}  # once full, it stays full
    admitted = sum(a != "queue" for a in answers)
    assert admitted * 1250 <= min_queue_bytes < (admitted + 1) * 1250
    assert stats["drop_queue"] == 200 - admitted
    assert stats["pkts_out"] == admitted
    assert stats["max_queue_bytes"] <= min_queue_bytes


def test_model_loss_is_seeded_and_per_segment(model):
    def pattern(seed, segments=1):
        out = model(link_line(loss=0.2, seed=seed), *[f"admit 0 100 {segments}"] * 5000)
        assert out[0] == "ok"
        return [a == "loss" for a in out[1:]]

    assert pattern(1) == pattern(1) != pattern(2)
    assert 0.17 < sum(pattern(1)) / 5000 < 0.23
    # A packet of 10 segments is lost when any of them would be: 1 - 0.8**10 = 0.89.
    assert 0.86 < sum(pattern(1, segments=10)) / 5000 < 0.92


BAD = (dict(delay_ms=-1), dict(rate_mbit=-5), dict(loss=1.0), dict(loss=-0.1),
       dict(queue_ms=-1))


def test_model_rejects_bad_parameters(model):
    for bad in BAD:
        with pytest.raises(ValueError):
            Link(**bad)
        assert model(link_line(**bad)) == ["error bad link"]
    # A refused change leaves the link as it was: still 5 ms, unlimited.
    out = model(link_line(delay_ms=5), "set -1 0 0 50", "set 1 0 1 50", "admit 1.0 100 1")
    assert out[:3] == ["ok", "error bad link", "error bad link"]
    assert float(out[3]) == pytest.approx(1.005)


def test_forwarder_refuses_bad_links_before_opening_anything(model):
    exe = forwarder_binary()
    hosts = ["--host", "/run/netns/absent0", "wan0", "198.18.0.1",
             "--host", "/run/netns/absent1", "wan0", "198.18.0.2"]
    for args in (["--link", "0", "1", "-1", "0", "0", "50"],  # negative delay
                 ["--link", "0", "1", "1", "0", "1.5", "50"],  # loss above 1
                 ["--link", "0", "2", "1", "0", "0", "50"]):  # no host 2
        proc = subprocess.run([exe, *hosts, *args], capture_output=True, text=True,
                              timeout=DEADLINE_S)
        assert proc.returncode == 1 and "bad --link" in proc.stderr, proc.stderr
        assert proc.stdout == ""


def test_wire_size_counts_headers_once_per_segment(model):
    mss, segments = 1448, 10
    ip_len = 20 + 32 + mss * segments
    # virtio_net_hdr: flags, gso_type (1 = TCPv4), hdr_len, gso_size, csum_start, csum_offset
    vnet = struct.pack("<BBHHHH", 1, 1, 66, mss, 20, 16)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, ip_len, 0, 0, 64, 6, 0, bytes(4), bytes(4))
    tcp = struct.pack("!HHIIBB", 1, 2, 0, 0, 8 << 4, 0) + bytes(32 - 14)
    head = vnet + ip + tcp  # the payload is not read: only the frame's length counts
    plain = bytes(2) + head[2:]  # gso_type NONE: one packet, its own size
    out = model("constants", f"wire {len(head) + mss * segments} {head.hex()}",
                f"wire {len(head) + mss * segments} {plain.hex()}")
    assert len(vnet) == json.loads(out[0])["vnet_hdr_len"]
    assert out[1:] == [f"{ip_len + (segments - 1) * 52} {segments}", f"{ip_len} 1"]


# --------------------------------------------------------------------------- through the forwarder


def probe(w, i, *args):
    return w.popen(i, [sys.executable, WORKER, *map(str, args)])


def transfer(w, src, dst, streams, nbytes, port):
    """Sends ``nbytes`` from host src to dst over ``streams`` TCP connections; returns
    (seconds from the first send to the last byte's arrival, the sink's steady rate in B/s)."""
    sink = probe(w, dst, "sink", port, streams)
    sink.next_event(DEADLINE_S, "listening")
    source = probe(w, src, "source", w.addrs[dst], port, streams, nbytes)
    got = sink.finish(DEADLINE_S)
    sent = source.finish(DEADLINE_S)
    assert got["bytes"] == nbytes
    # CLOCK_MONOTONIC is shared by all namespaces: one host's time minus another's is valid.
    return got["last_s"] - sent["start_s"], nbytes / (got["last_s"] - got["first_s"])


def test_delay_applies_in_each_direction(wan_hosts):
    there, back = 20.0, 60.0  # ms, one way each
    w = wan_hosts(2, overrides={(0, 1): Link(delay_ms=there), (1, 0): Link(delay_ms=back)})
    server = probe(w, 1, "echo", 7000)
    server.next_event(DEADLINE_S, "listening")
    r = probe(w, 0, "ping", w.addrs[1], 7000).finish(DEADLINE_S)
    server.finish(DEADLINE_S)
    rtt = (there + back) / 1e3
    assert r["connect_s"] >= rtt  # SYN there, SYN-ACK back
    assert r["total_s"] >= 2 * rtt  # then a request and its response
    assert r["owd_there_s"] >= there / 1e3
    assert r["owd_back_s"] >= back / 1e3
    assert r["owd_back_s"] > r["owd_there_s"]  # each direction has its own delay


def test_rate_caps_each_direction(wan_hosts):
    fast, slow = 40.0, 10.0  # Mbit/s
    w = wan_hosts(2, overrides={(0, 1): Link(delay_ms=5, rate_mbit=fast),
                                (1, 0): Link(delay_ms=5, rate_mbit=slow)})
    _, rate_fast = transfer(w, 0, 1, 1, 2_500_000, 7001)
    _, rate_slow = transfer(w, 1, 0, 1, 700_000, 7002)
    assert rate_fast <= 1.2 * fast * MBIT, f"{rate_fast / MBIT:.1f} Mbit/s over a {fast} link"
    assert rate_slow <= 1.2 * slow * MBIT, f"{rate_slow / MBIT:.1f} Mbit/s over a {slow} link"
    assert rate_fast > 2 * rate_slow  # the directions are capped separately


def test_window_bound_link_rewards_parallel_streams(wan_hosts):
    # 100 ms RTT and a 128 KiB send buffer: one stream is capped by its window (~5 Mbit/s
    # measured: the buffer also holds overhead and unacknowledged data), far below the link's
    # 100 Mbit/s; four streams get about four times that. Slow start costs both the same few
    # round trips, so the ratio is ~3.3 rather than 4 (~3 s for one stream).
    w = wan_hosts(2, Link(delay_ms=50, rate_mbit=100), tcp_wmem_max=128 * 1024)
    nbytes = 2_500_000
    one, _ = transfer(w, 0, 1, 1, nbytes, 7003)
    four, _ = transfer(w, 0, 1, 4, nbytes, 7004)
    assert one >= 2 * four, f"1 stream {one:.2f} s, 4 streams {four:.2f} s"


def test_random_loss_drops_packets_of_one_direction(wan_hosts):
    n = 100
    w = wan_hosts(2, overrides={(0, 1): Link(delay_ms=1, loss=0.2), (1, 0): Link(delay_ms=1)},
                  seed=3)
    server = probe(w, 1, "udp_echo", 7005)
    server.next_event(DEADLINE_S, "listening")
    r = probe(w, 0, "udp_ping", w.addrs[1], 7005, n, 50).finish(DEADLINE_S)
    links = w.stats()["links"]
    dropped = links[(0, 1)]["drop_loss"]
    assert links[(0, 1)]["pkts_in"] == n
    assert 0.05 * n <= dropped <= 0.4 * n
    # Every dropped request goes unanswered; a reply later than 50 ms would also count as lost.
    assert dropped <= r["lost"] <= n
    assert links[(1, 0)]["drop_loss"] == 0


def test_queue_is_bounded(wan_hosts, model):
    min_queue_bytes = json.loads(model("constants")[0])["min_queue_bytes"]
    n, size = 400, 1400  # 560 kB at once into a 10 Mbit/s link with a 10 ms queue
    w = wan_hosts(2, Link(delay_ms=1, rate_mbit=10, queue_ms=10))
    probe(w, 0, "udp_blast", w.addrs[1], 7006, n, size).finish(DEADLINE_S)
    link = w.stats()["links"][(0, 1)]
    assert link["pkts_in"] == n
    assert link["drop_queue"] > 0
    assert link["pkts_out"] + link["drop_queue"] == n
    assert link["max_queue_bytes"] <= min_queue_bytes  # 10 ms at 10 Mbit/s is below the floor


def test_set_link_changes_one_direction_while_running(wan_hosts):
    w = wan_hosts(2, Link(delay_ms=1))
    w.set_link(0, 1, Link(delay_ms=40))
    server = probe(w, 1, "echo", 7007)
    server.next_event(DEADLINE_S, "listening")
    r = probe(w, 0, "ping", w.addrs[1], 7007).finish(DEADLINE_S)
    server.finish(DEADLINE_S)
    assert r["owd_there_s"] >= 0.040
    assert r["owd_back_s"] < r["owd_there_s"]  # the other direction kept its 1 ms
    with pytest.raises(ValueError):
        w.set_link(0, 2, Link())
