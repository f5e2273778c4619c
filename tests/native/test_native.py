"""The native layer on its own: the public header is strict C99, and the I/O-free
parts (wire codec, conversions, reduce kernels, quantization codecs, schedules
executed in memory with their frames dealt over streams and placed by their headers)
pass their C++ unit tests under AddressSanitizer and UndefinedBehaviorSanitizer, and so
do the plain and sealed links over a socketpair.
"""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NATIVE = os.path.join(ROOT, "native")

pytestmark = pytest.mark.skipif(shutil.which("g++") is None or shutil.which("cc") is None,
                                reason="needs a C and a C++ compiler")


def test_public_header_is_strict_c99(tmp_path):
    src = tmp_path / "use_header.c"
    src.write_text('#include "pccl.h"\nint main(void) { return (int)pcclSuccess; }\n')
    subprocess.run(
        ["cc", "-std=c99", "-pedantic", "-Wall", "-Wextra", "-Werror", "-fsyntax-only",
         "-I", os.path.join(NATIVE, "include"), str(src)],
        check=True, capture_output=True, text=True)


def _unit_test_under_sanitizers(tmp_path, test: str, sources: list[str], *args: str) -> None:
    """Builds native/tests/<test>.cpp with the named native/src files under ASan and UBSan,
    runs it with ``args`` and expects its "all passed" line."""
    exe = tmp_path / test
    build = subprocess.run(
        ["g++", "-std=c++17", "-O1", "-g", "-Wall", "-Werror", "-fsanitize=address,undefined",
         "-fno-sanitize-recover=undefined", "-I", os.path.join(NATIVE, "include"),
         "-I", os.path.join(NATIVE, "src"), os.path.join(NATIVE, "tests", f"{test}.cpp"),
         *[os.path.join(NATIVE, "src", f) for f in sources], "-lcrypto", "-o", str(exe)],
        capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all passed" in run.stdout


def test_native_unit_tests_under_sanitizers(tmp_path):
    _unit_test_under_sanitizers(tmp_path, "test_native", ["wire.cpp", "reduce.cpp", "schedule.cpp",
                                                          "quantize.cpp", "seal.cpp", "deal.cpp"])


def test_rate_controller_unit_tests_under_sanitizers(tmp_path):
    """native/tests/test_rate.cpp: the rate controller on a model path and on windows
    recorded through the WAN emulator (native/tests/traces)."""
    _unit_test_under_sanitizers(tmp_path, "test_rate", ["rate.cpp"],
                                os.path.join(NATIVE, "tests", "traces"))


def test_link_unit_tests_under_sanitizers(tmp_path):
    """The plain and sealed FrameLink (native/src/link.hpp) over a socketpair: frames pass,
    a peeked header stays, a frame given back on a full socket frees its record numbers."""
    _unit_test_under_sanitizers(tmp_path, "test_links", ["link.cpp", "sealed_link.cpp", "seal.cpp",
                                                         "wire.cpp", "socket.cpp", "error.cpp"])


def _connect_all(lib, ffi, comms, ports, timeout_ms=5000):
    import threading
    addrs = [ffi.new("char[]", f"127.0.0.1:{p}".encode()) for p in ports]
    arr = ffi.new("char*[]", addrs)
    rcs = [None] * len(comms)

    def run(r):
        rcs[r] = lib.pcclCommConnect(comms[r], arr, timeout_ms)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_ms / 1000 + 5)
    return rcs


