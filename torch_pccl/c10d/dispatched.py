"""The c10d op each ``ProcessGroupPCCL`` method is, with that op's arguments.

A C++ group's methods call the dispatcher op ``c10d::<name>`` (ProcessGroup.hpp),
so a TorchDispatchMode active around a collective (``CommDebugMode`` counts them)
sees it; ``torch_internals.call_as_c10d_op`` shows a pccl op to the active modes
the same way. Each function below builds, from the method's own arguments, the
arguments that ProcessGroup.hpp passes the op named by its ``op`` attribute; it is
called only while a mode is active, after the method has checked its arguments.
"""

from __future__ import annotations

from datetime import timedelta

import torch

from .torch_internals import boxed_reduce_op, c10d_op

_MS = timedelta(milliseconds=1)


def _builds(name: str):
    """Marks a function as the argument builder of the c10d op ``name`` (its ``op``)."""
    def mark(fn):
        fn.op = c10d_op(name)
        return fn
    return mark


def _ms(opts) -> int:
    """``opts.timeout`` in milliseconds (-1: unset), as ProcessGroup.hpp passes it."""
    return int(opts.timeout / _MS)


@_builds("allreduce_")
def allreduce_(group, tensors, opts):
    return (tensors, group.boxed(), boxed_reduce_op(opts.reduceOp), None, opts.asyncOp,
            _ms(opts))


@_builds("allreduce_coalesced_")
def allreduce_coalesced_(group, tensors, opts):
    return tensors, group.boxed(), boxed_reduce_op(opts.reduceOp), opts.asyncOp, _ms(opts)


@_builds("reduce_")
def reduce_(group, tensors, opts):
    return (tensors, group.boxed(), boxed_reduce_op(opts.reduceOp), opts.rootRank,
            opts.rootTensor, opts.asyncOp, _ms(opts))


@_builds("broadcast_")
def broadcast_(group, tensors, opts):
    return tensors, group.boxed(), opts.rootRank, opts.rootTensor, opts.asyncOp, _ms(opts)


@_builds("allgather_")
def allgather_(group, output_tensors, input_tensors, opts):
    return output_tensors, input_tensors, group.boxed(), opts.asyncOp, _ms(opts)


@_builds("allgather_coalesced_")
def allgather_coalesced_(group, output_lists, input_list, opts):
    return output_lists, input_list, group.boxed(), opts.asyncOp


@_builds("_allgather_base_")
def allgather_base_(group, output, input, opts):
    return output, input, group.boxed(), opts.asyncOp, _ms(opts)


@_builds("allgather_into_tensor_coalesced_")
def allgather_into_tensor_coalesced_(group, outputs, inputs, opts):
    return outputs, inputs, group.boxed(), opts.asyncOp


@_builds("gather_")
def gather_(group, output_tensors, input_tensors, opts):
    return output_tensors, input_tensors, group.boxed(), opts.rootRank, opts.asyncOp, _ms(opts)


@_builds("scatter_")
def scatter_(group, output_tensors, input_tensors, opts):
    return output_tensors, input_tensors, group.boxed(), opts.rootRank, opts.asyncOp, _ms(opts)


@_builds("reduce_scatter_")
def reduce_scatter_(group, output_tensors, input_tensors, opts):
    return (output_tensors, input_tensors, group.boxed(), boxed_reduce_op(opts.reduceOp),
            opts.asyncOp, _ms(opts))


@_builds("_reduce_scatter_base_")
def reduce_scatter_base_(group, output, input, opts):
    return (output, input, group.boxed(), boxed_reduce_op(opts.reduceOp), opts.asyncOp,
            _ms(opts))


@_builds("reduce_scatter_tensor_coalesced_")
def reduce_scatter_tensor_coalesced_(group, outputs, inputs, opts):
    return (outputs, inputs, group.boxed(), boxed_reduce_op(opts.reduceOp), opts.asyncOp,
            _ms(opts))


@_builds("alltoall_base_")
def alltoall_base_(group, output, input, output_split_sizes, input_split_sizes, opts):
    return (output, input, group.boxed(), list(output_split_sizes), list(input_split_sizes),
            opts.asyncOp, _ms(opts))


@_builds("alltoall_")
def alltoall_(group, output_tensors, input_tensors, opts):
    return output_tensors, input_tensors, group.boxed(), opts.asyncOp, _ms(opts)


@_builds("barrier")
def barrier(group, opts):
    # ProcessGroup::barrier allocates this one-byte tensor to pick the op's kernel;
    # it does so under the modes too.
    tensor = torch.empty(1, dtype=torch.uint8)
    return tensor, group.boxed(), list(opts.device_ids), opts.asyncOp, _ms(opts)


@_builds("send")
def send(group, tensors, dst, tag):
    return tensors, group.boxed(), dst, tag


@_builds("recv_")
def recv_(group, tensors, src, tag):
    return tensors, group.boxed(), src, tag


@_builds("recv_any_source_")
def recv_any_source_(group, tensors, tag):
    return tensors, group.boxed(), tag
