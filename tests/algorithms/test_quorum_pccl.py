"""DiLoCo's quorum option end to end over pccl (docs/diloco.md, "Stragglers: quorum rounds").

Three peers (tests/harness/diloco_worker.py processes, a master in a thread) train with
``quorum=Quorum(min_peers=2, grace=0)``; one of them is held back by a hook after its
first inner step of the call until the master closed the round without it. Then, for the
dense, int8 and sparse exchanges in turn (the same processes):

- the other two complete the round without it: its announcement names them, and the
  held-back peer as late, on every peer alike;
- every peer ends every command with bit-identical shared state (outer parameters,
  outer-optimizer state, step);
- the held-back peer's work is merged in a later round (it is among that round's
  participants), and its own record of the first round says it was late. In the second
  round a second peer is held back the same way, so the first one's merge is decided by
  the protocol and not by which of three processes the scheduler of 2 cores runs first:
  with nobody held there, the first one's ready (it is two inner steps ahead) raced the
  others' and lost twice in a row once in CI. In the third round any two may close it.
  The holds are keyed by the outer step: a peer can come late to round 1 before its
  first inner step ends, and a hold keyed by the inner step then held it in round 2 as
  well, with the second peer: two of three held, a round that could not close.

Every wait is bounded; every process is killed in a finally.
"""

import contextlib
import os
import signal

import pytest

from harness import HARNESS
from harness.worker_process import StandbyPeer, call_all, wait_until

pytestmark = [pytest.mark.timeout(300), pytest.mark.pccl_only]

T = 5.0                 # seconds: the groups' op timeout (PCCL_TIMEOUT)
STEP_S = 2 * T + 60     # seconds: deadline of one command that holds collectives
WORKER = os.path.join(HARNESS, "diloco_worker.py")
TOPK = {"density": 1 / 8, "bits": 2, "chunk": 64}


class Peer(StandbyPeer):
    def __init__(self, master_addr, tmp_path, name):
        super().__init__(WORKER, master_addr, tmp_path, name, T, 60.0, 60.0, STEP_S)


@contextlib.contextmanager
def group_of_three(tmp_path, prefix, standby=0):
    """A master in a thread and three peers joined through it, in rank order, and
    ``standby`` more started but not joined; every process is killed on the way out."""
    from torch_pccl.master import start_in_thread

    m = start_in_thread("127.0.0.1", 0, world_size=3, heartbeat_interval_s=0.5,
                        heartbeat_timeout_s=10.0, round_timeout_s=20.0)
    peers = [Peer(m.address, tmp_path, f"{prefix}{i}") for i in range(3)]
    spare = [Peer(m.address, tmp_path, f"{prefix}j{i}") for i in range(standby)]
    try:
        for p in peers:
            p.join()
        for p in peers:
            p.ready()
        peers.sort(key=lambda p: p.rank)
        yield m, peers, spare
    finally:
        for p in peers + spare:
            p.close()
        m.stop()


def same_state(answers):
    first = answers[0]
    for a in answers:
        assert a["sha"] == first["sha"], f"rank {a['rank']} differs from rank {first['rank']}"
        assert a["step"] == first["step"], a["rank"]
    return first["sha"]


def test_a_held_back_peer_is_left_out_of_a_round_and_merged_in_a_later_one(tmp_path):
    with group_of_three(tmp_path, "q") as (_, peers, _):
        names = [p.name for p in peers]
        straggler, second = peers[2], peers[1]
        for options in ({}, {"quantization": "int8"}, {"compression": TOPK}):
            cfg = dict(kind="diloco", sync_every=4, quorum={"min_peers": 2, "grace": 0.0},
                       **options)
            same_state(call_all(peers, "setup", STEP_S, **cfg))     # a new wrapper: step 0
            # The straggler in round 1, the second peer in round 2 (outer steps 0 and 1).
            holds = {straggler.name: [0], second.name: [1]}
            for p in peers:
                p.send("train", until_step=3, hold_in=holds.get(p.name, []))
            answers = [p.recv(STEP_S, "train") for p in peers]
            same_state(answers)
            assert answers[0]["step"] == 3
            first = [a["outer"][0] for a in answers]
            for o in first:
                assert o["participants"] == sorted(names[:2]), (options, first)
                assert o["late"] == [straggler.name], (options, first)
            # Every peer saw the same rounds, with the same participants.
            rounds = [[(o["step"], o["participants"]) for o in a["outer"]] for a in answers]
            assert rounds[0] == rounds[1] == rounds[2], (options, rounds)
            assert len(rounds[0]) == 3
            # The straggler's work went in later: it is a participant of round 2, which
            # closed without the second peer.
            assert rounds[0][1][1] == sorted([names[0], straggler.name]), (options, rounds)
        finished = call_all(peers, "finish", STEP_S)
        same_state(finished)
        assert all(f["eval"] == finished[0]["eval"] for f in finished)


