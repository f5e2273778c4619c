"""Session fixtures: the backend under test and one persistent worker pool per world size.

Run against another backend (to check the harness itself) with
`python -m pytest tests --backend gloo`; tests of pccl-only behaviour skip then.
"""

import contextlib
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness.pool import WorkerPool  # noqa: E402
from harness.netns import Hosts, NetnsUnavailable, hosts  # noqa: E402
from harness.wanem import Link, Wan, WanemUnavailable, wan  # noqa: E402

WORLD_SIZES = (1, 2, 3, 4)


def pytest_addoption(parser):
    parser.addoption(
        "--backend",
        default=os.environ.get("TORCH_PCCL_TEST_BACKEND", "pccl"),
        help="c10d backend under test (default pccl; gloo checks the harness)",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "pccl_only: needs backend pccl (errors, AVG, registration)")


@pytest.fixture(scope="session")
def backend(request):
    name = request.config.getoption("--backend")
    if name == "pccl":
        # Fail loudly (not skip) when the package under test does not import.
        import torch_pccl  # noqa: F401
    return name


@pytest.fixture(autouse=True)
def _skip_pccl_only(request, backend):
    if request.node.get_closest_marker("pccl_only") and backend != "pccl":
        pytest.skip("pccl-only behaviour")


class _Pools:
    """World size -> live WorkerPool; a pool left broken by a test is replaced on next use."""

    def __init__(self, backend):
        self.backend = backend
        self.pools = {}

    def get(self, world_size):
        pool = self.pools.get(world_size)
        if pool is not None and pool.broken:
            pool.close()
            pool = None
        if pool is None:
            pool = WorkerPool(world_size, self.backend)
            self.pools[world_size] = pool
        return pool

    def close(self):
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()


@pytest.fixture(scope="session")
def pools(backend):
    p = _Pools(backend)
    yield p
    p.close()


@pytest.fixture
def fresh_group(backend):
    """Factory for a process group of its own (tests that break it); always closed after."""
    made = []

    def make(world_size, timeout_s, with_gloo=False):
        pool = WorkerPool(world_size, backend, timeout_s=timeout_s, with_gloo=with_gloo)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.broken = True  # no graceful exit: the group may be broken on purpose
        pool.close()


@pytest.fixture
def wan_hosts(tmp_path):
    """Factory ``make(k, link, **kw) -> Wan`` (as harness/wanem.py's ``wan``), torn down
    after the test; skips with the reason where the emulator cannot run."""
    with contextlib.ExitStack() as stack:
        def make(k: int, link: Link = Link(), **kw) -> Wan:
            try:
                return stack.enter_context(wan(k, link, workdir=str(tmp_path), **kw))
            except WanemUnavailable as e:
                pytest.skip(f"WAN emulator unavailable: {e}")

        yield make


@pytest.fixture
def netns_hosts(tmp_path):
    """Factory ``make(k) -> Hosts`` (harness/netns.py), torn down after the test; skips
    without namespaces."""
    with contextlib.ExitStack() as stack:
        def make(k: int) -> Hosts:
            try:
                return stack.enter_context(hosts(k, str(tmp_path)))
            except NetnsUnavailable as e:
                pytest.skip(f"network namespaces unavailable: {e}")

        yield make


@pytest.fixture
def in_process(monkeypatch):
    """The DiLoCo wrappers take ``group=ThreadGroup(n).peer(rank)`` (tests/harness/replicas.py)
    as their transport; one torch thread, as each replica runs on a thread of this process."""
    import torch

    from torch_pccl.algorithms import diloco

    monkeypatch.setattr(diloco.transport, "transport_for", lambda group, timeout, bits: group)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
