"""Elastic membership through a master and shared state with bit parity.

Submodules: ``master_client`` (``MasterClient``: one peer's connection to the
master; ``master_session`` the connection across links, ``master_link`` the socket,
``reconnect`` outliving the master, ``mailbox`` requests matched to answers,
``heartbeat`` the heartbeat thread),
``membership`` (``Membership``: the owner of a group's epoch and of the transition
to the next one), ``rendezvous`` (``pccl://`` and the automatic master of a fixed
world; it registers the group factory with c10d, which never imports this layer),
``topology`` (``update_topology``, ``peers_pending``, ``all_reduce_with_retry``,
``optimize_topology``: ``ring``'s, plus the report of the measured row) and
``shared_state`` (``sync_shared_state``). See docs/membership.md and
docs/shared-state.md; the public names are re-exported by ``torch_pccl``.
"""