@pytest.mark.parametrize("kind", ["streaming", "async"])
def test_the_overlapping_variants_leave_a_held_back_peer_out_and_merge_it_later(tmp_path,
                                                                                 kind):
    """``StreamingDiLoCo`` (a round per fragment send) and ``AsyncDiLoCo`` with a quorum,
    over pccl: the same holds as above (the straggler out of the outer step's first
    round, the second peer out of the next outer step's), and every peer saw the same
    rounds decided, in the same order, with the same participants."""
    with group_of_three(tmp_path, "q") as (_, peers, _):
        names = [p.name for p in peers]
        straggler, second = peers[2], peers[1]
        extra = {"num_fragments": 2, "tau": 1} if kind == "streaming" else {}
        same_state(call_all(peers, "setup", STEP_S, kind=kind, sync_every=4,
                            quorum={"min_peers": 2, "grace": 0.0}, **extra))
        holds = {straggler.name: [0], second.name: [1]}
        for p in peers:
            p.send("train", until_step=3, hold_in=holds.get(p.name, []))
        answers = [p.recv(STEP_S, "train") for p in peers]
        same_state(answers)
        rounds = [[tuple(map(tuple, r)) for o in a["outer"] for r in o["rounds"]]
                  for a in answers]
        assert rounds[0] == rounds[1] == rounds[2], rounds
        per_step = 2 if kind == "streaming" else 1
        assert len(rounds[0]) == 3 * per_step, rounds[0]
        assert rounds[0][0] == (tuple(sorted(names[:2])), (straggler.name,)), rounds[0]
        # The straggler's work went in later, in the round that held the second peer back.
        assert rounds[0][per_step] == (tuple(sorted([names[0], straggler.name])),
                                       (second.name,)), rounds[0]
        finished = call_all(peers, "finish", STEP_S)
        same_state(finished)
        assert all(f["eval"] == finished[0]["eval"] for f in finished)


@pytest.mark.parametrize("kind", ["streaming", "async"])
def test_the_overlapping_variants_with_a_quorum_admit_a_joiner_and_outlive_a_killed_peer(
        tmp_path, kind):
    """Membership still takes effect at the outer steps with a quorum: a peer pending
    while a round closes is admitted at that outer step's boundary (the announcement says
    peers wait) and receives the group's state in its constructor; a peer SIGKILLed
    between inner steps leaves the live set, the survivors' exchanges that fail are redone
    on the smaller world, and everyone ends every command with the same shared state."""
    with group_of_three(tmp_path, "c", standby=1) as (m, peers, (joiner,)):
        extra = {"num_fragments": 2, "tau": 1} if kind == "streaming" else {}
        cfg = dict(kind=kind, sync_every=4, quorum={"min_peers": 2, "grace": 0.2}, **extra)
        same_state(call_all(peers, "setup", STEP_S, **cfg))
        same_state(call_all(peers, "train", STEP_S, until_step=2))

        joiner.join()
        wait_until(lambda: m.snapshot()["pending"] == 1, 60, "the joiner pending")
        for p in peers:
            p.send("train", until_step=3)
        assert joiner.ready() == 3
        joined = joiner.call("setup", **cfg)
        answers = [p.recv(STEP_S, "train") for p in peers]
        assert joined["step"] == 3 and joined["sha"] == same_state(answers)
        assert [n for a in answers for o in a["outer"] for n in o["joined"]] == \
            [joiner.name] * 3
        everyone = peers + [joiner]
        answers = call_all(everyone, "train", STEP_S, until_step=5)
        same_state(answers)
        assert answers[0]["world_size"] == 4
        # The joiner took part in rounds: its work is in the group's.
        rounds = [r for o in answers[3]["outer"] for r in o["rounds"]]
        assert any(joiner.name in r[0] for r in rounds), rounds

        victim, survivors = peers[1], [peers[0], peers[2], joiner]
        for p in survivors:
            p.send("train", until_step=7)
        victim.send("train", until_step=7, die_at=2)
        victim.recv(STEP_S, "killing")
        assert victim.proc.wait(30) == -signal.SIGKILL
        answers = [p.recv(4 * T + 60, "train") for p in survivors]
        same_state(answers)
        assert all(a["world_size"] == 3 for a in answers)
        for a in answers:
            assert [n for o in a["outer"] for n in o["left"]] == [victim.name], a["outer"]
        finished = call_all(survivors, "finish", STEP_S)
        same_state(finished)
