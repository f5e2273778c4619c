"""The WAN emulator's packet mover: one process, one TUN device per host, one poll loop.

Started by ``wanem.py`` as ``python wanem_forwarder.py CONFIG_JSON`` (standard library only,
so it starts fast and never imports pytest). For every host it enters the host's network
namespace (``setns`` on ``/run/netns/NAME``), opens ``/dev/net/tun`` there, creates the TUN
device with ``IFF_TUN | IFF_NO_PI | IFF_VNET_HDR`` and enables ``TUNSETOFFLOAD``
(CSUM | TSO4 | TSO6), then returns to its own namespace. With offloads on, the kernel hands
whole GSO packets of up to 64 KiB (about 2,000 per second at 1 Gbit/s instead of 80,000
MTU-sized ones), each behind a 10-byte ``virtio_net_hdr``; a packet is written to the
destination host's TUN exactly as it was read, header included, so the receiving stack gets
the same large packet. The TUN devices are not persistent: they vanish when this process
exits, and a dead forwarder shows as "Network is unreachable", never as a silent black hole.

Routing: a packet read from host i's TUN goes to the host whose address is the IPv4
destination; the directed pair (i, j) picks the ``LinkModel`` (delay, rate, queue, loss).
Packets that are not IPv4 or go to no known host are dropped and counted (``unroutable``).

Protocol with the parent (JSON lines): stdout gets ``{"event": "ready", ...}`` once every
TUN is open, then one reply per command; stdin takes ``{"cmd": "stats"}`` (answered after
every TUN has been read empty, so it counts all that the hosts had sent) and
``{"cmd": "set", "src": i, "dst": j, <LinkModel fields>}``. End of file on stdin (the parent
closed it, or died) makes the forwarder exit: it cannot outlive the test that started it.
Errors go to stderr and exit with code 1.
"""

from __future__ import annotations

import ctypes
import fcntl
import heapq
import itertools
import json
import math
import os
import random
import select
import socket
import struct
import sys
import time

# <linux/if_tun.h>, <sched.h>
TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
TUNSETVNETHDRSZ = 0x400454D8
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
TUN_F_CSUM = 0x01
TUN_F_TSO4 = 0x02
TUN_F_TSO6 = 0x04
CLONE_NEWNET = 0x40000000

VNET_HDR_LEN = 10  # sizeof(struct virtio_net_hdr), the kernel's default; set explicitly below
MAX_PACKET = 65536 + 64  # a GSO packet's IP length is at most 65535; under glibc's mmap threshold
READ_BATCH = 64  # packets read from one TUN per wake-up before the others get a turn
MIN_QUEUE_BYTES = 2 * 65536  # the queue always holds two GSO packets, whatever queue_ms says


