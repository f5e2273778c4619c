"""torch_pccl: a fault-tolerant torch.distributed backend over a native TCP ring.

torch registers the "pccl" backend at ``import torch`` (an entry point; so does
``import torch_pccl`` once torch is loaded), after which
``dist.init_process_group(backend="pccl")`` works like gloo. The package does
not import torch by itself: ``torch_pccl.master`` runs without it.

Elastic membership (docs/membership.md): ``init_method="pccl://host:port"``
joins through a master; ``update_topology``, ``peers_pending``, ``epoch`` and
``all_reduce_with_retry`` change and use the world between steps;
``sync_shared_state`` gives joiners and drifted peers the majority's bytes
(docs/shared-state.md). ``all_reduce_quantized`` all-reduces with int8/int4
traffic, bit-identical on every rank (docs/quantization.md);
``monitored_barrier`` is c10d's (gloo-only) barrier that names the ranks that
did not arrive. ``all_reduce_finite`` leaves out (and names) the ranks whose contribution holds
an inf or NaN (docs/diloco.md). ``DiLoCo``,
``StreamingDiLoCo`` and ``AsyncDiLoCo`` (``torch_pccl.algorithms.diloco``) train
with low communication over an elastic group (``compression=TopK()``: the sparse
exchange with error feedback); ``ElasticDDP``
(``torch_pccl.algorithms.elastic_ddp``) runs torch's DDP on it, peers joining and
leaving between steps (docs/elastic-ddp.md); ``ReplicaDataParallel`` does the same per
step for sharded replicas (docs/sharded-replicas.md). Settings (environment
variables) are in ``torch_pccl.config``; the layers are the subpackages
``core`` (native communicator), ``c10d`` (the process group), ``ring`` (the
ring's order, measured and applied), ``elastic`` (membership, shared state),
``master`` (control plane) and ``algorithms``.

``Communicator`` and ``ProcessGroupPCCL`` load the compiled extension on first
access, so importing this package (which torch does while it is itself being
imported) stays cheap and never fails for a missing build.
"""

import importlib
import sys

from .errors import (
    AbortedError,
    AuthenticationError,
    GroupReplacedError,
    IntegrityError,
    InvalidArgumentError,
    InvalidUsageError,
    MismatchError,
    NonFiniteError,
    OutOfMemoryError,
    PcclError,
    PcclSystemError,
    PcclTimeoutError,
    PeerLostError,
    ProtocolError,
    RemoteError,
    ReplicaLayoutError,
    ReplicaLostError,
    UpdateInProgressError,
)

__version__ = "0.1.0"

__all__ = [
    "AbortedError",
    "Assignment",
    "AuthenticationError",
    "AsyncDiLoCo",
    "Communicator",
    "DiLoCo",
    "ElasticDDP",
    "FiniteResult",
    "GroupReplacedError",
    "IntegrityError",
    "InvalidArgumentError",
    "InvalidUsageError",
    "Listener",
    "MasterClient",
    "MismatchError",
    "NonFiniteError",
    "OutOfMemoryError",
    "OuterStep",
    "PcclError",
    "PcclSystemError",
    "PcclTimeoutError",
    "PcclWork",
    "PeerLostError",
    "ProcessGroupPCCL",
    "RingChoice",
    "ProtocolError",
    "RemoteError",
    "ReplicaDataParallel",
    "ReplicaLayout",
    "ReplicaLayoutError",
    "ReplicaLostError",
    "UpdateInProgressError",
    "SharedState",
    "MomentumAligned",
    "Quorum",
    "StreamingDiLoCo",
    "SyncResult",
    "TopK",
    "TopologyChange",
    "all_reduce_finite",
    "all_reduce_quantized",
    "all_reduce_with_retry",
    "content_digest",
    "epoch",
    "init_replica_group",
    "monitored_barrier",
    "optimize_topology",
    "peers_pending",
    "replica_error",
    "replica_layout",
    "register",
    "state_hashes",
    "sync_shared_state",
    "update_topology",
]

# Public name -> the module that defines it (loaded on first access).
_LAZY = {
    "Communicator": "core.communicator",
    "Listener": "core.listener",
    "ProcessGroupPCCL": "c10d.process_group",
    "monitored_barrier": "c10d.process_group",
    "PcclWork": "c10d.work",
    "Assignment": "elastic.master_client",
    "MasterClient": "elastic.master_client",
    "TopologyChange": "elastic.topology",
    "all_reduce_with_retry": "elastic.topology",
    "epoch": "elastic.topology",
    "peers_pending": "elastic.topology",
    "update_topology": "elastic.topology",
    "RingChoice": "ring.optimize",
    "optimize_topology": "elastic.topology",
    "init_replica_group": "elastic.replica_group",
    "replica_error": "elastic.replica_group",
    "ReplicaLayout": "elastic.replica_layout",
    "replica_layout": "elastic.replica_layout",
    "SharedState": "elastic.shared_state",
    "SyncResult": "elastic.shared_state",
    "state_hashes": "elastic.shared_state",
    "content_digest": "elastic.shared_state",
    "sync_shared_state": "elastic.shared_state",
    "all_reduce_quantized": "algorithms.quantized",
    "all_reduce_finite": "algorithms.finite",
    "FiniteResult": "algorithms.finite",
    "DiLoCo": "algorithms.diloco",
    "StreamingDiLoCo": "algorithms.diloco",
    "AsyncDiLoCo": "algorithms.diloco",
    "OuterStep": "algorithms.diloco",
    "Quorum": "algorithms.diloco",
    "MomentumAligned": "algorithms.diloco",
    "TopK": "algorithms.topk",
    "ElasticDDP": "algorithms.elastic_ddp",
    "ReplicaDataParallel": "algorithms.elastic_ddp",
}


def __getattr__(name):
    # PEP 562: the native extension loads on first use, not at import time.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'torch_pccl' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def register() -> None:
    """Registers the "pccl" c10d backend and the ``pccl://`` rendezvous (imports torch).

    Runs by itself: at ``import torch`` (the ``torch.backends`` entry point), and at
    ``import torch_pccl`` when torch is imported already. Call it after ``import torch``
    only where ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns the entry point off and this
    package was imported first. Later calls do nothing.
    """
    from ._autoload import register as register_backend  # the wiring of the layers

    register_backend()


# Registering needs torch.distributed. Without torch loaded, the entry point registers the
# backend when torch is imported, and a process that never imports torch (pccl-master on a
# small machine: `import torch_pccl.master`) never loads it.
if sys.modules.get("torch") is not None:
    register()
