"""Plain-socket probes for the WAN emulator, run inside a host namespace (``Wan.popen``).

Every mode prints JSON lines on stdout (``NsProcess.next_event``/``finish`` read them):
``{"event": "listening"}`` once a server's socket is bound, ``{"event": "result", ...}`` at
the end. Times are ``time.monotonic()`` seconds: CLOCK_MONOTONIC is one clock for every
namespace on the box, so a time taken on one host can be subtracted from one taken on another.

    sink PORT STREAMS              accept STREAMS TCP connections, read each to EOF
    source ADDR PORT STREAMS BYTES send BYTES in total, split over STREAMS connections
    echo PORT                      accept one connection, answer its timestamp with two
    ping ADDR PORT                 connect, send a timestamp, read the answer: one-way delays
    udp_echo PORT                  echo every datagram until killed
    udp_ping ADDR PORT N WAIT_MS   N numbered request/replies, each given WAIT_MS
    udp_blast ADDR PORT N SIZE     N datagrams of SIZE bytes, back to back
"""

from __future__ import annotations

import json
import selectors
import socket
import struct
import sys
import threading
import time

CHUNK = 1 << 20


def emit(**rec) -> None:
    print(json.dumps(rec), flush=True)


def listener(port: int, kind: int = socket.SOCK_STREAM) -> socket.socket:
    s = socket.socket(socket.AF_INET, kind)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    if kind == socket.SOCK_STREAM:
        s.listen(64)
    emit(event="listening", port=port)
    return s


def sink(port: int, streams: int) -> None:
    """Reads every stream to EOF; reports bytes and the first and last byte's arrival."""
    srv = listener(port)
    sel = selectors.DefaultSelector()
    for _ in range(streams):
        conn, _ = srv.accept()
        sel.register(conn, selectors.EVENT_READ)
    buf = bytearray(CHUNK)
    total, first, last, open_ = 0, None, None, streams
    while open_:
        for key, _ in sel.select():
            n = key.fileobj.recv_into(buf)
            now = time.monotonic()
            if n == 0:
                sel.unregister(key.fileobj)
                key.fileobj.close()
                open_ -= 1
                continue
            first = now if first is None else first
            last = now
            total += n
    emit(event="result", bytes=total, first_s=first, last_s=last)


def source(addr: str, port: int, streams: int, nbytes: int) -> None:
    """Connects every stream first, then sends ``nbytes`` split evenly, one thread each."""
    conns = [socket.create_connection((addr, port), timeout=30) for _ in range(streams)]
    data = memoryview(bytes(CHUNK))
    share = [nbytes // streams + (i < nbytes % streams) for i in range(streams)]

    def send(conn: socket.socket, n: int) -> None:
        while n:
            n -= conn.send(data[:min(n, CHUNK)])
        conn.shutdown(socket.SHUT_WR)

    start = time.monotonic()
    threads = [threading.Thread(target=send, args=(c, n)) for c, n in zip(conns, share)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    emit(event="result", start_s=start, sent_s=time.monotonic(), bytes=nbytes)


def echo(port: int) -> None:
    """One connection: its 8-byte timestamp in, (one-way delay in, our timestamp) out."""
    srv = listener(port)
    conn, _ = srv.accept()
    (sent,) = struct.unpack("d", _recv_exact(conn, 8))
    owd = time.monotonic() - sent
    conn.sendall(struct.pack("dd", owd, time.monotonic()))
    emit(event="result", owd_s=owd)
    conn.close()


def ping(addr: str, port: int) -> None:
    """Connect (one round trip), then a timestamp there and one back (a second round trip)."""
    t0 = time.monotonic()
    conn = socket.create_connection((addr, port), timeout=30)
    connected = time.monotonic()
    conn.sendall(struct.pack("d", time.monotonic()))
    owd_there, sent_back = struct.unpack("dd", _recv_exact(conn, 16))
    t1 = time.monotonic()
    emit(event="result", connect_s=connected - t0, total_s=t1 - t0, owd_there_s=owd_there,
         owd_back_s=t1 - sent_back)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"EOF after {len(out)} of {n} bytes")
        out += chunk
    return out


def udp_echo(port: int) -> None:
    s = listener(port, socket.SOCK_DGRAM)
    while True:
        data, peer = s.recvfrom(65536)
        s.sendto(data, peer)


def udp_ping(addr: str, port: int, n: int, wait_ms: float) -> None:
    """Counts the requests whose reply did not come within ``wait_ms`` (late replies are
    recognised by number and ignored)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    lost = 0
    for i in range(n):
        s.sendto(struct.pack("I", i), (addr, port))
        end = time.monotonic() + wait_ms / 1e3
        while True:
            left = end - time.monotonic()
            if left <= 0:
                lost += 1
                break
            s.settimeout(left)
            try:
                data = s.recv(64)
            except TimeoutError:
                continue
            if struct.unpack("I", data[:4])[0] == i:
                break
    emit(event="result", sent=n, lost=lost)


def udp_blast(addr: str, port: int, n: int, size: int) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    payload = bytes(size)
    for _ in range(n):
        s.sendto(payload, (addr, port))
    emit(event="result", sent=n)


MODES = dict(sink=(sink, int, int), source=(source, str, int, int, int), echo=(echo, int),
             ping=(ping, str, int), udp_echo=(udp_echo, int),
             udp_ping=(udp_ping, str, int, int, float), udp_blast=(udp_blast, str, int, int, int))

if __name__ == "__main__":
    fn, *types = MODES[sys.argv[1]]
    fn(*(t(a) for t, a in zip(types, sys.argv[2:], strict=True)))
