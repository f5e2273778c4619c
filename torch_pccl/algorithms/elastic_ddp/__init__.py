"""Elastic DDP: torch's ``DistributedDataParallel`` on a world that changes between steps.

``ElasticDDP`` (``wrapper``) makes every join and every death a step boundary that all
peers cross alike: DDP rebuilt for the new world on every peer at once, model, buffers,
optimizer and scheduler state made bit-identical through the shared state
(``training_state``), and each optimizer step applied on every peer or on none.
See docs/elastic-ddp.md. ``ReplicaDataParallel`` (``replicas``) follows the same rules for
sharded replicas (FSDP2 inside a replica, the local gradient shards averaged over each
shard ring every step: HSDP's shape; docs/sharded-replicas.md).
"""

from .replicas import ReplicaBoundary, ReplicaDataParallel
from .training_state import TrainingState
from .wrapper import Boundary, ElasticDDP

__all__ = ["Boundary", "ElasticDDP", "ReplicaBoundary", "ReplicaDataParallel", "TrainingState"]
