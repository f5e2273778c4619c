"""The churn soak: DiLoCo training while peers are SIGKILLed, SIGSTOPped and added at random.

Shared by tests/elastic/test_soak.py (a few minutes, in the suite) and benchmarks/soak.py
(``--minutes 60``). No pytest here. A ``pccl-master`` runs as its own process (so its open
files and memory can be read from /proc); every peer is a tests/harness/soak_worker.py process,
started ahead as a standby so that a join does not wait for torch to import. The schedule is
drawn from ``random.Random(seed)``; ``run`` prints the seed.

Events, one every 0.3-1.2 s while the targets are not met: *join* (a standby joins), *kill*
(SIGKILL a live peer), *stop* (SIGSTOP a live peer, SIGCONT it once the master has dropped it:
it must then fail cleanly and exit), and *join+kill* (a standby joins and a live peer is killed
at once, so one outer step sees both). The world stays between 2 and 5 peers.

Checks, returned in ``Result.problems`` (empty when everything held):
- every live peer's outer parameters are bit-identical after every outer step (by step);
- no outer step outlives twice the op deadline;
- no peer fails except the stopped ones (which must);
- the loss keeps falling (mean of the last fifth of the outer steps below the first fifth's);
- the master's open files and resident memory do not grow.
Goodput: the share of inner steps executed whose updates reached the outer parameters.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import random
import re
import signal
import statistics
import struct
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "soak_worker.py")
H = 5                     # inner steps per outer step
OP_TIMEOUT_S = 20.0       # every peer's op deadline (PCCL_TIMEOUT)
HEARTBEAT_TIMEOUT_S = 5.0     # a live peer starved of CPU on a loaded 2-core runner must not be dropped
STANDBYS = 3
MIN_WORLD, MAX_WORLD = 2, 5


@dataclasses.dataclass
class Result:
    seed: int
    kills: int = 0
    joins: int = 0
    stops: int = 0
    join_kills: int = 0
    outer_steps: int = 0
    seconds: float = 0.0
    useful_inner: int = 0
    lost_inner: int = 0
    worst_outer_s: float = 0.0
    master_fds: tuple = (0, 0)
    master_rss_kib: tuple = (0, 0)
    losses: list = dataclasses.field(default_factory=list)      # (step, mean loss)
    worlds: list = dataclasses.field(default_factory=list)      # (seconds, world size)
    problems: list = dataclasses.field(default_factory=list)

    @property
    def goodput(self) -> float:
        total = self.useful_inner + self.lost_inner
        return self.useful_inner / total if total else 0.0


class _Peer:
    def __init__(self, name, master_addr, workdir, quorum=None):
        self.name = name
        self.count_path = os.path.join(workdir, f"{name}.count")
        env = dict(os.environ, PCCL_PEER_ID=name, PCCL_TIMEOUT=str(OP_TIMEOUT_S),
                   OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        if quorum is not None:          # DiLoCo(quorum=Quorum(min_peers, grace))
            env["SOAK_QUORUM"] = f"{quorum[0]},{quorum[1]}"
        self.stderr_path = os.path.join(workdir, f"{name}.stderr")
        with open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, WORKER, master_addr, str(H), self.count_path],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        self.events: queue.Queue = queue.Queue()
        self.started = False
        self.joined = False       # told to join (it may still be pending)
        self.admitted = False     # said "joined": a member with the group's state
        self.stopped_at: float | None = None     # SIGSTOP time; None if never stopped
        self.continued = False
        self.dead = False
        self.last_inner = 0                      # inner steps reported with the last outer step
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                self.events.put(json.loads(line))
            except ValueError:
                pass
        self.events.put(None)

    def inner_done(self) -> int:
        try:
            with open(self.count_path, "rb") as f:
                return struct.unpack("<q", f.read(8))[0]
        except (OSError, struct.error):
            return 0

    def signal(self, sig):
        try:
            self.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def close(self):
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.proc.kill()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass


def _master(workdir, quiet_epochs=False):
    log = open(os.path.join(workdir, "master.log"), "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch_pccl.master", "--host", "127.0.0.1", "--port", "0",
         "--heartbeat-interval", "0.5", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S),
         "--round-timeout", "20", "--log-level", "WARNING",
         "--resume-grace", "0"]             # a new run: no earlier group to wait for
        + (["--quiet-epochs"] if quiet_epochs else []),
        stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO)
    line = proc.stdout.readline()
    m = re.search(r"listening on (\S+)", line)
    if not m:
        proc.kill()
        raise RuntimeError(f"pccl-master did not start: {line!r}")
    return proc, m.group(1)


def _proc_usage(pid):
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    with open(f"/proc/{pid}/status") as f:
        rss = int(next(line.split()[1] for line in f if line.startswith("VmRSS:")))
    return fds, rss


def run(seed: int, workdir: str, kills: int = 30, joins: int = 30, stops: int = 5,
        join_kills: int = 2, max_seconds: float = 600.0, min_seconds: float = 0.0,
        progress=None, quorum: tuple[int, float] | None = None,
        quiet_epochs: bool = False) -> Result:
    """Runs the soak until the event targets are met and ``min_seconds`` have passed (or
    ``max_seconds``, which is then a problem); returns the Result. ``progress(result)`` is
    called about once a second. ``quorum``: ``(min_peers, grace_s)``, every peer's DiLoCo
    then closes its outer steps on a quorum (``torch_pccl.Quorum``). ``quiet_epochs``:
    the master grants quiet epochs (``--quiet-epochs``)."""
    print(f"churn soak: seed {seed}", flush=True)
    rng = random.Random(seed)
    res = Result(seed=seed)
    master, addr = _master(workdir, quiet_epochs)
    peers: list[_Peer] = []
    reports: dict[int, dict[str, str]] = {}          # step -> {peer: digest}
    losses: dict[int, list] = {}
    start = time.monotonic()
    baseline = None
    next_event = start + 2.0
    serial = [0]

    def drain(p, now):
        """Takes in every event peer ``p`` printed since the last call."""
        while True:
            try:
                ev = p.events.get_nowait()
            except queue.Empty:
                return
            if ev is None:
                if not p.dead and p.proc.poll() is not None:
                    p.dead = True
                    if p.stopped_at is None:
                        res.problems.append(f"{p.name} exited ({p.proc.returncode})")
                continue
            kind = ev["event"]
            if kind == "started":
                p.started = True
            elif kind == "joined":
                p.admitted = True
            elif kind == "outer":
                reports.setdefault(ev["step"], {})[p.name] = ev["digest"]
                losses.setdefault(ev["step"], []).append(ev["loss"])
                res.useful_inner += ev["inner"] - p.last_inner
                p.last_inner = ev["inner"]
                res.worst_outer_s = max(res.worst_outer_s, ev["seconds"])
                res.outer_steps = max(res.outer_steps, ev["step"])
                res.worlds.append((now - start, ev["world"]))
            elif kind == "error":
                p.dead = True
                if p.stopped_at is None:
                    res.problems.append(f"{p.name} failed: {ev['type']}: {ev['message']}")
                else:
                    res.lost_inner += max(0, p.inner_done() - p.last_inner)

    def new_peer():
        serial[0] += 1
        p = _Peer(f"s{serial[0]}", addr, workdir, quorum)
        peers.append(p)
        return p

    def live():
        """Members that can be killed or stopped: admitted (they hold the state), running.
        Pending joiners do not count, so the group never loses its last members."""
        return [p for p in peers if p.admitted and not p.dead and p.stopped_at is None]

    def joining():
        return [p for p in peers if p.joined and not p.admitted and not p.dead]

    def standbys():
        return [p for p in peers if p.started and not p.joined and not p.dead]

    def join_one():
        p = rng.choice(standbys())
        p.proc.stdin.write("join\n")
        p.proc.stdin.flush()
        p.joined = True
        res.joins += 1

    def kill_one():
        p = rng.choice(live())
        p.signal(signal.SIGKILL)
        p.dead = True
        res.kills += 1
        res.lost_inner += max(0, p.inner_done() - p.last_inner)

    try:
        for _ in range(3):
            new_peer()
        while True:
            now = time.monotonic()
            for p in peers:
                drain(p, now)
            # Stopped peers: continue them once dropped; they must then fail and exit.
            for p in peers:
                if p.stopped_at is not None and not p.continued and \
                        now - p.stopped_at > HEARTBEAT_TIMEOUT_S + 2.0:
                    p.signal(signal.SIGCONT)
                    p.continued = True
                if p.continued and not p.dead and now - p.stopped_at > HEARTBEAT_TIMEOUT_S + 60:
                    res.problems.append(f"{p.name} did not fail within 60 s of its SIGCONT")
                    p.signal(signal.SIGKILL)
                    p.dead = True
            # Keep standbys warm.
            warm = [p for p in peers if not p.joined and not p.dead]
            for _ in range(STANDBYS - len(warm)):
                new_peer()
            if baseline is None and res.joins >= 3 and res.outer_steps >= 5:
                baseline = _proc_usage(master.pid)
            done = (res.kills >= kills and res.joins >= joins and res.stops >= stops
                    and res.join_kills >= join_kills and now - start >= min_seconds)
            if done or now - start > max_seconds:
                if not done:
                    res.problems.append(f"targets not met in {max_seconds:g} s: {res.kills} kills, "
                                        f"{res.joins} joins, {res.stops} stops")
                break
            if now >= next_event:
                n_live = len(live())
                n_world = n_live + len(joining())
                ready = bool(standbys())
                choices = []
                if ready and n_world < MAX_WORLD and res.joins < joins:
                    choices += ["join"] * 3
                if n_live > MIN_WORLD and res.kills < kills:
                    choices += ["kill"] * 3
                if n_live > MIN_WORLD and res.stops < stops:
                    choices += ["stop"]
                if ready and n_live > MIN_WORLD and n_world < MAX_WORLD and \
                        res.join_kills < join_kills:
                    choices += ["join+kill"]
                if not choices and ready and n_world < MAX_WORLD:
                    choices = ["join"]
                if not choices and n_live > MIN_WORLD:
                    choices = ["kill"]
                action = rng.choice(choices) if choices else None
                if action == "join":
                    join_one()
                elif action == "kill":
                    kill_one()
                elif action == "stop":
                    p = rng.choice(live())
                    p.signal(signal.SIGSTOP)
                    p.stopped_at = now
                    res.stops += 1
                elif action == "join+kill":
                    join_one()
                    kill_one()
                    res.join_kills += 1
                next_event = now + rng.uniform(0.3, 1.2)
            second = int(now - start)
            if progress is not None and second > int(res.seconds):
                progress(res)
            res.seconds = now - start
            time.sleep(0.05)   # the driver's polling period (not synchronisation)
        # Let the survivors finish two more outer steps together and every stopped peer
        # fail (continued once dropped), then take the master's usage.
        settle = time.monotonic() + HEARTBEAT_TIMEOUT_S + 60.0
        last = res.outer_steps
        while time.monotonic() < settle:
            now = time.monotonic()
            for p in peers:
                if p.stopped_at is not None and not p.continued and \
                        now - p.stopped_at > HEARTBEAT_TIMEOUT_S + 2.0:
                    p.signal(signal.SIGCONT)
                    p.continued = True
                drain(p, now)
            waiting = [p for p in peers if p.stopped_at is not None and not p.dead]
            if res.outer_steps >= last + 2 and not waiting:
                break
            time.sleep(0.05)   # polling period
        for p in peers:
            if p.stopped_at is not None and not p.dead:
                res.problems.append(f"{p.name} was stopped and continued but did not fail")
        end_usage = _proc_usage(master.pid)
    finally:
        for p in peers:
            p.close()
    # Checks.
    for step, digests in sorted(reports.items()):
        if len(set(digests.values())) > 1:
            res.problems.append(f"outer step {step}: peers disagree: {digests}")
    if res.worst_outer_s > 2 * OP_TIMEOUT_S:
        res.problems.append(f"an outer step took {res.worst_outer_s:.1f} s "
                            f"(> 2x the {OP_TIMEOUT_S:g} s op deadline)")
    steps = sorted(losses)
    res.losses = [(s, statistics.fmean(losses[s])) for s in steps]
    if len(steps) >= 10:
        fifth = max(1, len(steps) // 5)
        first = statistics.fmean(m for _, m in res.losses[:fifth])
        last = statistics.fmean(m for _, m in res.losses[-fifth:])
        if not last < first:
            res.problems.append(f"the loss did not fall: {first:.4f} -> {last:.4f}")
    else:
        res.problems.append(f"only {len(steps)} outer steps")
    if baseline is None:
        baseline = end_usage
    res.master_fds = (baseline[0], end_usage[0])
    res.master_rss_kib = (baseline[1], end_usage[1])
    # The master's connections: one per live peer or standby at either reading; allow for the
    # difference in live processes plus a little slack, and 32 MiB of memory.
    if end_usage[0] > baseline[0] + MAX_WORLD + STANDBYS + 4:
        res.problems.append(f"the master's open files grew: {baseline[0]} -> {end_usage[0]}")
    if end_usage[1] > baseline[1] + 32 * 1024:
        res.problems.append(f"the master's memory grew: {baseline[1]} -> {end_usage[1]} KiB")
    master.terminate()
    try:
        master.wait(10)
    except subprocess.TimeoutExpired:
        master.kill()
    return res
