"""The rows of benchmarks/wan_training.py: what each one trains with, in one table.

A row is a backend and a training algorithm with its options, on a layout of hosts. The driver
reads ``backend``, ``hosts``, ``shards``, ``churn`` and ``overlapped``; the peer
(``_wan_peer.py``) builds the row's training wrapper from ``algo``, ``quantization``,
``compression``, ``options`` and ``shards``. Adding a row is one ``Row(...)`` line in ``ROWS``
(and, for a wrapper option the peer does not know yet, one branch in ``_wan_peer.make_wrapper``).

Standard library only: the driver imports this without torch.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Row:
    """One configuration of the benchmark.

    Attributes:
        name: the ``--rows`` name and the key in results.json.
        label: what the table and the plot call it.
        backend: ``"gloo"`` (torch's own; formed through a TCP store) or ``"pccl"`` (formed
            through a torch_pccl master, so peers may leave and join).
        algo: ``"ddp"`` (torch DDP: gradients averaged every step), ``"diloco"``,
            ``"streaming"`` or ``"async"`` (torch_pccl.algorithms.diloco's wrappers).
        quantization: ``None``, ``"int8"`` or ``"int4"``: how pseudo-gradients travel.
        compression: ``None`` or ``"topk"``: the sparse exchange with error feedback
            (``torch_pccl.TopK()``, SparseLoCo's settings), all-gathered.
        churn: one peer SIGKILLs itself at a third of the budget and a new one joins at half
            (``_wan_curve.churn_schedule``).
        overlapped: the exchange runs while inner steps compute, so the time it spends on the
            link is not time the trainer waits: link utilisation is not observed for it.
        options: extra keyword arguments of the wrapper, as (name, value) pairs.
        slow: the peer of the last host runs its inner steps ``--slow-peer`` times slower
            (a busier machine or a smaller GPU: it computes each step, then idles for
            ``slow - 1`` times that compute).
        quorum: ``(min_peers, grace_s)``: the wrapper's ``torch_pccl.Quorum``; the peers
            then train until the group's outer step reaches the budget's rounds, not for a
            count of their own inner steps.
        hosts: emulated hosts (network namespaces), one DiLoCo peer or replica on each.
        shards: processes per host. Above 1 each host runs a *sharded replica*
            (docs/sharded-replicas.md): its processes form an inner gloo group over the host's
            own loopback, shard the model with FSDP2 over it and each take ``1 / shards`` of a
            peer's batch (a replica trains on one unsharded peer's tokens per inner step);
            across hosts they exchange over the shard rings of
            ``torch_pccl.init_replica_group``, the only traffic that crosses the emulated link.
    """

    name: str
    label: str
    backend: str
    algo: str
    quantization: str | None = None
    compression: str | None = None
    churn: bool = False
    overlapped: bool = False
    options: tuple[tuple[str, object], ...] = ()
    slow: bool = False
    quorum: tuple[int, float] | None = None
    hosts: int = 4
    shards: int = 1

    def __post_init__(self):
        if self.shards > 1 and (self.churn or self.slow or self.backend != "pccl"):
            raise ValueError(f"row {self.name}: a sharded row has no churn, no slow peer, and "
                             "its replicas join through a pccl master")


ROWS: dict[str, Row] = {r.name: r for r in (
    Row("ddp-gloo", "DDP over gloo", "gloo", "ddp"),
    Row("ddp-pccl", "DDP over pccl", "pccl", "ddp"),
    Row("diloco", "DiLoCo", "pccl", "diloco"),
    Row("diloco-int8", "DiLoCo, int8 exchange", "pccl", "diloco", quantization="int8"),
    Row("diloco-int4", "DiLoCo, int4 exchange", "pccl", "diloco", quantization="int4"),
    Row("diloco-sparse", "DiLoCo, sparse top-k exchange", "pccl", "diloco",
        compression="topk"),
    # tau sized from the measured exchange time (the wrapper's default, issue 40), beside the
    # fixed tau = 5 of the previous version (arXiv 2501.18512 overlaps up to 5 inner steps: on
    # the default link one fragment's exchange took ~0.8 s, 6 inner steps; tau = 1 left it
    # waiting 55 % of the time).
    Row("streaming", "Streaming DiLoCo, tau measured", "pccl", "streaming", overlapped=True,
        options=(("tau", None),)),
    Row("streaming-tau5", "Streaming DiLoCo, tau 5", "pccl", "streaming", overlapped=True,
        options=(("tau", 5),)),
    Row("async", "async DiLoCo (eager)", "pccl", "async", overlapped=True),
    Row("diloco-churn", "DiLoCo, a peer killed at 1/3, one joins at 1/2", "pccl", "diloco",
        churn=True),
    # One peer of 4 at a third of the others' speed (--slow-peer): plain DiLoCo waits for
    # it at every exchange; the quorum closes each round on the other 3 (grace 0.5 s: a
    # few of their inner steps) and merges the slow peer's work when it comes.
    Row("diloco-slow", "DiLoCo, one peer slower (everyone waits)", "pccl", "diloco",
        slow=True),
    Row("diloco-quorum", "DiLoCo + quorum 3 of 4, one peer slower", "pccl", "diloco",
        slow=True, quorum=(3, 0.5)),
    Row("diloco-quorum-even", "DiLoCo + quorum 3 of 4, no slow peer", "pccl", "diloco",
        quorum=(3, 0.5)),
    # Issue 40: the same slow peer with the overlapping variants, waiting for everyone or with
    # the quorum (Streaming: a round per fragment send; async: a round per outer step).
    Row("streaming-slow", "Streaming DiLoCo, one peer slower (everyone waits)", "pccl",
        "streaming", overlapped=True, options=(("tau", None),), slow=True),
    Row("streaming-quorum", "Streaming DiLoCo + quorum 3 of 4, one peer slower", "pccl",
        "streaming", overlapped=True, options=(("tau", None),), slow=True, quorum=(3, 0.5)),
    Row("async-slow", "async DiLoCo, one peer slower (everyone waits)", "pccl", "async",
        overlapped=True, slow=True),
    Row("async-quorum", "async DiLoCo + quorum 3 of 4, one peer slower", "pccl", "async",
        overlapped=True, slow=True, quorum=(3, 0.5)),
    # Issue 39: 2 replicas of 2 FSDP2 shards beside 2 unsharded peers, at equal tokens.
    Row("diloco-2", "DiLoCo, 2 peers", "pccl", "diloco", hosts=2),
    Row("diloco-sharded", "DiLoCo, 2 replicas x 2 FSDP2 shards", "pccl", "diloco", hosts=2,
        shards=2),
)}
