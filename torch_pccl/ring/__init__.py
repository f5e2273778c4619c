"""The ring's order: measure every link, pick the ring with the largest bottleneck, apply it.

A layer of its own above ``c10d`` and ``core`` and below ``elastic`` (it never imports
the membership layer). Submodules: ``measure`` (``measure_links``: every pair timed in a
round-robin tournament of probes, all-gathered), ``order`` (``best_ring``,
``ring_bottleneck``: the bottleneck travelling salesman problem, pure) and ``optimize``
(``optimize_ring_order``, ``RingChoice``: measure, choose, apply on a group's lanes).
The public ``torch_pccl.optimize_topology`` (``elastic.topology``) calls
``optimize_ring_order`` and shows the measured row on the master's status page.
See docs/architecture.md, "Ring order".
"""
