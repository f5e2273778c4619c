"""The parts of a Membership that need no master and no process group: the all-or-nothing
ledger's roll-forward decision, the pending queries' keys, the boundary owner, the
member-lost watch and the status report (issue 38: one concern per module)."""

import gc

import pytest
import torch

from torch_pccl.elastic.ledger import ExchangeLedger
from torch_pccl.elastic.owner import BoundaryOwner
from torch_pccl.elastic.pending import PendingKeys
from torch_pccl.elastic.report import PeerReport
from torch_pccl.elastic.watch import LostMemberWatch
from torch_pccl.errors import InvalidUsageError, ProtocolError

pytestmark = [pytest.mark.timeout(30)]


def ledger_with(done, result=None, in_progress=None):
    led = ExchangeLedger()
    for _ in range(done):
        led.begin(torch.zeros(1))
        led.end(result if result is not None else torch.zeros(1))
    if in_progress is not None:
        led.begin(in_progress)
    return led


def test_equal_counts_and_joiners_roll_nothing_forward():
    assert ledger_with(2).roll_forward_source([2, 2, 2], 1) is None
    # A joiner counted none (-1): the epoch just left was not its own.
    assert ledger_with(2).roll_forward_source([2, -1, 2], 0) is None
    assert ledger_with(0).roll_forward_source([], 0) is None


def test_the_lowest_rank_that_completed_sends_its_result():
    result, under_way = torch.ones(3), torch.zeros(3)
    # This member completed 3: it broadcasts its kept result from rank 1, the lowest with 3.
    src, buf = ledger_with(3, result=result).roll_forward_source([2, 3, 3], 2)
    assert (src, buf) == (1, result)
    # This member completed 2 of 3: its tensor under way receives.
    src, buf = ledger_with(2, in_progress=under_way).roll_forward_source([2, 3, 3], 0)
    assert src == 1 and buf is under_way


def test_counts_two_apart_or_no_tensor_are_refused():
    with pytest.raises(ProtocolError, match="differ by more than one"):
        ledger_with(3).roll_forward_source([1, 3], 0)
    with pytest.raises(InvalidUsageError, match="holds no tensor"):
        ledger_with(2).roll_forward_source([2, 3], 0)


def test_a_rolled_exchange_is_not_redone_and_a_new_epoch_starts_at_zero():
    led = ledger_with(2, in_progress=torch.zeros(1))
    assert not led.rolled_forward
    led.rolled()
    assert led.rolled_forward
    led.new_epoch()
    assert led.done == 0
    led.begin(torch.zeros(1))
    assert not led.rolled_forward


def test_a_kept_result_outlives_the_refill_of_its_tensor():
    # A member that passed a boundary quiet refills the exchange's tensor with its next
    # pseudo-gradient; a member whose copy of the exchange failed must still get the result.
    buf = torch.full((4,), 2.0)
    led = ledger_with(3, result=buf)
    led.keep()
    buf.fill_(-1.0)                               # the next exchange's fill
    led.begin(buf)
    assert led.busy
    src, sent = led.roll_forward_source([3, 2], 0)
    assert src == 0 and sent is not buf and torch.equal(sent, torch.full((4,), 2.0))
    led.keep()                                    # kept already: nothing more copied
    assert led.busy
    assert led.roll_forward_source([3, 2], 0)[1] is sent
    # The next result is kept in the same tensor (no new allocation per outer step).
    led.end(buf)
    assert not led.busy
    led.keep()                                    # past the next boundary: busy until
    assert led.busy                               # the exchange after it completes
    led.new_epoch()
    assert not led.busy
    led.end(buf)
    led.keep()
    assert led.roll_forward_source([2, 1], 0)[1] is sent and torch.equal(sent, buf)
    ExchangeLedger().keep()                       # nothing completed: nothing to keep


def test_a_boundary_is_passed_quiet_when_a_top_member_came_from_its_next_exchange():
    # Rank 0 completed 3 exchanges and came from inside its fourth: it had passed the
    # boundary after the third without a vote; rank 1 (its third failed) and rank 2 (at
    # that boundary) pass it the same way.
    assert ExchangeLedger.passed([3, 2, 3], [True, True, False])
    # Every member at the top came from a boundary: it is voted as before.
    assert not ExchangeLedger.passed([3, 2, 3], [False, True, False])
    # All inside the same exchange (it failed for all): nobody is at a boundary.
    assert ExchangeLedger.passed([3, 3], [True, True])
    # No counts (a round without them, or joiners only), or no busy list.
    assert not ExchangeLedger.passed([], [])
    assert not ExchangeLedger.passed([-1, -1], [False, False])
    assert not ExchangeLedger.passed([3, 2], [])


