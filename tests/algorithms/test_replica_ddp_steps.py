"""``ReplicaDataParallel.step()``'s recovery branches, on a scripted transport (one process,
no inner group): the end-to-end test (tests/elastic/test_replica_ddp.py) kills a replica
between steps, where every ring fails and redoes its exchange; here the exchange fails
and is redone, is rolled forward (then the next boundary does not ask the master), or
fails past ``max_retries`` (then nothing is applied)."""

import pytest
import torch

from torch_pccl.algorithms.diloco import transport as transport_module
from torch_pccl.algorithms.elastic_ddp import ReplicaDataParallel
from torch_pccl.elastic.topology import TopologyChange
from torch_pccl.errors import PeerLostError


class ScriptedRing:
    """A ring of 2 replicas whose peer contributes ``other`` to every AVG all-reduce;
    ``fail`` says, per all-reduce in order, whether it raises ``PeerLostError``; a
    recovery round leaves this replica alone and ``rolled`` says whether it completed the
    exchange under way (then ``buf`` receives ``rolled_value``)."""

    def __init__(self, fail=(), rolled=False, rolled_value=0.0, other=0.0):
        self.fail, self.rolled, self.rolled_value = list(fail), rolled, rolled_value
        self.other = other
        self.size, self._epoch, self.queries, self.updates = 2, 1, 0, []
        self._rolled = False
        self._buf = None

    def world_size(self):
        return self.size

    def epoch(self):
        return self._epoch

    def members(self):
        return tuple((f"r{i}", f"addr{i}") for i in range(self.size))

    def report_step(self, step):
        pass

    def peers_pending(self):
        self.queries += 1
        return False

    def begin_exchange(self, buf):
        self._buf, self._rolled = buf, False

    def end_exchange(self, buf):
        pass

    def rolled_forward(self):
        return self._rolled

    def all_reduce(self, buf, async_op):
        if self.fail and self.fail.pop(0):
            raise PeerLostError("peer lost: scripted")
        if self.size == 2:
            buf.add_(self.other).div_(2)

    def update_topology(self, admit=True):
        self.updates.append(admit)
        self._epoch += 1
        self.size = 1
        if self.rolled:
            self._buf.fill_(self.rolled_value)
            self._rolled = True
        return TopologyChange(epoch=self._epoch, rank=0, world_size=1, joined=(),
                              left=("r1",))


def make(monkeypatch, ring, max_retries=3):
    monkeypatch.setattr(transport_module, "transport_for", lambda group, timeout, bits: ring)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    rdp = ReplicaDataParallel(model, opt, group=object(), max_retries=max_retries)
    model.weight.grad = torch.full_like(model.weight, 4.0)
    return rdp, model


def test_a_failed_exchange_is_redone_on_the_smaller_world_and_applied(monkeypatch):
    ring = ScriptedRing(fail=[True, False], other=2.0)
    rdp, model = make(monkeypatch, ring)
    before = model.weight.detach().clone()
    changes = rdp.step()
    assert [c.world_size for c in changes] == [1] and ring.updates == [False]
    # Redone alone: the gradient is this replica's own (AVG over a world of one).
    assert torch.equal(model.weight.detach(), before - 4.0)
    assert rdp.step_count == 1
    queries = ring.queries
    rdp.boundary()
    assert ring.queries == queries + 1          # a redone step's boundary asks as usual


def test_an_exchange_rolled_forward_is_applied_and_its_boundary_does_not_ask(monkeypatch):
    ring = ScriptedRing(fail=[True], rolled=True, rolled_value=3.0)
    rdp, model = make(monkeypatch, ring)
    before = model.weight.detach().clone()
    rdp.step()
    assert torch.equal(model.weight.detach(), before - 3.0)     # the survivors' result
    queries = ring.queries
    rdp.boundary()
    assert ring.queries == queries              # the late step's boundary: no query
    rdp.boundary()
    assert ring.queries == queries + 1          # the next one asks again


def test_an_exchange_that_keeps_failing_raises_and_applies_nothing(monkeypatch):
    ring = ScriptedRing(fail=[True, True, True])
    rdp, model = make(monkeypatch, ring, max_retries=2)
    before = model.weight.detach().clone()
    with pytest.raises(PeerLostError):
        rdp.step()
    assert ring.updates == [False, False]
    assert torch.equal(model.weight.detach(), before) and rdp.step_count == 0


def test_the_exchange_averages_over_the_ring(monkeypatch):
    ring = ScriptedRing(other=torch.tensor([2.0, 0.0, 6.0], dtype=torch.float64))
    rdp, model = make(monkeypatch, ring)
    before = model.weight.detach().clone()
    assert rdp.step() == []
    expected = (torch.full((3,), 4.0, dtype=torch.float64) + ring.other) / 2
    assert torch.equal(model.weight.detach(), before - expected.view(1, 3))
