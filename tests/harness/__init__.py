"""What the tests run on; tests/conftest.py puts tests/ on sys.path, so ``from harness import ...``.

Two families of worker processes, plus multi-host namespaces:

- ``pool`` (the test side) and ``workers`` (the spawned side): a persistent pool of
  processes that form one process group, driven over Pipes; ``data`` builds every
  input from (seed, rank) and checks results against a reference.
- ``worker_process`` (the test side) and the ``*_worker.py`` scripts (the other side):
  peers run as ``python HARNESS/NAME_worker.py ...`` and driven by JSON lines over
  stdin/stdout; ``elastic_worker`` holds the loop the elastic ones share.
- ``threads``: ranks as threads of the test process (Communicator-level tests).
- ``netns``: network namespaces as hosts, for the multi-host tests (root only).
- ``wanem`` (+ ``wanem_worker``, ``wan_allreduce_worker``): hosts joined by an emulated WAN,
  a userspace TUN forwarder in C (``wanem_forwarder.c`` with the link model in
  ``wanem_link.c``, compiled by ``wanem`` on first use) with per-pair delay, rate, queue and
  loss (root, /dev/net/tun and a C compiler only); benchmarks/wan.py uses it too.
"""

import os

HARNESS = os.path.dirname(os.path.abspath(__file__))  # this folder: where the worker scripts lie
REPO = os.path.dirname(os.path.dirname(HARNESS))      # the checkout, first on workers' PYTHONPATH
