"""The c10d glue: backend registration, ``ProcessGroupPCCL`` and its ``PcclWork``.

Submodules: ``backend`` (registration, the group creator), ``process_group``
(every c10d collective over a ``Communicator``), ``work`` (Future-backed Work,
the per-lane executor), ``torch_internals`` (the one place that touches
torch.distributed's private state). Nothing is imported here: ``backend`` runs
while torch imports and must not load the native extension.
"""
