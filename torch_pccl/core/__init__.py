"""The native data plane from Python: ``Communicator``, ``Listener``, tensor checks, addresses.

Submodules: ``native`` (the compiled extension and its limits), ``results``
(native result codes as exceptions), ``tensors`` (argument checks and native
codes), ``address`` (``host:port`` and the advertised address), ``listener``,
``handle`` (one native ``pcclComm_t`` and its locks), ``lanes`` (``LaneSet``, the
K lanes of a group), ``striping`` (how a group connects: streams, stripe, pacing,
warm-up), ``warmup``, ``collectives`` and ``point_to_point`` (the two bases of the
communicator's calls) and ``communicator``. Nothing is imported here, so ``core.address``
loads without the native extension.
"""