class LinkModel:
    """One direction of one host pair: fixed delay, serialisation at a rate, tail drop, loss.

    Pure arithmetic on times in seconds and sizes in bytes, no I/O: ``admit`` tells when a
    packet leaves the link, or that it is dropped. A packet occupies the link for
    ``size / rate`` after the previous one finished (``busy_until``), then travels ``delay``;
    so release = max(arrival, busy_until) + size / rate + delay, i.e. the release of the one
    before plus size / rate once a queue has formed. Bytes still waiting for the link
    (``(busy_until - arrival) * rate``) are the queue: a packet that would take it above
    ``queue_ms`` worth of bytes at the rate (at least ``MIN_QUEUE_BYTES``) is dropped at the
    tail. Random loss drops a packet of n MSS segments with probability 1 - (1 - loss)^n, the
    chance that any one of its segments would have been lost on a real path (a GSO packet is
    dropped whole: the emulator does not split packets).

    Args:
        delay_ms: one-way propagation delay in milliseconds (>= 0).
        rate_mbit: link rate in Mbit/s (10^6 bit/s) of IP bytes; None or 0: unlimited, no queue.
        loss: probability in [0, 1) that an MSS-sized segment is lost.
        queue_ms: queue limit, in milliseconds of transmission at the rate.
        rng: the random source for loss (seeded by the caller, one per link).

    Raises:
        ValueError: a parameter out of range.
    """

    def __init__(self, delay_ms: float = 0.0, rate_mbit: float | None = None, loss: float = 0.0,
                 queue_ms: float = 50.0, rng: random.Random | None = None):
        self.rng = rng or random.Random(0)
        self.busy_until = 0.0  # when the link finishes sending what it already holds
        self.last_release = 0.0  # releases never go backwards, even after a change of delay
        self.stats = dict(pkts_in=0, bytes_in=0, pkts_out=0, bytes_out=0, drop_loss=0,
                          drop_queue=0, max_queue_bytes=0)
        self.configure(delay_ms, rate_mbit, loss, queue_ms)

    def configure(self, delay_ms: float, rate_mbit: float | None, loss: float,
                  queue_ms: float) -> None:
        """Sets the parameters (same units as the constructor); packets in flight keep theirs."""
        if not (delay_ms >= 0 and (rate_mbit is None or rate_mbit >= 0) and 0 <= loss < 1
                and queue_ms >= 0):
            raise ValueError(f"bad link: delay_ms={delay_ms} rate_mbit={rate_mbit} "
                             f"loss={loss} queue_ms={queue_ms}")
        self.delay_ms, self.rate_mbit, self.loss, self.queue_ms = (
            delay_ms, rate_mbit, loss, queue_ms)
        self.delay = delay_ms / 1e3
        self.rate = rate_mbit * 1e6 / 8 if rate_mbit else 0.0  # bytes per second; 0: unlimited
        self.queue_bytes = max(MIN_QUEUE_BYTES, queue_ms / 1e3 * self.rate)

    def admit(self, now: float, size: int, segments: int = 1) -> float | None:
        """The release time (s) of a packet of ``size`` wire bytes arriving at ``now`` (s), or
        None when it is dropped (queue full or lost); counts it in ``stats``."""
        st = self.stats
        st["pkts_in"] += 1
        st["bytes_in"] += size
        if self.loss and self.rng.random() < 1.0 - (1.0 - self.loss) ** segments:
            st["drop_loss"] += 1
            return None
        if self.rate:
            queued = max(0.0, self.busy_until - now) * self.rate
            if queued + size > self.queue_bytes:
                st["drop_queue"] += 1
                return None
            st["max_queue_bytes"] = max(st["max_queue_bytes"], int(queued + size))
            self.busy_until = max(now, self.busy_until) + size / self.rate
            release = self.busy_until + self.delay
        else:
            release = now + self.delay
        release = max(release, self.last_release)  # FIFO per link
        self.last_release = release
        st["pkts_out"] += 1
        st["bytes_out"] += size
        return release


def wire_size(pkt: bytes | bytearray, n: int) -> tuple[int, int]:
    """(bytes on the wire, MSS segments) of the ``n``-byte TUN frame ``pkt`` (vnet header first).

    A GSO packet stands for several IP packets that each carry the IP and TCP/UDP headers,
    so its wire size adds those headers once per extra segment; the rate then counts the IP
    bytes a real link would carry (no link-layer framing).
    """
    ip_len = n - VNET_HDR_LEN
    if pkt[1] == 0 or ip_len < 20:  # gso_type VIRTIO_NET_HDR_GSO_NONE: one plain packet
        return ip_len, 1
    gso_size = pkt[4] | (pkt[5] << 8)  # little-endian: the header is in host byte order (x86)
    v = pkt[VNET_HDR_LEN] >> 4
    if v == 4:
        ihl = (pkt[VNET_HDR_LEN] & 0x0F) * 4
        proto = pkt[VNET_HDR_LEN + 9]
    else:  # IPv6 without extension headers, as the kernel's TSO6 packets are
        ihl, proto = 40, pkt[VNET_HDR_LEN + 6]
    l4 = VNET_HDR_LEN + ihl
    if proto == socket.IPPROTO_TCP and n >= l4 + 13:
        hdr = ihl + (pkt[l4 + 12] >> 4) * 4
    else:
        hdr = ihl + 8  # UDP
    segments = max(1, math.ceil((ip_len - hdr) / gso_size)) if gso_size else 1
    return ip_len + (segments - 1) * hdr, segments


