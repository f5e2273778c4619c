"""The WAN emulator's own cost: TCP streams through its forwarder, its CPU share and the rate.

    sudo python benchmarks/wanem_load.py                                   # unlimited, no delay
    sudo python benchmarks/wanem_load.py --rate-mbit 1000 --delay-ms 50    # 1 Gbit/s, 100 ms RTT
    sudo python benchmarks/wanem_load.py --tests /path/to/old/checkout/tests   # another harness

Two hosts joined by ``tests/harness/wanem.py``; for each stream count, host 0 sends on that
many TCP connections to host 1 (Python threads, 1 MiB sends; the receiver reads 4 MiB at a
time) for ``--warmup-s + --seconds`` s. Over the last ``--seconds`` the forwarder's own
counters give the rate (``bytes_out`` of 0 -> 1, IP bytes) and its share of a core
(``cpu_s`` / ``wall_s``); ``/proc`` splits that share into user and kernel time. Prints one
JSON line per stream count. The senders, receivers and forwarder share the machine's cores,
so on a small or busy machine the numbers say as much about the machine as about the
forwarder: compare runs made side by side. docs/performance.md quotes a run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNK = 1 << 20


def sink(port: int, streams: int) -> None:
    """Accepts ``streams`` connections and reads each to EOF (inside host 1)."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(64)
    print(json.dumps({"event": "listening"}), flush=True)
    conns = [srv.accept()[0] for _ in range(streams)]

    def drain(conn: socket.socket) -> None:
        buf = bytearray(4 * CHUNK)
        while conn.recv_into(buf):
            pass

    threads = [threading.Thread(target=drain, args=(c,)) for c in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"event": "result"}), flush=True)


def source(addr: str, port: int, streams: int, seconds: float) -> None:
    """Sends on ``streams`` connections for ``seconds`` s (inside host 0)."""
    conns = [socket.create_connection((addr, port), timeout=30) for _ in range(streams)]
    data = memoryview(bytes(CHUNK))
    end = time.monotonic() + seconds

    def send(conn: socket.socket) -> None:
        while time.monotonic() < end:
            conn.send(data)
        conn.shutdown(socket.SHUT_WR)

    threads = [threading.Thread(target=send, args=(c,)) for c in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"event": "result"}), flush=True)


def cpu_ticks(pid: int) -> tuple[int, int]:
    """(user, system) clock ticks of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


def measure(args) -> None:
    sys.path.insert(0, args.tests)
    from harness.wanem import Link, wan

    me, hz = os.path.abspath(__file__), os.sysconf("SC_CLK_TCK")
    link = Link(delay_ms=args.delay_ms, rate_mbit=args.rate_mbit or None)
    with wan(2, link) as w:
        w.check_connectivity()
        pid = w.forwarder_pid()
        for i, streams in enumerate(args.streams):
            port = 7100 + i
            rx = w.popen(1, [sys.executable, me, "--sink", str(port), str(streams)])
            rx.next_event(30, "listening")
            tx = w.popen(0, [sys.executable, me, "--source", w.addrs[1], str(port),
                             str(streams), str(args.warmup_s + args.seconds + 1)])
            time.sleep(args.warmup_s)  # the window's start: slow start is not measured
            t0, s0 = cpu_ticks(pid), w.stats()
            time.sleep(args.seconds)  # the measurement window itself
            t1, s1 = cpu_ticks(pid), w.stats()
            tx.finish(60)
            rx.finish(60)
            wall = s1["wall_s"] - s0["wall_s"]
            there0, there1 = s0["links"][(0, 1)], s1["links"][(0, 1)]
            pkts = sum(s1["links"][k]["pkts_out"] - s0["links"][k]["pkts_out"]
                       for k in ((0, 1), (1, 0)))
            data_pkts = max(1, there1["pkts_out"] - there0["pkts_out"])
            print(json.dumps({
                "rate_mbit": args.rate_mbit, "delay_ms": args.delay_ms, "streams": streams,
                "mbit_s": round((there1["bytes_out"] - there0["bytes_out"]) * 8 / wall / 1e6, 1),
                "cpu_share": round((s1["cpu_s"] - s0["cpu_s"]) / wall, 3),
                "user_share": round((t1[0] - t0[0]) / hz / wall, 3),
                "sys_share": round((t1[1] - t0[1]) / hz / wall, 3),
                "pkts_per_s": round(pkts / wall),
                "bytes_per_data_pkt": round((there1["bytes_out"] - there0["bytes_out"])
                                            / data_pkts),
                "drop_queue": there1["drop_queue"] - there0["drop_queue"],
                "write_errors": s1["write_errors"], "unroutable": s1["unroutable"]}),
                  flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate-mbit", type=float, default=0.0, help="link rate; 0: unlimited")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay (RTT / 2)")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4, 9, 16])
    p.add_argument("--seconds", type=float, default=10.0, help="measurement window")
    p.add_argument("--warmup-s", type=float, default=4.0)
    p.add_argument("--tests", default=os.path.join(REPO, "tests"),
                   help="the tests/ folder whose harness (and forwarder) to measure")
    p.add_argument("--sink", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--source", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.sink:
        sink(int(args.sink[0]), int(args.sink[1]))
    elif args.source:
        source(args.source[0], int(args.source[1]), int(args.source[2]), float(args.source[3]))
    else:
        measure(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
