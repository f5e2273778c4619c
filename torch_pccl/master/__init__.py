"""The torch_pccl master: control plane for elastic membership (no tensor data).

Peers connect over TCP, say hello and wait as *pending*; the accepted members
admit them, and drop the dead, in *update rounds* that bump the membership
epoch and hand every member its rank, the world size and the data-plane
addresses. Every wait has a deadline and silent peers are dropped. See
docs/membership.md.

Run it standalone (``pccl-master --host 0.0.0.0 --port 29600`` or
``python -m torch_pccl.master``) or embedded::

    from torch_pccl.master import start_in_thread
    master = start_in_thread("0.0.0.0", 29600, world_size=4)
    ...
    master.stop()

This package never imports torch or loads the native extension. It imports
``config``, ``errors`` and ``control`` (the protocol and the challenge-response it
shares with the peers' client in ``elastic``, which never imports this package for
them); its state machine and server use the standard library only; the status page
(``http.py``) needs aiohttp and prometheus_client, imported only by a master
that serves it (``--http-port``).
"""

from ..control.protocol import MAGIC, MAX_MESSAGE_BYTES, VERSION, Decoder, ProtocolError, encode
from .actions import Actions
from .server import MasterServer, start_in_thread
from .state import MembershipState
from .thread import MasterThread

__all__ = [
    "MAGIC",
    "MAX_MESSAGE_BYTES",
    "VERSION",
    "Actions",
    "Decoder",
    "MasterServer",
    "MasterThread",
    "MembershipState",
    "ProtocolError",
    "encode",
    "start_in_thread",
]