def _setns(fd: int) -> None:
    """Moves this (single-threaded) process into the network namespace open as ``fd``."""
    if hasattr(os, "setns"):  # Python 3.12+
        os.setns(fd, CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(CLONE_NEWNET): {os.strerror(err)}")


def open_tun(netns_path: str, dev: str) -> int:
    """Creates TUN device ``dev`` inside the namespace at ``netns_path``; returns its fd.

    Raises:
        OSError: the namespace, /dev/net/tun or an ioctl failed (not root, no TUN driver).
    """
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(netns_path, os.O_RDONLY)
    try:
        _setns(target)
        try:
            # The device is created in the namespace the opener is in when TUNSETIFF runs.
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                ifr = struct.pack("16sH22x", dev.encode(), IFF_TUN | IFF_NO_PI | IFF_VNET_HDR)
                fcntl.ioctl(fd, TUNSETIFF, ifr)
                fcntl.ioctl(fd, TUNSETVNETHDRSZ, struct.pack("i", VNET_HDR_LEN))
                fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6)
            except BaseException:
                os.close(fd)
                raise
        finally:
            _setns(home)
    finally:
        os.close(target)
        os.close(home)
    return fd


class Forwarder:
    """Moves packets between the TUN fds ``tuns`` (host i's at index i) through the links.

    ``addrs[i]`` is host i's IPv4 address; ``links[(i, j)]`` the ``LinkModel`` from i to j.
    """

    def __init__(self, tuns: list[int], addrs: list[str], links: dict[tuple[int, int],
                                                                        LinkModel]):
        self.tuns = tuns
        self.host_of = {socket.inet_aton(a): i for i, a in enumerate(addrs)}
        self.links = links
        self.heap: list[tuple[float, int, int, bytes, LinkModel]] = []
        self.seq = 0  # tie-breaker: equal release times keep arrival order
        self.unroutable = 0
        self.write_errors = 0
        self.started = time.monotonic()
        self._buf = bytearray(MAX_PACKET)
        self._ctl = b""

    def _read(self, src: int, now: float, batch: int | None = READ_BATCH) -> None:
        """Reads up to ``batch`` packets (None: all there are) from host ``src``'s TUN."""
        fd, buf = self.tuns[src], self._buf
        for _ in itertools.repeat(None) if batch is None else range(batch):
            try:
                n = os.readv(fd, [buf])
            except BlockingIOError:
                return
            if n < VNET_HDR_LEN + 20 or buf[VNET_HDR_LEN] >> 4 != 4:
                self.unroutable += 1  # not IPv4 (IPv6 is off in the namespaces) or runt
                continue
            dst = self.host_of.get(bytes(buf[VNET_HDR_LEN + 16:VNET_HDR_LEN + 20]))
            link = self.links.get((src, dst)) if dst is not None else None
            if link is None:
                self.unroutable += 1
                continue
            size, segments = wire_size(buf, n)
            release = link.admit(now, size, segments)
            if release is None:
                continue
            self.seq += 1
            heapq.heappush(self.heap, (release, self.seq, self.tuns[dst], bytes(buf[:n]), link))

    def _release_due(self, now: float) -> None:
        heap = self.heap
        while heap and heap[0][0] <= now:
            _, _, fd, pkt, _ = heapq.heappop(heap)
            try:
                os.write(fd, pkt)
            except OSError:
                self.write_errors += 1  # the destination is going away; a lost packet

    def stats(self) -> dict:
        """Counters of every link plus the forwarder's own (CPU seconds used, wall seconds).

        Every TUN is read empty first, so the counters include every packet the hosts had
        sent before the request (a test can compare them with what its senders report).
        """
        now = time.monotonic()
        for src in range(len(self.tuns)):
            self._read(src, now, batch=None)
        in_flight: dict[int, int] = {}
        for *_, link in self.heap:
            in_flight[id(link)] = in_flight.get(id(link), 0) + 1
        links = [dict(src=s, dst=d, in_flight=in_flight.get(id(m), 0), **m.stats)
                 for (s, d), m in sorted(self.links.items())]
        return dict(event="stats", links=links, unroutable=self.unroutable,
                    write_errors=self.write_errors, cpu_s=time.process_time(),
                    wall_s=time.monotonic() - self.started)

    def _command(self, line: bytes) -> dict:
        msg = json.loads(line)
        if msg.get("cmd") == "stats":
            return self.stats()
        if msg.get("cmd") == "set":
            link = self.links[(int(msg["src"]), int(msg["dst"]))]
            link.configure(msg["delay_ms"], msg["rate_mbit"], msg["loss"], msg["queue_ms"])
            return dict(event="set", src=msg["src"], dst=msg["dst"])
        raise ValueError(f"unknown command {line!r}")

    def _control(self, ctl: int) -> bool:
        """Handles the parent's commands; False at end of file (time to exit)."""
        try:
            chunk = os.read(ctl, 65536)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        self._ctl += chunk
        while b"\n" in self._ctl:
            line, self._ctl = self._ctl.split(b"\n", 1)
            if line.strip():
                emit(self._command(line))
        return True

    def run(self, ctl: int) -> None:
        """The loop: sleeps in ``poll`` until a packet, a command or the next release is due."""
        poller = select.poll()
        for fd in self.tuns:
            poller.register(fd, select.POLLIN)
        poller.register(ctl, select.POLLIN)
        src_of = {fd: i for i, fd in enumerate(self.tuns)}
        while True:
            if self.heap:
                # poll rounds its timeout up to whole milliseconds: never early, never spinning.
                timeout_ms = max(0.0, (self.heap[0][0] - time.monotonic()) * 1e3)
            else:
                timeout_ms = None
            events = poller.poll(timeout_ms)
            now = time.monotonic()
            for fd, ev in events:
                if fd == ctl:
                    if not self._control(ctl):
                        return
                elif ev & select.POLLIN:
                    self._read(src_of[fd], now)
                elif ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                    raise OSError(f"TUN of host {src_of[fd]} failed (poll events {ev:#x})")
            self._release_due(time.monotonic())