def test_pending_keys_count_queries_per_op_count_and_restart_each_epoch():
    keys = PendingKeys()
    assert keys.next_key(3, 5) == (3, 5, 0)
    assert keys.next_key(3, 5) == (3, 5, 1)
    assert keys.next_key(3, 6) == (3, 6, 0)
    assert keys.answer_alone((3, 6, 0)) is False
    assert keys.quiet_key == (6, 0) and keys.last_quiet
    keys.answer_alone((3, 5, 1))              # an earlier key never lowers the quiet key
    assert keys.quiet_key == (6, 0)
    keys.answered(False)
    assert not keys.last_quiet
    keys.new_epoch()
    assert keys.quiet_key == (-1, -1)
    assert keys.next_key(4, 6) == (4, 6, 0)


def test_a_quiet_grant_answers_alone_until_the_wake_which_reports_the_last_key():
    keys = PendingKeys()
    keys.new_epoch(2)
    assert not keys.answer_granted(keys.next_key(2, 5), link=0)    # no grant yet
    keys.grant(link=0)                           # a sync round's result granted it
    key = keys.next_key(2, 10)
    assert keys.answer_granted(key, link=0) and keys.last_quiet
    assert keys.answer_granted(keys.next_key(2, 20), link=0)
    assert keys.wake(2) == (20, 0)               # the awake tells the master this key
    assert not keys.answer_granted(keys.next_key(2, 30), link=0)   # asks the master now
    assert keys.wake(1) is None                  # an epoch already left: nothing owed
    keys.new_epoch(3)
    assert not keys.answer_granted(keys.next_key(3, 1), link=0)    # a new epoch: no grant


def test_a_quiet_grant_holds_only_on_its_link_and_not_after_its_epoch_was_woken():
    keys = PendingKeys()
    keys.new_epoch(2)
    keys.grant(link=0)
    assert not keys.answer_granted(keys.next_key(2, 1), link=1)    # re-registered since
    # The wake of epoch 3 comes before this member applied epoch 3's assign: it answers
    # (nothing answered alone), and a grant of epoch 3 after it does not hold.
    assert keys.wake(3) == (-1, -1)
    keys.new_epoch(3)
    keys.grant(link=0)
    assert not keys.answer_granted(keys.next_key(3, 1), link=0)


def test_the_owner_holds_the_boundaries_while_it_lives_and_not_in_its_own_calls():
    owner = BoundaryOwner()
    assert not owner.held_elsewhere()

    class Wrapper:
        pass

    w = Wrapper()
    owner.own(w)
    assert owner.held_elsewhere()
    with owner.as_owner():
        assert not owner.held_elsewhere()
    assert owner.held_elsewhere()
    del w
    gc.collect()
    assert not owner.held_elsewhere()          # held weakly


class FakeComm:
    def __init__(self):
        self.lost = None

    def abort(self, lost=None):
        self.lost = lost


def test_a_lost_member_aborts_its_epochs_communicators_even_those_watched_later():
    watch = LostMemberWatch()
    early = FakeComm()
    watch.watch(2, early)
    notice = {"epoch": 2, "peer_id": "p", "rank": 1, "reason": "timed out its heartbeats"}
    watch.member_lost(notice, current_epoch=2)
    assert "peer p (rank 1 of epoch 2) is gone" in early.lost
    late = FakeComm()
    watch.watch(2, late)                      # the connect phase started after the notice
    assert late.lost == early.lost
    old = FakeComm()
    watch.member_lost({**notice, "epoch": 1}, current_epoch=2)   # an epoch left behind
    assert old.lost is None and watch.latest(2) is late


def test_the_report_reads_the_epochs_communicator_and_survives_a_closed_one():
    rep = PeerReport()
    assert rep.build(None) == {"sync_bytes": 0}
    rep.step(7)
    rep.synced(100)
    rep.links([0.0, 5.0])

    class Comm:
        current_op = None
        last_ring_order = (1, 0)

        def stats(self):
            from torch_pccl.errors import InvalidUsageError
            raise InvalidUsageError("closed")

    out = rep.build(Comm())
    assert out == {"sync_bytes": 100, "step": 7, "links": [0.0, 5.0], "op": "idle",
                   "ring": [1, 0]}
