"""DiLoCo, Streaming DiLoCo and an async (one-round-delayed) DiLoCo over a pccl group.

Low-communication data parallelism (``../shared/reference/algorithms.md``): every
peer trains its own copy of the model with its own *inner* optimizer for
``sync_every`` (H) steps; then the peers average their *pseudo-gradients*
``outer - local`` and an *outer* optimizer (Nesterov SGD, lr 0.7, momentum 0.9
by default) moves the shared *outer* parameters.

- ``DiLoCo``: Douillard et al., "DiLoCo: Distributed Low-Communication Training
  of Language Models", arXiv 2311.08105.
- ``StreamingDiLoCo``: Douillard et al., "Streaming DiLoCo with overlapping
  communication", arXiv 2501.18512: P fragments on staggered schedules, each
  exchange overlapped with ``tau`` inner steps, merged with ``alpha``.
- ``AsyncDiLoCo``: the exchange of round n runs during round n + 1 and is
  applied at its end, with *eager updates* (Kale, Douillard, Donchev, "Eager
  updates for overlapped communication and computation in DiLoCo", arXiv
  2502.12996) so that it does not diverge where the stale Nesterov update does.

Membership (docs/membership.md, docs/shared-state.md) is handled at the outer
boundaries: pending peers are admitted (``update_topology``), the *shared
state* (outer parameters, outer-optimizer buffers, the step) is synchronised
with ``sync_shared_state`` so that every peer holds the same bytes, and an
exchange that fails because a peer died is retried on the smaller world. A
peer whose pseudo-gradients hold an inf or NaN is left out of the average and
named (``reject_nonfinite``, default on; ``torch_pccl.algorithms.finite``). The
inner optimizer's state is never synchronised. The outer state lives on the
CPU, in float32 (float64 when the model has float64 parameters), whatever the
model's device and dtype.

Limits: a peer lost between collectives (while computing, where DiLoCo spends
its time) fails the next exchange on every survivor alike, and they retry
together. A peer lost *inside* a blocking exchange (DiLoCo, Streaming with
``tau=0``) that some survivors had already completed is made all or nothing by
the recovery round: those survivors broadcast the average to the others
(docs/membership.md). Exchanges left in flight across steps (Streaming with
``tau>0``, async DiLoCo) are redone, and survivors that had completed one can
disagree until the next shared-state sync repairs them. Every peer must build
the same model (names, shapes) and pass the same arguments, or the
constructor's sync raises ``MismatchError``.

Usage::

    model = Net(); inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    diloco = torch_pccl.DiLoCo(model, inner, sync_every=100)  # a collective
    for batch in data:
        loss_fn(model(batch)).backward(); inner.step(); inner.zero_grad()
        diloco.step()                     # every 100th call: the outer step
    diloco.finish()                       # the model now holds the outer parameters

Modules, each read in one sitting: ``diloco``, ``streaming``, ``asynchronous``
(the three wrappers); ``base`` (``OuterLoop``: what they share: the
constructor's sync, exchanges with retries, the membership boundary, the
shared state, ``finish``); ``fragment`` (``Fragment``: parameters, outer
copies, outer optimizer, exchange buffer, schedule offset; ``Exchange``: one in
flight); ``report`` (``OuterStep``); ``schedule`` (the pure functions);
``transport`` (the group operations, ``PcclTransport``); ``compressed``
(``SparseExchange``: the error feedback and payload all-gather of
``compression=TopK(...)``, whose codec is ``torch_pccl.algorithms.topk``);
``quorum`` (``Quorum``: outer steps that close on a quorum of ready peers, with
token-weighted merging; the master's side is ``torch_pccl.master.quorum``);
``correction`` (``MomentumAligned``: async DiLoCo's staleness correction, after HeLoCo);
``shards`` (sharded replicas: a DTensor parameter is worked on through its local
shard, and ``replica_layout`` tells differently built replicas apart).
"""

from .asynchronous import AsyncDiLoCo
from .correction import MomentumAligned
from .diloco import DiLoCo
from .fragment import default_outer_optimizer, sparseloco_outer_optimizer
from .quorum import Quorum
from .report import OuterStep
from .schedule import fragment_offsets, fragments_due, pseudo_gradient, strided_fragments
from .shards import ReplicaLayout, replica_layout
from .streaming import StreamingDiLoCo
from .transport import QUANTIZATION_BITS  # noqa: F401 - importable here, as before

__all__ = [
    "AsyncDiLoCo",
    "DiLoCo",
    "MomentumAligned",
    "OuterStep",
    "Quorum",
    "ReplicaLayout",
    "StreamingDiLoCo",
    "default_outer_optimizer",
    "fragment_offsets",
    "fragments_due",
    "pseudo_gradient",
    "replica_layout",
    "sparseloco_outer_optimizer",
    "strided_fragments",
]
