"""The request/answer matcher alone (elastic/mailbox.py): no socket, no master, no thread
but the caller's. ``send`` stands in for the session: it records each request and, where
a test says so, delivers the master's answers at once (as the reader thread would)."""

import pytest

from torch_pccl.elastic.mailbox import Mailbox
from torch_pccl.errors import PcclTimeoutError, PeerLostError

pytestmark = pytest.mark.timeout(30)

ADDR = "127.0.0.1:1"


class FakeSession:
    """Records what is sent; ``answer(msg)`` returns the messages delivered in reply."""

    def __init__(self, box, answer=None):
        self.box = box
        self.sent = []
        self.answer = answer or (lambda msg: [])

    def send(self, msg):
        self.sent.append(msg)
        for reply in self.answer(msg):
            self.box.deliver(reply)


def test_an_answer_goes_to_the_request_that_carries_its_id_and_a_late_one_is_dropped():
    box = Mailbox(ADDR)
    # Each pending query is answered first with the id before its own (a late answer).
    s = FakeSession(box, lambda m: [{"type": "pending_count", "count": 99, "id": m["id"] - 1},
                                    {"type": "pending_count", "count": m["id"], "id": m["id"]}])
    counts = [box.ask({"type": "pending"}, s.send, 5, "a count")["count"] for _ in range(3)]
    assert counts == [m["id"] for m in s.sent] == [1, 2, 3]


def test_ids_are_fresh_per_request_and_the_answer_loses_its_id():
    box = Mailbox(ADDR)
    s = FakeSession(box, lambda m: [{"type": "error", "fatal": False, "message": "no",
                                     "update": False, "id": m["id"]}])
    reply = box.ask({"type": "sync"}, s.send, 5, "a vote")
    assert reply == {"type": "error", "fatal": False, "message": "no", "update": False}
    assert [m["id"] for m in s.sent] == [1]


def test_a_wait_without_an_answer_times_out_naming_what_it_waited_for():
    box = Mailbox(ADDR)
    with pytest.raises(PcclTimeoutError, match=r"after 0.05 s waiting for the round "
                                               r"\(master 127.0.0.1:1\)"):
        box.ask({"type": "update"}, FakeSession(box).send, 0.05, "the round")
    with pytest.raises(PcclTimeoutError, match="still pending"):
        box.wait_admission(0.05)


def test_the_failure_is_sticky_and_raised_as_a_fresh_copy():
    box = Mailbox(ADDR)
    assert box.fail(PeerLostError("gone")) and not box.fail(PeerLostError("again"))
    errors = []
    for _ in range(2):
        with pytest.raises(PeerLostError, match="^gone$") as info:
            box.ask({"type": "pending"}, FakeSession(box).send, 5, "a count")
        errors.append(info.value)
    assert errors[0] is not errors[1] and not box.lose()


def test_a_request_whose_connection_was_replaced_is_sent_again_with_a_new_id():
    box = Mailbox(ADDR)

    def answer(msg):
        if len(s.sent) == 1:        # the first connection breaks before the answer
            box.lose()
            box.restore()
            return [{"type": "pending_count", "count": 7, "id": msg["id"]}]
        return [{"type": "pending_count", "count": 8, "id": msg["id"]}]

    s = FakeSession(box, answer)
    assert box.ask({"type": "pending"}, s.send, 5, "a count")["count"] == 8
    assert [m["id"] for m in s.sent] == [1, 2]


def test_a_send_that_breaks_waits_for_the_next_connection():
    box = Mailbox(ADDR)

    def send(msg):
        sent.append(msg)
        if len(sent) == 1:
            raise PeerLostError("send failed")      # the reader has not seen it yet
        box.deliver({"type": "pending_count", "count": 1, "id": msg["id"]})

    sent = []
    # Without a new connection the request waits (no resend on the broken one).
    with pytest.raises(PcclTimeoutError):
        box.ask({"type": "pending"}, send, 0.05, "a count")
    assert len(sent) == 1
    box.restore()
    assert box.ask({"type": "pending"}, send, 5, "a count")["count"] == 1


def test_only_an_assign_without_an_id_is_an_admission():
    box = Mailbox(ADDR)
    box.deliver({"type": "assign", "epoch": 2, "id": 5})        # a late answer: dropped
    box.deliver({"type": "assign", "epoch": 1})
    assert box.wait_admission(1)["epoch"] == 1
    with pytest.raises(PcclTimeoutError):
        box.wait_admission(0.01)


def test_a_ready_sent_ahead_is_answered_by_its_rounds_announcement():
    box = Mailbox(ADDR)
    s = FakeSession(box)
    box.ask_ahead(3, {"type": "ready", "round": 3}, s.send)
    assert box.collect_ahead(4, s.send, 1, "round 4") is None    # another round: ask
    box.deliver({"type": "quorum", "round": 3, "peer_ids": ["a"]})     # no id: not asked
    assert box.collect_ahead(3, s.send, 1, "round 3") == {"type": "quorum", "round": 3,
                                                          "peer_ids": ["a"]}
    assert box.collect_ahead(3, s.send, 1, "round 3") is None    # collected once
    assert box.closed_quorum(3)["peer_ids"] == ["a"]


def test_a_ready_sent_ahead_while_away_is_sent_again_on_the_next_connection():
    box = Mailbox(ADDR)
    box.lose()

    def send(msg):
        if box.away:
            raise PeerLostError("away")
        sent.append(msg)
        box.deliver({"type": "quorum", "round": 3, "peer_ids": ["a"], "id": msg["id"]})

    sent = []
    box.ask_ahead(3, {"type": "ready", "round": 3}, send)        # dropped
    assert sent == []
    box.restore()
    assert box.collect_ahead(3, send, 1, "round 3")["peer_ids"] == ["a"]
    assert [m["id"] for m in sent] == [1]


def test_only_the_latest_sixteen_quorum_rounds_are_kept():
    box = Mailbox(ADDR)
    for r in range(20):
        box.deliver({"type": "quorum", "round": r, "peer_ids": []})
    assert box.closed_quorum(3) is None and box.closed_quorum(4) is not None
