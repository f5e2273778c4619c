"""Fixtures shared by the algorithm tests."""

import pytest
import torch

from torch_pccl.algorithms import diloco


@pytest.fixture
def in_process(monkeypatch):
    """The DiLoCo wrappers take ``group=ThreadGroup(n).peer(rank)`` (tests/harness/replicas.py)
    as their transport; one torch thread, as each replica runs on a thread of this process."""
    monkeypatch.setattr(diloco.transport, "transport_for", lambda group, timeout, bits: group)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