def emit(rec: dict) -> None:
    sys.stdout.write(json.dumps(rec) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    """``argv[0]``: JSON ``{"hosts": [{"netns": PATH, "dev": NAME, "addr": IPV4}, ...],
    "links": [{"src": i, "dst": j, "delay_ms", "rate_mbit", "loss", "queue_ms"}, ...],
    "seed": INT}``."""
    cfg = json.loads(argv[0])
    hosts = cfg["hosts"]
    links = {}
    for ln in cfg["links"]:
        s, d = int(ln["src"]), int(ln["dst"])
        # One generator per direction: the loss pattern of a link does not depend on the
        # traffic of the others, so a seeded run drops the same packets every time.
        rng = random.Random(f"{cfg.get('seed', 0)}:{s}:{d}")
        links[(s, d)] = LinkModel(ln["delay_ms"], ln["rate_mbit"], ln["loss"], ln["queue_ms"],
                                  rng)
    try:
        tuns = [open_tun(h["netns"], h["dev"]) for h in hosts]
    except OSError as e:  # no TUN driver, no permission: the environment, not a bug
        emit(dict(event="unavailable", error=f"{type(e).__name__}: {e}"))
        return 2
    fwd = Forwarder(tuns, [h["addr"] for h in hosts], links)
    ctl = sys.stdin.fileno()
    os.set_blocking(ctl, False)
    emit(dict(event="ready", pid=os.getpid(), devs=[h["dev"] for h in hosts]))
    fwd.run(ctl)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