def test_listener_outlives_communicators_and_refuses_stale_ids():
    """One listener per peer serves the communicator of each membership epoch; a
    connection carrying another communicator id is refused by the handshake."""
    import socket
    import struct

    from torch_pccl.core.native import ffi, lib

    listeners, ports = [], []
    for _ in range(2):
        p = ffi.new("pcclListener_t*")
        assert lib.pcclListenerCreate(p, b"127.0.0.1", 0) == lib.pcclSuccess
        listeners.append(p[0])
        port = ffi.new("int*")
        lib.pcclListenerGetPort(p[0], port)
        ports.append(port[0])
    try:
        for epoch_id in (101, 202):  # two epochs, same addresses
            comms = []
            for r in range(2):
                c = ffi.new("pcclComm_t*")
                assert lib.pcclCommCreateOnListener(c, r, 2, epoch_id, listeners[r]) == 0
                comms.append(c[0])
            intruders = []
            if epoch_id == 202:
                # Before the real rank 1, rank 0's port gets: a stale peer of epoch 101,
                # an HTTP request, a wrong protocol version, a hello cut short, and a
                # client that says nothing. All are refused and the group still forms.
                bad = [b"PCCL" + struct.pack("<HHQIIII", 1, 1, 101, 1, 2, 0, 0),
                       b"GET / HTTP/1.0\r\n\r\n" + b" " * 20,
                       b"PCCL" + struct.pack("<HHQIIII", 99, 1, 202, 1, 2, 0, 0),
                       b"PCCL\x01\x00", b""]
                for payload in bad:
                    conn = socket.create_connection(("127.0.0.1", ports[0]), timeout=5)
                    if payload:
                        conn.sendall(payload)
                    intruders.append(conn)
            assert _connect_all(lib, ffi, comms, ports) == [0, 0]
            for conn in intruders:
                # Closed by rank 0, never answered: EOF, or a reset where rank 0
                # closed with unread bytes (the HTTP request is longer than a hello).
                try:
                    assert conn.recv(1) == b""
                except ConnectionResetError:
                    pass
                conn.close()
            bufs = [ffi.new("float[]", [float(r + 1)] * 5) for r in range(2)]
            import threading
            rcs = [None, None]

            def reduce(r):
                rcs[r] = lib.pcclAllReduce(comms[r], bufs[r], bufs[r], 5, lib.pcclFloat32,
                                           lib.pcclSum, 0, 5000)

            ts = [threading.Thread(target=reduce, args=(r,)) for r in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(10)
            assert rcs == [0, 0] and bufs[0][4] == 3.0 and bufs[1][0] == 3.0
            for c in comms:
                lib.pcclCommDestroy(c)
    finally:
        for listener in listeners:
            lib.pcclListenerDestroy(listener)


def test_an_id_set_before_connecting_is_the_one_the_handshake_checks():
    """pcclCommSetId: ranks that listen under a placeholder id (how ``bootstrap`` publishes
    its address before it reads rank 0's id) connect under the id set afterwards, refuse a
    peer that set another, and cannot change it once connected."""
    from torch_pccl.core.native import ffi, lib

    def pair(ids, timeout_ms):
        comms, ports = [], []
        for r in range(2):
            c = ffi.new("pcclComm_t*")
            assert lib.pcclCommCreate(c, r, 2, 0, b"127.0.0.1") == lib.pcclSuccess
            comms.append(c[0])
            port = ffi.new("int*")
            lib.pcclCommGetPort(c[0], port)
            ports.append(port[0])
            assert lib.pcclCommSetId(c[0], ids[r]) == lib.pcclSuccess
        return comms, _connect_all(lib, ffi, comms, ports, timeout_ms)

    comms, rcs = pair([2**64 - 5, 2**64 - 5], 5000)
    try:
        assert rcs == [0, 0]
        assert lib.pcclCommSetId(comms[0], 9) == lib.pcclInvalidUsage
    finally:
        for c in comms:
            lib.pcclCommDestroy(c)
    comms, rcs = pair([7, 8], 1000)
    try:
        assert all(rc != lib.pcclSuccess for rc in rcs), rcs
    finally:
        for c in comms:
            lib.pcclCommDestroy(c)


def _build_with_library(tmp_path, test_name, sanitizers, runtime):
    """Builds native/tests/<test_name>.cpp with every native/src file under `sanitizers`;
    returns the executable, or skips when the toolchain cannot link the sanitizer's
    `runtime` ("tsan", "asan")."""
    exe = tmp_path / test_name
    sources = [os.path.join(NATIVE, "tests", f"{test_name}.cpp")] + sorted(
        os.path.join(NATIVE, "src", f) for f in os.listdir(os.path.join(NATIVE, "src"))
        if f.endswith(".cpp"))
    build = subprocess.run(
        ["g++", "-std=c++17", "-O1", "-g", "-Wall", "-Werror", *sanitizers,
         "-I", os.path.join(NATIVE, "include"), *sources, "-lcrypto", "-lpthread",
         "-o", str(exe)],
        capture_output=True, text=True)
    if build.returncode != 0 and runtime in build.stderr.lower():
        pytest.skip(f"this compiler cannot link {sanitizers}: {build.stderr[-300:]}")
    assert build.returncode == 0, build.stderr
    return exe


@pytest.mark.timeout(300)
def test_comm_last_error_is_race_free_under_thread_sanitizer(tmp_path):
    """pcclCommGetLastError read on two threads while a third keeps failing ops on the same
    communicator (native/tests/test_last_error_race.cpp), the whole library built with
    ThreadSanitizer. The pointer used to be the communicator's own string, read after its
    mutex was released: TSan reported the race (and a use after free on reallocation)."""
    exe = _build_with_library(tmp_path, "test_last_error_race", ["-fsanitize=thread"], "tsan")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, TSAN_OPTIONS="halt_on_error=1 exitcode=66"))
    assert "ThreadSanitizer" not in run.stderr, run.stderr[-4000:]
    assert run.returncode == 0 and "all passed" in run.stdout, run.stdout + run.stderr[-2000:]


@pytest.mark.timeout(300)
def test_config_and_single_rank_collectives_under_sanitizers(tmp_path):
    """The typed config (native/tests/test_config.cpp: pcclConfigInit's defaults, every bound
    refused with pcclInvalidArgument, streams and link_timeout_ms refused after connect with
    pcclInvalidUsage, Get returning what Set stored, pcclCommSetOption's old rules) and every
    collective at world size 1 through the shared collective path, the whole library built
    with AddressSanitizer and UndefinedBehaviorSanitizer."""
    exe = _build_with_library(tmp_path, "test_config",
                              ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"],
                              "asan")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "all passed" in run.stdout, run.stdout + run.stderr[-4000:]
