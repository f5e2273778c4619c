"""Elastic membership through a master and shared state with bit parity.

Submodules: ``master_client`` (``MasterClient``: one peer's connection to the
master), ``membership`` (a group's link to its master), ``rendezvous``
(``pccl://`` and the automatic master of a fixed world), ``topology``
(``update_topology``, ``peers_pending``, ``all_reduce_with_retry``) and
``shared_state`` (``sync_shared_state``). See docs/membership.md and
docs/shared-state.md; the public names are re-exported by ``torch_pccl``.
"""
