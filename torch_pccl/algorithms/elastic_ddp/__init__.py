"""Elastic DDP: torch's ``DistributedDataParallel`` on a world that changes between steps.

``ElasticDDP`` (``wrapper``) makes every join and every death a step boundary that all
peers cross alike: DDP rebuilt for the new world on every peer at once, model, buffers,
optimizer and scheduler state made bit-identical through the shared state
(``training_state``), and each optimizer step applied on every peer or on none.
See docs/elastic-ddp.md.
"""

from .training_state import TrainingState
from .wrapper import Boundary, ElasticDDP

__all__ = ["Boundary", "ElasticDDP", "TrainingState"]
