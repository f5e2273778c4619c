"""The native data plane from Python: ``Communicator``, ``Listener``, tensor checks, addresses.

Submodules: ``native`` (the compiled extension and its limits), ``tensors``
(argument checks and native codes), ``address`` (``host:port`` and the
advertised address), ``listener``, ``communicator``. Nothing is imported here,
so ``core.address`` loads without the native extension.
"""
