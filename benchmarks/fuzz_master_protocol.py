"""Fuzzes the master protocol decoder (``torch_pccl.control.protocol.Decoder``) with Atheris.

    pip install -e ".[test,fuzz]"                        # atheris, and the checks' test module
    python benchmarks/fuzz_master_protocol.py            # 1,000,000 inputs (documented run)
    python benchmarks/fuzz_master_protocol.py --runs 20000

The suite fuzzes the same decoder with Hypothesis (tests/master/test_master_fuzz.py, 300
inputs per property), which shapes every input but is slow: a few hundred inputs a second.
Atheris is libFuzzer driving Python: coverage-guided, thousands of inputs a second, so a run of a
million is minutes. It checks the suite's own properties, imported from that test module so they
have one home (``feed_all``, ``check_messages``, ``check_error``):
- ``Decoder.feed`` returns messages or raises ``ProtocolError``, nothing else (any other
  exception stops the run and saves the input);
- it never buffers more than one frame (``MAX_MESSAGE_BYTES`` + the 4-byte length);
- a ProtocolError's text fits the master's fatal ``error`` reply;
- every message it returns encodes again and decodes to itself.

An input is a stream and a way to cut it. Byte 0: which messages the decoder accepts (all,
``TO_MASTER`` or ``TO_PEER``) and how the rest becomes the stream: raw (its own length
prefixes, mostly wrong ones), framed (each line of it one frame with the right length, so the
JSON and schema checks are reached), or generated (the rest drives a JSON generator like the
suite's Hypothesis strategy: a valid message of some type with arbitrary fields set or dropped,
values of every JSON type plus NaN, infinities, lone surrogates, huge integers, strings of
6,000 characters, 5,000 nested brackets or digits);
byte 1 seeds the chunk sizes (1 .. 64 bytes, as TCP may deliver them). The seed corpus is one
valid message of each type; the dictionary holds every message type and field name (the suite's
``TYPES`` and ``FIELDS``), both written to ``--out``.

Fails (exit status 1, input saved under ``--out``) on the first violated property or unexpected
exception, or when fewer than ``--runs`` inputs ran. Prints the final figures and writes them to
``<out>/results.json``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import random
import re
import struct
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACCEPTS = (None, "TO_MASTER", "TO_PEER")

# A valid message of each type, as JSON (seeds: mutations start from the schema checks).
SEEDS = [
    {"type": "hello", "magic": "pccl-master", "version": 1, "peer_id": "peer-a",
     "data_addr": "127.0.0.1:4000", "meta": {"host": "a"}},
    {"type": "heartbeat"},
    {"type": "pending", "epoch": 3, "ops": 10, "index": 0},
    {"type": "update", "epoch": 3, "admit": False, "done": 2},
    {"type": "sync", "epoch": 3, "revision": 1, "strategy": "enforce_popular", "fresh": True,
     "content": "0123456789abcdef0123456789abcdef"},
    {"type": "leave"},
    {"type": "unreached", "epoch": 2, "ranks": [0, 3]},
    {"type": "welcome", "peer_id": "peer-a", "state": "pending", "epoch": 0,
     "heartbeat_interval_s": 0.5},
    {"type": "pending_count", "count": 2},
    {"type": "assign", "epoch": 4, "comm_id": 2**64 - 1, "rank": 1, "world_size": 2,
     "addrs": ["127.0.0.1:4000", "[::1]:4001"], "peer_ids": ["a", "b"], "joined": ["b"],
     "left": [], "done": [-1, 5]},
    {"type": "sync_result", "epoch": 4, "revision": 2, "content": "", "sources": [0],
     "outdated": [1], "error": "no agreement"},
    {"type": "error", "message": "bad magic", "fatal": True, "update": False},
    {"type": "member_lost", "epoch": 4, "peer_id": "b", "rank": 1, "reason": "heartbeat"},
    {"type": "auth", "magic": "pccl-master", "version": 1, "nonce": "0f" * 32},
    {"type": "auth_proof", "proof": "a1" * 32},
    {"type": "challenge", "nonce": "5e" * 32, "proof": "c3" * 32},
]


# Strings the schemas look for, so generated fields often pass a check or fail it narrowly.
STRINGS = ["pccl-master", "pending", "accepted", "enforce_popular", "receive_only", "send_only",
           "127.0.0.1:4000", "[::1]:4001", "host:0", "host:65536", ":1", "0" * 32, "f" * 64,
           "A" * 64, "x" * 65, "", "\x00", "\u2028", "\ud800"]
PLACEHOLDER = re.compile(r'"\\u0000(deep|digits):(\d+)"')


def json_value(fdp, depth: int = 0):
    """An arbitrary JSON value drawn from the input, like the suite's Hypothesis strategy but
    with NaN and infinities (json.dumps writes them; the decoder must refuse them), integers
    past 64 bits, strings of up to 6,000 characters, and placeholders that become 1 .. 5,000
    nested brackets or digits."""
    kind = fdp.ConsumeIntInRange(0, 11)
    if kind == 0:
        return None
    if kind == 1:
        return fdp.ConsumeBool()
    if kind == 2:
        return fdp.ConsumeIntInRange(-2**70, 2**70)
    if kind == 3:
        return fdp.ConsumeInt(fdp.ConsumeIntInRange(1, 200))  # up to 1,600 bits
    if kind == 4:
        return fdp.ConsumeFloat()  # NaN and infinities included
    if kind == 5:
        return fdp.ConsumeUnicode(fdp.ConsumeIntInRange(0, 80))
    if kind == 6:
        return fdp.PickValueInList(STRINGS)
    if kind == 7 and depth < 4:
        return [json_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 4))]
    if kind == 8 and depth < 4:
        return {fdp.ConsumeUnicode(8): json_value(fdp, depth + 1)
                for _ in range(fdp.ConsumeIntInRange(0, 4))}
    if kind == 9:
        return f"\x00deep:{fdp.ConsumeIntInRange(1, 5000)}"
    if kind == 10:
        return f"\x00digits:{fdp.ConsumeIntInRange(1, 5000)}"
    return fdp.PickValueInList(["x", "\u00e9", "\U0001f600"]) * fdp.ConsumeIntInRange(0, 6000)


def object_payload(data: bytes, types, fields) -> bytes:
    """One message's JSON: a valid message of a type (the seeds) or only a type, with arbitrary
    fields set to arbitrary values and some required ones dropped."""
    import atheris

    fdp = atheris.FuzzedDataProvider(data)
    base = fdp.ConsumeIntInRange(0, len(SEEDS))
    msg = dict(SEEDS[base]) if base < len(SEEDS) else {"type": fdp.PickValueInList(types)}
    for _ in range(fdp.ConsumeIntInRange(0, 4)):
        name = fdp.PickValueInList(fields) if fdp.ConsumeBool() else fdp.ConsumeUnicode(8)
        if fdp.ConsumeIntInRange(0, 3) == 0:
            msg.pop(name, None)
        else:
            msg[name] = json_value(fdp)
    text = json.dumps(msg)
    return PLACEHOLDER.sub(lambda m: "[" * int(m[2]) + "]" * int(m[2]) if m[1] == "deep"
                           else "9" * int(m[2]), text).encode()


def stream_of(data: bytes, types, fields) -> tuple[int, list[bytes]]:
    """(accept index, chunks) of one input, as the module docstring lays it out."""
    if len(data) < 2:
        return 0, [data]
    mode, cut, rest = data[0], data[1], data[2:]
    if mode & 8:  # generated: one message from the rest, framed
        payload = object_payload(rest, types, fields)
        rest = struct.pack("<I", len(payload)) + payload
    elif mode & 4:  # framed: each line its own frame, with its right length
        rest = b"".join(struct.pack("<I", len(line)) + line for line in rest.split(b"\n"))
    sizes = random.Random(cut)
    chunks, i = [], 0
    while i < len(rest):
        n = sizes.randint(1, 64)
        chunks.append(rest[i:i + n])
        i += n
    return (mode & 3) % 3, chunks


def write_corpus(out: str, types, fields) -> tuple[str, str]:
    seeds = os.path.join(out, "seeds")
    os.makedirs(seeds, exist_ok=True)
    for i, msg in enumerate(SEEDS):
        with open(os.path.join(seeds, f"seed{i}"), "wb") as f:
            f.write(bytes([4, i]) + json.dumps(msg).encode())
    for i in range(len(SEEDS) + 1):  # generated: each seed message as a base, no changes
        with open(os.path.join(seeds, f"generated{i}"), "wb") as f:
            f.write(bytes([8, i, 0, 0, i]))  # FuzzedDataProvider takes integers from the end
    with open(os.path.join(seeds, "two"), "wb") as f:  # two frames in one stream
        f.write(bytes([4 | 1, 7]) + json.dumps(SEEDS[0]).encode() + b"\n"
                + json.dumps(SEEDS[1]).encode())
    # libFuzzer's dictionary: one quoted token a line (its escapes \\ and \" are JSON's):
    # every type and field name as a JSON string, and JSON's constants and a few edge numbers.
    tokens = [json.dumps(w) for w in sorted(set(types) | set(fields) | {"type"})]
    tokens += ["true", "false", "null", "NaN", "Infinity", "1e999", "-1", "18446744073709551616"]
    dictionary = os.path.join(out, "master.dict")
    with open(dictionary, "w") as f:
        f.writelines(json.dumps(token) + "\n" for token in tokens)
    return seeds, dictionary


def fuzz(argv: list[str]) -> None:
    """The libFuzzer process itself (this script, re-run with --child)."""
    import atheris

    import torch_pccl  # noqa: F401  (torch and the c10d glue, uninstrumented: not under test)

    # Coverage feedback from the decoder and what it calls (address parsing); imported
    # before the test module, which would otherwise load it uninstrumented.
    with atheris.instrument_imports(include=["torch_pccl.master", "torch_pccl.core"]):
        from torch_pccl.control import protocol
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from master.test_master_fuzz import FIELDS, TYPES, check_error, check_messages, feed_all

    accepts = [None if a is None else getattr(protocol, a) for a in ACCEPTS]

    def one_input(data: bytes) -> None:
        accept, chunks = stream_of(data, TYPES, FIELDS)
        try:
            check_messages(feed_all(protocol.Decoder(accepts[accept]), chunks))
        except protocol.ProtocolError as exc:
            check_error(exc)

    atheris.Setup([sys.argv[0], *argv], one_input)
    atheris.Fuzz()


def last(pattern: str, text: str) -> str | None:
    found = re.findall(pattern, text, re.MULTILINE)
    return found[-1] if found else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=1_000_000, help="inputs (default 1,000,000)")
    p.add_argument("--max-seconds", type=int, default=7200,
                   help="deadline; stopping there fails the run (default 7200)")
    p.add_argument("--input-timeout", type=int, default=10,
                   help="an input running longer than this is reported as a hang (default 10 s)")
    p.add_argument("--seed", type=int, default=None, help="libFuzzer's seed (default: random)")
    p.add_argument("--out", default=os.path.join(REPO, "runs", "fuzz_master_protocol"),
                   help="corpus, seeds, log, artifacts and results.json")
    p.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        fuzz(args.child)
        return 0
    try:
        import atheris  # noqa: F401
    except ImportError:
        print('fuzz_master_protocol: needs atheris: pip install -e ".[fuzz]"', file=sys.stderr)
        return 77

    sys.path.insert(0, os.path.join(REPO, "tests"))
    from master.test_master_fuzz import FIELDS, TYPES
    os.makedirs(args.out, exist_ok=True)
    seeds, dictionary = write_corpus(args.out, TYPES, FIELDS)
    corpus, artifacts = os.path.join(args.out, "corpus"), os.path.join(args.out, "artifacts")
    os.makedirs(corpus, exist_ok=True)
    os.makedirs(artifacts, exist_ok=True)
    flags = [f"-runs={args.runs}", f"-max_total_time={args.max_seconds}",
             f"-timeout={args.input_timeout}", "-max_len=4096", f"-dict={dictionary}",
             f"-artifact_prefix={artifacts}{os.sep}", "-print_final_stats=1", corpus, seeds]
    if args.seed is not None:
        flags.append(f"-seed={args.seed}")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", *flags]
    print("$", " ".join(cmd), flush=True)
    start = time.monotonic()
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace",
                          timeout=args.max_seconds + 300)
    seconds = time.monotonic() - start
    log = proc.stdout
    with open(os.path.join(args.out, "fuzz.log"), "w") as f:
        f.write(log)
    executed = int(last(r"^stat::number_of_executed_units:\s*(\d+)", log) or 0)
    status = last(r"^#\d+\s+DONE\s+(.*)$", log) or ""
    crashes = sorted(os.listdir(artifacts))
    reports = [line for line in log.splitlines()
               if re.search(r"Uncaught Python exception|Traceback|ERROR: libFuzzer|==\d+== ERROR",
                            line)]
    result = {"runs": executed, "requested_runs": args.runs, "seconds": round(seconds, 1),
              "exec_per_s": round(executed / seconds) if seconds else 0,
              "cov": int(last(r"cov: (\d+)", status) or 0),
              "ft": int(last(r"ft: (\d+)", status) or 0),
              "corpus": last(r"corp: (\S+)", status), "seed": int(last(r"Seed: (\d+)", log) or -1),
              "exit_status": proc.returncode, "reports": reports[:20],
              "artifacts": [os.path.join(artifacts, name) for name in crashes]}
    result["passed"] = (proc.returncode == 0 and executed == args.runs and not crashes
                        and not reports)
    print(f"master protocol: {'passed' if result['passed'] else 'FAILED'}: {executed} runs in "
          f"{result['seconds']} s ({result['exec_per_s']} exec/s), cov {result['cov']}, "
          f"ft {result['ft']}, corpus {result['corpus']}, seed {result['seed']}")
    for line in result["reports"]:
        print("   ", line)
    for path in result["artifacts"]:
        print(f"    artifact: {path} (replay: python {__file__} --child {path})")
    doc = {"atheris": importlib.metadata.version("atheris"), "python": platform.python_version(),
           "cpus": os.cpu_count(), "platform": platform.platform(), "result": result}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
