"""torch_pccl: a fault-tolerant torch.distributed backend over a native TCP ring.

``import torch_pccl`` registers the "pccl" backend (torch also does it at
``import torch`` through an entry point), after which
``dist.init_process_group(backend="pccl")`` works like gloo.

Elastic membership (docs/membership.md): ``init_method="pccl://host:port"``
joins through a master; ``update_topology``, ``peers_pending``, ``epoch`` and
``all_reduce_with_retry`` change and use the world between steps;
``sync_shared_state`` gives joiners and drifted peers the majority's bytes
(docs/shared-state.md). ``all_reduce_quantized`` all-reduces with int8/int4
traffic, bit-identical on every rank (docs/quantization.md). ``DiLoCo``,
``StreamingDiLoCo`` and ``AsyncDiLoCo`` (``torch_pccl.diloco``) train with low
communication over an elastic group.

``Communicator`` and ``ProcessGroupPCCL`` load the compiled extension on first
access, so importing this package (which torch does while it is itself being
imported) stays cheap and never fails for a missing build.
"""

from .backend import register
from .errors import (
    AbortedError,
    InvalidArgumentError,
    InvalidUsageError,
    MismatchError,
    OutOfMemoryError,
    PcclError,
    PcclSystemError,
    PcclTimeoutError,
    PeerLostError,
    ProtocolError,
    RemoteError,
)

__version__ = "0.1.0"

__all__ = [
    "AbortedError",
    "Assignment",
    "AsyncDiLoCo",
    "Communicator",
    "DiLoCo",
    "InvalidArgumentError",
    "InvalidUsageError",
    "Listener",
    "MasterClient",
    "MismatchError",
    "OutOfMemoryError",
    "OuterStep",
    "PcclError",
    "PcclSystemError",
    "PcclTimeoutError",
    "PcclWork",
    "PeerLostError",
    "ProcessGroupPCCL",
    "ProtocolError",
    "RemoteError",
    "SharedState",
    "StreamingDiLoCo",
    "SyncResult",
    "TopologyChange",
    "all_reduce_quantized",
    "all_reduce_with_retry",
    "content_digest",
    "epoch",
    "peers_pending",
    "register",
    "state_hashes",
    "sync_shared_state",
    "update_topology",
]

_LAZY = {
    "Communicator": "communicator",
    "ProcessGroupPCCL": "process_group",
    "PcclWork": "work",
    "Listener": "communicator",
    "Assignment": "membership",
    "MasterClient": "membership",
    "TopologyChange": "elastic",
    "all_reduce_quantized": "quantized",
    "all_reduce_with_retry": "elastic",
    "epoch": "elastic",
    "peers_pending": "elastic",
    "update_topology": "elastic",
    "SharedState": "shared_state",
    "SyncResult": "shared_state",
    "state_hashes": "shared_state",
    "content_digest": "shared_state",
    "sync_shared_state": "shared_state",
    "DiLoCo": "diloco",
    "StreamingDiLoCo": "diloco",
    "AsyncDiLoCo": "diloco",
    "OuterStep": "diloco",
}


def __getattr__(name):
    # PEP 562: the native extension loads on first use, not at import time.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'torch_pccl' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


register()
