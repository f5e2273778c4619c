"""Fuzzes the native wire codec and the quantized payload codec with libFuzzer under ASan + UBSan.

    python benchmarks/fuzz_wire.py                       # 1,000,000 inputs per target
    python benchmarks/fuzz_wire.py --runs 20000 --max-seconds 60 --targets wire

Builds ``native/fuzz/fuzz_wire.cpp`` (hello and frame-header decoders, ``check_expected``,
``abort_code``) and ``native/fuzz/fuzz_quant.cpp`` (int8/int4 block messages received from a peer)
with only the native sources each needs, writes a small seed corpus (valid hellos, headers and
messages, so even a short run starts past the magic numbers), then runs the targets one after the
other, each for exactly ``--runs`` inputs in one process, and prints libFuzzer's final figures:
inputs executed, seconds, inputs per second, coverage (``cov``: instrumented edges reached; ``ft``:
libFuzzer's features) and corpus size. The properties each target checks are in its header
comment and in docs/protocol.md#fuzzing.

A run fails (exit status 1) when libFuzzer reports anything (a crash, a violated property, a
sanitizer report, an input slower than ``--input-timeout``, a leak, a malloc over 2 GiB), when it
executed fewer than ``--runs`` inputs (``--max-seconds`` is a deadline, not a way to pass), or when
it left a crash artifact; the artifact's path is printed, and
``<out>/fuzz_<target> <artifact>`` replays it. Exit status 77 (nothing run) when no clang++ with
libFuzzer is found: on Debian/Ubuntu ``apt-get install clang-14 libclang-rt-14-dev``, or name
one with ``--cxx``. tests/native/test_fuzz_wire.py runs this script with a small
``--runs`` in the suite.

Writes the figures to ``<out>/results.json``; ``<out>/corpus_<target>`` keeps what libFuzzer
found, and a later run with the same ``--out`` starts from it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NATIVE = os.path.join(REPO, "native")
FUZZ = os.path.join(NATIVE, "fuzz")
SKIP = 77  # "nothing was tested" (the automake convention); the test turns it into a skip
INSTALL_HINT = ("needs clang++ with libFuzzer and the sanitizer runtimes: "
                "apt-get install clang-14 libclang-rt-14-dev (or name one with --cxx)")

# One entry per target: its sources (the fuzzer first), libFuzzer's input size cap and the
# dictionary of magic numbers and boundary values it gets.
TARGETS = {
    "wire": {"sources": ["fuzz/fuzz_wire.cpp", "src/wire.cpp"], "max_len": 128,
             "dict": "wire.dict"},
    "quant": {"sources": ["fuzz/fuzz_quant.cpp", "src/quantize.cpp", "src/schedule.cpp",
                          "src/wire.cpp"], "max_len": 4096, "dict": "quant.dict"},
}
# -ffp-contract=off: fuzz_quant compares decoded floats bit for bit with its own
# code * scale; a fused multiply-add in one and not the other would differ by a rounding.
CXXFLAGS = ["-std=c++17", "-g", "-O1", "-Wall", "-Werror", "-ffp-contract=off",
            "-fsanitize=fuzzer,address,undefined", "-fno-sanitize-recover=all",
            "-I", os.path.join(NATIVE, "include"), "-I", os.path.join(NATIVE, "src")]


def find_compiler(build_dir: str, names: list[str]) -> str | None:
    """The first of ``names`` that links a libFuzzer target with ASan and UBSan, or None."""
    probe = os.path.join(build_dir, "probe.cpp")
    with open(probe, "w") as f:
        f.write("#include <cstddef>\n#include <cstdint>\nextern \"C\" int "
                "LLVMFuzzerTestOneInput(const uint8_t *, size_t) { return 0; }\n")
    for name in names:
        cxx = shutil.which(name)
        if cxx and subprocess.run([cxx, *CXXFLAGS, probe, "-o", probe[:-4]],
                                  capture_output=True).returncode == 0:
            return cxx
    return None


def build(cxx: str, target: str, build_dir: str) -> str:
    exe = os.path.join(build_dir, f"fuzz_{target}")
    sources = [os.path.join(NATIVE, s) for s in TARGETS[target]["sources"]]
    subprocess.run([cxx, *CXXFLAGS, *sources, "-o", exe], check=True)
    return exe


def write_seeds(target: str, seed_dir: str) -> None:
    """A few valid inputs in each target's layout (see the target's header comment)."""
    os.makedirs(seed_dir, exist_ok=True)
    seeds = []
    if target == "wire":
        def hello(rank, world, lane=0, stream=0, lanes=1, streams=1):
            return struct.pack("<IHHQIIHHHH", 0x4C434350, 1, 1, 0x1234ABCD, rank, world,
                               lane, stream, lanes, streams)

        def frame(type_, coll, dtype, op, root=0, tag=0, step=0, seq=0, count=0, length=0):
            return struct.pack("<HBBBBHIIQQQ", 0xF7A3, type_, coll, dtype, op, root, tag, step,
                               seq, count, length)

        data = frame(1, 1, 0, 0, tag=7, step=2, seq=12, count=1000, length=4000)
        seeds.append(hello(1, 2) + data + data + struct.pack("<H", 0x1FF))          # all equal
        seeds.append(hello(3, 4, 1, 2, 2, 4) + frame(1, 2, 6, 0xFF, root=3, count=9, length=36)
                     + frame(1, 2, 6, 0xFF, root=1, count=9, length=36) + struct.pack("<H", 0x1DF))
        seeds.append(hello(0, 1, lanes=0, streams=0) + frame(2, 0, 0, 0, count=4, length=64)
                     + data + b"\0\0")                                             # an ABORT
        seeds.append(hello(1, 2) + frame(1, 8, 0, 0, root=256, count=4096, length=4096)
                     + frame(1, 8, 0, 0, root=128, count=4096, length=4096)
                     + struct.pack("<H", 0x1DF))                                    # int8 block
    else:
        def head(mode, block, n):
            return struct.pack("<BHH", mode, block, n)

        scales = struct.pack("<2f", 0.5, 2.0 ** -140)                 # a normal and a subnormal
        seeds.append(head(0, 4, 8) + scales + bytes([0x7F, 0x80, 1, 0xFF, 2, 3, 0, 0x81]))
        seeds.append(head(1 | 2, 3, 6) + scales + bytes([0x78, 0x87, 0xF1]))   # int4, add
        seeds.append(head(4, 1, 2) + struct.pack("<2f", float("nan"), 1.0) + b"\x05\xFB")  # float16
        values = struct.pack("<8f", 1.0, -2.5, 7.0, 0.1, 3e38, -1e-40, 0.0, float("inf"))
        seeds.append(head(8, 3, 0) + values)                                    # int8, float32
        seeds.append(head(8 | 1, 5, 0) + values)                                # int4, float32
        seeds.append(head(8 | 1 | 2, 2, 0) + struct.pack("<4H", 0x3C00, 0x7BFF, 0x0001, 0xFC00))
    for i, seed in enumerate(seeds):
        with open(os.path.join(seed_dir, f"seed{i}"), "wb") as f:
            f.write(seed)


def last(pattern: str, text: str) -> str | None:
    found = re.findall(pattern, text, re.MULTILINE)
    return found[-1] if found else None


def run(exe: str, target: str, out: str, runs: int, max_seconds: int, input_timeout: int,
        seed: int | None) -> dict:
    """Runs one target for ``runs`` inputs; returns its figures and whether it passed."""
    corpus, seeds = os.path.join(out, f"corpus_{target}"), os.path.join(out, f"seeds_{target}")
    os.makedirs(corpus, exist_ok=True)
    write_seeds(target, seeds)
    artifacts = os.path.join(out, f"artifacts_{target}") + os.sep
    os.makedirs(artifacts, exist_ok=True)
    cmd = [exe, f"-runs={runs}", f"-max_total_time={max_seconds}", f"-timeout={input_timeout}",
           f"-max_len={TARGETS[target]['max_len']}",
           f"-dict={os.path.join(FUZZ, TARGETS[target]['dict'])}",
           f"-artifact_prefix={artifacts}", "-print_final_stats=1",
           # Comparison operands as features: inputs closer to a bound (op 4 -> 5, length
           # 2^30 -> 2^30 + 1) are kept, so off-by-one bounds are reached in a short run.
           "-use_value_profile=1", corpus, seeds]
    if seed is not None:
        cmd.append(f"-seed={seed}")
    print("$", " ".join(cmd), flush=True)
    start = time.monotonic()
    # No stdin; the subprocess deadline backs up -max_total_time in case libFuzzer hangs.
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace",
                          timeout=max_seconds + 120)
    seconds = time.monotonic() - start
    log = proc.stdout
    with open(os.path.join(out, f"fuzz_{target}.log"), "w") as f:
        f.write(log)
    done = last(r"^Done (\d+) runs in (\d+) second", log)
    status = last(r"^#\d+\s+DONE\s+(.*)$", log) or last(r"^#\d+\s+\w+\s+(cov: .*)$", log) or ""
    executed = int(last(r"^stat::number_of_executed_units:\s*(\d+)", log) or 0)
    crashes = sorted(os.listdir(artifacts))
    reports = [line for line in log.splitlines()
               if re.search(r"ERROR: (Address|Leak|Undefined)Sanitizer|runtime error:|"
                            r"property violated|ERROR: libFuzzer|==\d+== ERROR", line)]
    result = {
        "target": target, "runs": executed, "requested_runs": runs,
        "seconds": round(seconds, 1), "exec_per_s": round(executed / seconds) if seconds else 0,
        "cov": int(last(r"cov: (\d+)", status) or 0), "ft": int(last(r"ft: (\d+)", status) or 0),
        "corpus": last(r"corp: (\S+)", status), "seed": int(last(r"Seed: (\d+)", log) or -1),
        "exit_status": proc.returncode, "reports": reports[:20],
        "artifacts": [artifacts + name for name in crashes],
    }
    result["passed"] = (proc.returncode == 0 and done is not None and executed == runs
                        and not crashes and not reports)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=1_000_000, help="inputs per target (default 1e6)")
    p.add_argument("--targets", nargs="+", choices=sorted(TARGETS),
                   default=sorted(TARGETS, reverse=True), help="default: wire, then quant")
    p.add_argument("--max-seconds", type=int, default=3600,
                   help="deadline per target; stopping there fails the run (default 3600)")
    p.add_argument("--input-timeout", type=int, default=10,
                   help="an input running longer than this is reported as a hang (default 10 s)")
    p.add_argument("--seed", type=int, default=None, help="libFuzzer's seed (default: random)")
    p.add_argument("--cxx", default=None,
                   help="the clang++ to use (default: clang++, then clang++-20 .. clang++-14)")
    p.add_argument("--out", default=os.path.join(REPO, "runs", "fuzz_wire"),
                   help="binaries, corpora, logs, artifacts, results.json (default runs/fuzz_wire)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as probe_dir:
        names = [args.cxx] if args.cxx else ["clang++"] + [f"clang++-{v}" for v in range(20, 13, -1)]
        cxx = find_compiler(probe_dir, names)
    if cxx is None:
        print(f"fuzz_wire: {INSTALL_HINT}", file=sys.stderr)
        return SKIP
    compiler = subprocess.run([cxx, "--version"], capture_output=True,
                              text=True).stdout.split("\n")[0]
    results = []
    for target in args.targets:
        exe = build(cxx, target, args.out)
        r = run(exe, target, args.out, args.runs, args.max_seconds, args.input_timeout, args.seed)
        results.append(r)
        print(f"{target}: {'passed' if r['passed'] else 'FAILED'}: {r['runs']} runs in "
              f"{r['seconds']} s ({r['exec_per_s']} exec/s), cov {r['cov']}, ft {r['ft']}, "
              f"corpus {r['corpus']}, seed {r['seed']}", flush=True)
        for line in r["reports"]:
            print("   ", line)
        for path in r["artifacts"]:
            print(f"    artifact: {path} (replay: {exe} {path})")
    doc = {"compiler": compiler, "cxxflags": CXXFLAGS, "cpus": os.cpu_count(),
           "platform": platform.platform(), "results": results}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
