"""What the master and its peers both speak on the control plane, no I/O and no torch.

``address`` (``host:port`` text both ways), ``protocol`` (framing and the ``Decoder``),
``schemas`` (every message's fields and their checks), ``auth`` (the shared-secret
challenge-response) and ``seal`` (the AES-256-GCM records after it). The master's server
(``torch_pccl.master``) and the peer's client (``torch_pccl.elastic``) both import these
modules and neither imports the other for them; this package imports no other layer of
torch_pccl but ``errors`` (``ProtocolError``, ``IntegrityError``), and the standard library
and pyca/cryptography only. ``torch_pccl.core.address`` re-exports ``address``'s names.
Nothing is imported here.
"""
