"""What the master and its peers both speak on the control plane, no I/O and no torch.

``address`` (``host:port`` text both ways), ``protocol`` (framing, the ``Decoder`` and
every message's schema) and ``auth`` (the shared-secret challenge-response). The master's
server (``torch_pccl.master``) and the peer's client (``torch_pccl.elastic``) both import
these modules and neither imports the other for them; this package imports no other
layer of torch_pccl but ``errors`` (for ``ProtocolError``), and the standard library
only. ``torch_pccl.master.protocol``, ``torch_pccl.master.auth`` and
``torch_pccl.core.address`` re-export their names. Nothing is imported here.
"""
