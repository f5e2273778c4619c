"""The c10d glue: backend registration, ``ProcessGroupPCCL`` and its ``PcclWork``.

Submodules: ``backend`` (registration, the group creator), ``process_group``
(the c10d adapter: every c10d call, checked, then queued), ``checks`` (argument
checks at call time), ``ops`` (each op's body, a function of one lane's
``Communicator``), ``scheduler`` (the lane scheduler: sequence numbers, per-lane
executors, drain, layout guards, profiler events), ``p2p`` (the send/recv
batcher), ``staging`` (CUDA tensors through host memory), ``backend_view``
(names and per-device backends c10d reads), ``work`` (Future-backed Work, the
per-lane executor), ``sparse``, ``monitored_barrier``, ``torch_internals`` (the
one place that touches torch.distributed's private state). Nothing is imported
here: ``backend`` runs while torch imports and must not load the native extension.
"""
