"""ProcessGroupPCCL: the c10d adapter between torch.distributed and a Communicator.

c10d (Python ``dist.*`` functions, DDP's reducer, FSDP2 and functional
collectives through C++) calls the methods below; each returns a ``PcclWork``.
The traps of subclassing ``dist.ProcessGroup`` from Python are documented in
torch-c10d.md: ``super().__init__(rank, size)``, override ``getRank/getSize``
(not ``rank/size``), the group name/desc accessors, and a Work whose
``wait()`` re-raises.

Each method checks its arguments (``c10d.checks``) on the caller's thread, before
the op takes a lane, so an op refused on one rank does not shift the lanes of the
next ones; then it queues the op's body (``c10d.ops``, a function of the lane's
Communicator) on the lane scheduler (``c10d.scheduler``), or holds a send/recv
back for the p2p batcher (``c10d.p2p``). Network errors arrive through the Work.
CUDA tensors are staged through host memory (``c10d.staging``). While a
TorchDispatchMode is active (``CommDebugMode``), an op is shown to it as the c10d
op a C++ group calls (``c10d.dispatched``), after its checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
# The options classes (AllgatherOptions is not re-exported by torch.distributed).
from torch.distributed import distributed_c10d as c10d

from .. import config
from ..core.communicator import Communicator
from ..core.tensors import checked_tag, quantized_args
from ..errors import InvalidArgumentError, InvalidUsageError
from . import dispatched
from . import monitored_barrier as monitored
from . import ops
from .backend_view import BackendView
from .checks import (
    check_all_to_all_lists,
    check_gather_list,
    check_pairs,
    check_root,
    check_scaled,
    check_tensor,
    op_timeout,
    per_input_lists,
    reduce_code,
    root_list,
    row_splits,
    single,
)
from .lifecycle import GroupLanes
from .pending_connect import PendingConnect
from .scheduler import Op
from .sparse import check_sparse
from .torch_internals import call_as_c10d_op, cpu_backend, default_group, dispatch_mode_count
from .work import PcclWork


class ProcessGroupPCCL(BackendView, GroupLanes, dist.ProcessGroup):
    """A ``dist.ProcessGroup`` whose collectives run on a PCCL ``Communicator``.

    The n-th collective issued (from 0, and from 0 again after ``reconfigure``)
    runs on lane ``n % K`` of the communicator's K lanes (``PCCL_LANES``; see
    ``c10d.scheduler``), so up to K async collectives are in flight at once and
    may finish in any order (as with gloo's worker threads, a tensor an
    unfinished op uses must not be used by another op); point-to-point ops run
    on lane 0. A synchronous op (``async_op=False``) whose lane has nothing
    queued runs inline on the caller's thread. Each op's deadline is
    ``opts.timeout`` when set, else the group's ``timeout_s``. Each call takes
    one tensor per list (one device per process); more raises
    ``InvalidArgumentError`` (a ValueError).

    Errors are ``PcclError`` subclasses; network errors are sticky per lane
    until the group is rebuilt, while the other lanes stay usable unless the
    cause (a lost peer) reaches them too. A group formed through a master
    (``init_method="pccl://host:port"``) is built for its first epoch by
    ``create`` and moved to each next one in place by ``configure`` (the elastic
    layer drives both, as torchft's Manager drives its ``ProcessGroup``);
    ``getRank``/``getSize`` then report the new world.

    The lanes, epochs, drain, ring order, abort and shutdown are the
    ``GroupLanes`` base's (c10d/lifecycle.py), with the public seams the layers
    above use (as torchft's ``ProcessGroup`` has them).
    """

    def __init__(self, comm: Communicator, timeout_s: float | None = None,
                 pending: PendingConnect | None = None, lanes: int | None = None):
        """Wraps a connected ``comm``; the group takes ownership (``shutdown`` closes it).

        Args:
            comm: a connected Communicator (see ``Communicator.bootstrap``), or one that
                ``pending`` connects in the background (``Communicator.publish``).
            timeout_s: default per-op deadline in seconds (default: ``comm.timeout_s``).
            pending: the connect of ``comm`` still running (c10d/pending_connect.py): every
                op waits for it first, and raises its error if it failed.
            lanes: the lanes ``pending`` connects (with ``pending``).
        """
        super().__init__(comm.rank, comm.world_size)
        self._start_lanes(comm, timeout_s, pending, lanes)

    def getRank(self) -> int:
        """This rank in the group's current communicator (c10d reads it through C++)."""
        return self.communicator.rank

    def getSize(self) -> int:
        """The current communicator's world size (c10d reads it through C++)."""
        return self.communicator.world_size

    # -- all-reduce family -------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts=None) -> PcclWork:
        """In-place all-reduce of ``tensors[0]``; mirrors ``dist.all_reduce``.

        ``opts.reduceOp``: SUM, AVG, MIN, MAX, PRODUCT (others raise InvalidArgumentError).
        A sparse COO tensor is summed as gloo does it (``c10d.sparse``).
        """
        opts = c10d.AllreduceOptions() if opts is None else opts
        tensor = single(tensors, "tensors")
        timeout_s = op_timeout(opts, self._timeout_s)
        if tensor.layout == torch.sparse_coo:
            check_sparse(tensor, opts.reduceOp.op)
            return self._submit(lambda comm: ops.all_reduce_sparse_into(comm, tensor, timeout_s),
                                [tensor], opts, event=("all_reduce_sparse", []),
                                shown=(dispatched.allreduce_, tensors, opts))
        dtype = check_tensor(tensor, "tensor")
        red = reduce_code(opts)
        return self._submit(lambda comm: ops.all_reduce(comm, tensor, dtype, red, timeout_s),
                            [tensor], opts, event=("all_reduce", [tensor]),
                            shown=(dispatched.allreduce_, tensors, opts))

    def allreduce_quantized(self, tensor: torch.Tensor, bits: int = 8, block: int = config.QUANT_BLOCK,
                            op=dist.ReduceOp.SUM, async_op: bool = True,
                            timeout: timedelta | None = None) -> PcclWork:
        """In-place all-reduce of ``tensor`` with int8/int4 traffic; queued like ``allreduce``.

        ``Communicator.all_reduce_quantized`` on the group's communicator:
        ``tensor`` (float32, float16 or bfloat16; CUDA tensors are staged
        through the CPU) ends bit-identical on every rank, within the error
        bound documented there, and is left unchanged if the op fails.

        Args:
            tensor: the tensor to reduce in place.
            bits: 8 or 4. block: elements per float32 scale (1 .. 65535).
            op: ``dist.ReduceOp`` SUM or AVG.
            async_op: False runs it on the caller's thread when nothing is queued.
            timeout: this op's deadline (default: the group's).

        Raises:
            TypeError, InvalidArgumentError: at call time, as
                ``Communicator.all_reduce_quantized``.
            Through the Work: MismatchError (a peer passed other bits, block,
                size, dtype or op) and network PcclErrors.
        """
        dtype = check_tensor(tensor, "tensor")
        qtype, red = quantized_args(tensor, bits, block, op)
        opts = c10d.AllreduceOptions()
        opts.asyncOp = async_op
        if timeout is not None:
            opts.timeout = timeout
        timeout_s = op_timeout(opts, self._timeout_s)
        return self._submit(
            lambda comm: ops.all_reduce_quantized(comm, tensor, dtype, qtype, red, block, timeout_s),
            [tensor], opts, event=("all_reduce_quantized", [tensor]))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts=None) -> PcclWork:
        """All-reduces each tensor in place; mirrors ``dist.all_reduce_coalesced``.

        Tensors of one dtype are flattened into one buffer and reduced with one
        native call (one per dtype, in order of first appearance).
        """
        opts = c10d.AllreduceCoalescedOptions() if opts is None else opts
        groups: dict[int, list[torch.Tensor]] = {}      # by dtype code
        for i, t in enumerate(tensors):
            groups.setdefault(check_tensor(t, f"tensors[{i}]"), []).append(t)
        red = reduce_code(opts)
        timeout_s = op_timeout(opts, self._timeout_s)
        return self._submit(
            lambda comm: ops.all_reduce_coalesced(comm, list(groups.items()), red, timeout_s),
            list(tensors), opts, event=("all_reduce", list(tensors)),
            shown=(dispatched.allreduce_coalesced_, tensors, opts))

    def reduce(self, tensors: list[torch.Tensor], opts=None) -> PcclWork:
        """Reduces ``tensors[0]`` of all ranks into the root's; mirrors ``dist.reduce``.

        Implemented as an all-reduce into a temporary that only the root copies
        out; other ranks' tensors are left unchanged.
        """
        opts = c10d.ReduceOptions() if opts is None else opts
        tensor = single(tensors, "tensors")
        dtype = check_tensor(tensor, "tensor")
        red = reduce_code(opts)
        root = check_root(self.communicator, opts.rootRank)
        timeout_s = op_timeout(opts, self._timeout_s)
        return self._submit(lambda comm: ops.reduce(comm, tensor, dtype, red, root, timeout_s),
                            [tensor], opts, event=("reduce", [tensor]),
                            shown=(dispatched.reduce_, tensors, opts))

    def broadcast(self, tensors: list[torch.Tensor], opts=None) -> PcclWork:
        """Broadcasts ``tensors[0]`` from ``opts.rootRank``; mirrors ``dist.broadcast``."""
        opts = c10d.BroadcastOptions() if opts is None else opts
        tensor = single(tensors, "tensors")
        dtype = check_tensor(tensor, "tensor")
        if opts.rootTensor != 0:
            raise InvalidArgumentError(f"rootTensor {opts.rootTensor} out of range for 1 tensor")
        root = check_root(self.communicator, opts.rootRank)
        timeout_s = op_timeout(opts, self._timeout_s)
        return self._submit(lambda comm: ops.broadcast(comm, tensor, dtype, root, timeout_s),
                            [tensor], opts, event=("broadcast", [tensor]),
                            shown=(dispatched.broadcast_, tensors, opts))

    # -- all-gather family -------------------------------------------------

    def allgather(self, output_tensors: list[list[torch.Tensor]],
                  input_tensors: list[torch.Tensor], opts=None) -> PcclWork:
        """``output_tensors[0][r] = input_tensors[0]`` of rank r; mirrors ``dist.all_gather``."""
        opts = c10d.AllgatherOptions() if opts is None else opts
        outputs = single(output_tensors, "output_tensors")
        inp = single(input_tensors, "input_tensors")
        dtype = check_gather_list(self.communicator, outputs, inp, "output_tensors[0]")
        timeout_s = op_timeout(opts, self._timeout_s)
        return self._submit(
            lambda comm: ops.gather_into_list(comm, inp, outputs, dtype, timeout_s),
                            list(outputs), opts, inputs=[inp], event=("all_gather", [inp]),
                            shown=(dispatched.allgather_, output_tensors, input_tensors, opts))

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            input_list: list[torch.Tensor], opts=None) -> PcclWork:
        """``output_lists[r][i] = input_list[i]`` of rank r, as one Work.

        Mirrors ``dist.all_gather_coalesced``: one output list per rank, each
        holding one tensor per input.
        """
        opts = c10d.AllgatherOptions() if opts is None else opts
        per_input = per_input_lists(self.communicator, output_lists, input_list)
        timeout_s = op_timeout(opts, self._timeout_s)
        return self._submit(lambda comm: ops.gather_lists(comm, input_list, per_input, timeout_s),
                            [t for outs in output_lists for t in outs], opts, inputs=input_list,
                            event=("all_gather", list(input_list)),
                            shown=(dispatched.allgather_coalesced_, output_lists, input_list, opts))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts=None) -> PcclWork:
        """``output`` (world_size * N elements) = inputs (N) of all ranks in rank order.

        Mirrors ``dist.all_gather_into_tensor``.
        """
        opts = c10d.AllgatherOptions() if opts is None else opts
        dtype = check_tensor(input, "input")
        check_tensor(output, "output")
        check_scaled(output, input, self.communicator.world_size, "output", "input")
        timeout_s = op_timeout(opts, self._timeout_s)
        return self._submit(lambda comm: ops.all_gather(comm, output, input, dtype, timeout_s),
                            [output], opts, inputs=[input], event=("all_gather", [input]),
                            shown=(dispatched.allgather_base_, output, input, opts))

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor],
                                    inputs: list[torch.Tensor], opts=None) -> PcclWork:
        """``all_gather_single`` on each (outputs[i], inputs[i]) pair, as one Work."""
        opts = c10d.AllgatherOptions() if opts is None else opts
        pairs = check_pairs(outputs, inputs)
        for i, (out, inp, _) in enumerate(pairs):
            check_scaled(out, inp, self.communicator.world_size, f"outputs[{i}]", f"inputs[{i}]")
        timeout_s = op_timeout(opts, self._timeout_s)
        return self._submit(lambda comm: ops.all_gather_pairs(comm, pairs, timeout_s),
                            list(outputs), opts, inputs=inputs,
                            event=("all_gather", list(inputs)),
                            shown=(dispatched.allgather_into_tensor_coalesced_, outputs, inputs,
                                   opts))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_tensors: list[list[torch.Tensor]],
               input_tensors: list[torch.Tensor], opts=None) -> PcclWork:
        """Root's ``output_tensors[0][r] = input_tensors[0]`` of rank r; mirrors ``dist.gather``.

        An all-to-all-v in which only the root receives.
        """
        opts = c10d.GatherOptions() if opts is None else opts
        inp = single(input_tensors, "input_tensors")
        dtype = check_tensor(inp, "input")
        root = check_root(self.communicator, opts.rootRank)
        outputs = root_list(self.communicator, root, output_tensors, inp, "output_tensors")
        timeout_s = op_timeout(opts, self._timeout_s)
        return self._submit(lambda comm: ops.gather(comm, inp, outputs, dtype, root, timeout_s),
                            list(outputs), opts, inputs=[inp], event=("gather", [inp]),
                            shown=(dispatched.gather_, output_tensors, input_tensors, opts))

    # -- reduce-scatter family ---------------------------------------------

    def reduce_scatter(self, output_tensors: list[torch.Tensor],
                       input_tensors: list[list[torch.Tensor]], opts=None) -> PcclWork:
        """``output_tensors[0] = op over ranks of input_tensors[0][rank]``; mirrors ``dist.reduce_scatter``."""
        opts = c10d.ReduceScatterOptions() if opts is None else opts
        out = single(output_tensors, "output_tensors")
        inputs = single(input_tensors, "input_tensors")
        dtype = check_gather_list(self.communicator, inputs, out, "input_tensors[0]")
        red = reduce_code(opts)
        timeout_s = op_timeout(opts, self._timeout_s)
        return self._submit(
            lambda comm: ops.reduce_scatter_list(comm, out, inputs, dtype, red, timeout_s),
            [out], opts, inputs=inputs, event=("reduce_scatter", list(inputs)),
            shown=(dispatched.reduce_scatter_, output_tensors, input_tensors, opts))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts=None) -> PcclWork:
        """``output`` (N) = op over ranks of ``input[rank*N:(rank+1)*N]`` (input: world_size * N).

        Mirrors ``dist.reduce_scatter_tensor``.
        """
        opts = c10d.ReduceScatterOptions() if opts is None else opts
        dtype = check_tensor(input, "input")
        check_tensor(output, "output")
        check_scaled(input, output, self.communicator.world_size, "input", "output")
        red = reduce_code(opts)
        timeout_s = op_timeout(opts, self._timeout_s)
        return self._submit(
            lambda comm: ops.reduce_scatter(comm, output, input, dtype, red, timeout_s),
                            [output], opts, inputs=[input], event=("reduce_scatter_tensor", [input]),
                            shown=(dispatched.reduce_scatter_base_, output, input, opts))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts=None) -> PcclWork:
        """``reduce_scatter_single`` on each (outputs[i], inputs[i]) pair, as one Work."""
        opts = c10d.ReduceScatterOptions() if opts is None else opts
        pairs = check_pairs(outputs, inputs)
        for i, (out, inp, _) in enumerate(pairs):
            check_scaled(inp, out, self.communicator.world_size, f"inputs[{i}]", f"outputs[{i}]")
        red = reduce_code(opts)
        timeout_s = op_timeout(opts, self._timeout_s)
        return self._submit(lambda comm: ops.reduce_scatter_pairs(comm, pairs, red, timeout_s),
                            list(outputs), opts, inputs=inputs,
                            event=("reduce_scatter_tensor_coalesced", list(inputs)),
                            shown=(dispatched.reduce_scatter_tensor_coalesced_, outputs, inputs,
                                   opts))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def scatter(self, output_tensors: list[torch.Tensor],
                input_tensors: list[list[torch.Tensor]], opts=None) -> PcclWork:
        """``output_tensors[0] = input_tensors[0][rank]`` of the root; mirrors ``dist.scatter``.

        An all-to-all-v in which only the root sends.
        """
        opts = c10d.ScatterOptions() if opts is None else opts
        out = single(output_tensors, "output_tensors")
        dtype = check_tensor(out, "output")
        root = check_root(self.communicator, opts.rootRank)
        inputs = root_list(self.communicator, root, input_tensors, out, "input_tensors")
        timeout_s = op_timeout(opts, self._timeout_s)
        return self._submit(lambda comm: ops.scatter(comm, out, inputs, dtype, root, timeout_s),
                            [out], opts, inputs=inputs, event=("scatter", list(inputs)),
                            shown=(dispatched.scatter_, output_tensors, input_tensors, opts))

    # -- all-to-all --------------------------------------------------------

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: Sequence[int], input_split_sizes: Sequence[int],
                          opts=None) -> PcclWork:
        """Splits ``input`` by rows (dim 0) and sends split p to rank p; mirrors ``dist.all_to_all_single``.

        Empty split-size lists mean equal splits (dim 0 divisible by world size).
        """
        opts = c10d.AllToAllOptions() if opts is None else opts
        dtype = check_tensor(input, "input")
        check_tensor(output, "output")
        check_scaled(output, input, None, "output", "input")
        n = self.communicator.world_size
        send = row_splits(input, input_split_sizes, n, "input")
        recv = row_splits(output, output_split_sizes, n, "output")
        timeout_s = op_timeout(opts, self._timeout_s)
        return self._submit(
            lambda comm: ops.all_to_all(comm, output, input, dtype, send, recv, timeout_s),
            [output], opts, inputs=[input], event=("all_to_all", [input]),
            shown=(dispatched.alltoall_base_, output, input, output_split_sizes,
                   input_split_sizes, opts))

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts=None) -> PcclWork:
        """``output_tensors[p]`` = rank p's ``input_tensors[me]``; mirrors ``dist.all_to_all``."""
        opts = c10d.AllToAllOptions() if opts is None else opts
        dtype = check_all_to_all_lists(self.communicator, output_tensors, input_tensors)
        timeout_s = op_timeout(opts, self._timeout_s)
        return self._submit(
            lambda comm: ops.all_to_all_list(comm, output_tensors, input_tensors, dtype,
                                             timeout_s),
            list(output_tensors), opts, inputs=input_tensors,
            event=("all_to_all", list(input_tensors)),
            shown=(dispatched.alltoall_, output_tensors, input_tensors, opts))

    # -- point to point and barrier ----------------------------------------

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> PcclWork:
        """Sends ``tensors[0]`` to group rank ``dstRank``; mirrors ``dist.send``/``dist.isend``.

        Point-to-point ops are held back and run together as one batch
        (``c10d.p2p``) when one of their Works is waited on or queried, or
        before the group's next other op, so an ``isend`` followed by an
        ``irecv`` between two ranks cannot deadlock on full socket buffers.
        """
        return self._as_c10d_op((dispatched.send, tensors, dstRank, tag),
                                lambda: self._p2p.queue(True, tensors, dstRank, tag))

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> PcclWork:
        """Receives into ``tensors[0]`` from group rank ``srcRank``; mirrors ``dist.recv``/``dist.irecv``.

        Batched with neighbouring sends and receives, as ``send`` says.
        """
        return self._as_c10d_op((dispatched.recv_, tensors, srcRank, tag),
                                lambda: self._p2p.queue(False, tensors, srcRank, tag))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> PcclWork:
        """Receives into ``tensors[0]`` from whichever rank sends to this one first.

        Mirrors ``dist.recv``/``dist.irecv`` with no ``src``: the Work's
        ``_source_rank()`` is the sender's group rank once it completes
        (``Communicator.recv_any_source``). Runs after the sends and receives
        issued before it, not batched with them: a rank that ``isend``s more than
        a socket buffer holds to a peer and then receives from any source waits
        until that peer reads (gloo overlaps the two).
        """
        tensor = single(tensors, "tensors")
        check_tensor(tensor, "tensor")
        checked_tag(tag)
        if self.communicator.world_size == 1:
            raise InvalidArgumentError("recv from any source in a group of 1: no other rank")
        return self._as_c10d_op((dispatched.recv_any_source_, tensors, tag),
                                lambda: self._p2p.recv_any_source(tensor, tag))

    def monitored_barrier(self, timeout: timedelta | float | None = None,
                          wait_all_ranks: bool = False) -> None:
        """A barrier that names the ranks that did not arrive; mirrors c10d's (gloo-only) one.

        Rank 0 waits up to ``timeout`` for every other rank, then answers them
        (``torch_pccl.c10d.monitored_barrier.run``); runs after every op issued
        before it on this rank. Returns when all have arrived.

        Args:
            timeout: timedelta or seconds (default: the group's timeout).
            wait_all_ranks: name every rank that did not arrive, not only the lowest.

        Raises:
            PcclTimeoutError: on rank 0, "Rank 1 failed to pass monitoredBarrier in
                2000 ms" ("Ranks 1, 3 ..." with ``wait_all_ranks``).
            PcclError: on other ranks, "Rank 2 successfully reached monitoredBarrier,
                but received errors while waiting for send/recv from rank 0 ...".
            The group's communicator is failed afterwards, as after any timeout.
        """
        timeout_s = self._timeout_s if timeout is None else config.as_seconds(timeout)
        self.drain()
        self._scheduler.on_lane0(lambda comm: monitored.run(comm, timeout_s, wait_all_ranks),
                                 PcclWork([]), inline=True).wait()

    def barrier(self, opts=None) -> PcclWork:
        """Completes once every rank has called it; mirrors ``dist.barrier``.

        Like gloo's, it first waits for every op this rank issued before it,
        on every lane (an error of those ops is theirs, not the barrier's).
        """
        opts = c10d.BarrierOptions() if opts is None else opts
        timeout_s = op_timeout(opts, self._timeout_s)
        self._p2p.flush()
        earlier = self._scheduler.markers() if self.num_lanes > 1 else []
        return self._submit(lambda comm: ops.barrier(comm, earlier, timeout_s), [], opts,
                            event=("barrier", []), shown=(dispatched.barrier, opts))

    # -- internals ---------------------------------------------------------

    def _submit(self, fn: Op, outputs: list[torch.Tensor], opts,
                inputs: Sequence[torch.Tensor] = (),
                event: tuple[str, Sequence[torch.Tensor]] = ("", ()),
                shown: tuple = ()) -> PcclWork:
        if dispatch_mode_count():
            return self._as_c10d_op(shown, lambda: self._queue(fn, outputs, opts, inputs, event))
        return self._queue(fn, outputs, opts, inputs, event)

    def _as_c10d_op(self, shown: tuple, body):
        """``body()``'s Work, shown to the active TorchDispatchModes (``CommDebugMode``) as
        the c10d op a C++ group would call: ``shown`` is a ``c10d.dispatched`` builder and
        the method's arguments (empty: an op c10d has not). Just ``body()`` with no mode."""
        if not shown or not dispatch_mode_count():
            return body()
        build, *args = shown
        return call_as_c10d_op(build.op, build(self, *args), body)

    def _queue(self, fn: Op, outputs: list[torch.Tensor], opts, inputs: Sequence[torch.Tensor],
               event: tuple[str, Sequence[torch.Tensor]]) -> PcclWork:
        # Held-back sends and receives go first: they were issued before this op.
        self._p2p.flush()
        # asyncOp=False means the caller waits right away (dist.* with
        # async_op=False): run it inline if nothing is ahead of it on its lane.
        inline = opts is not None and getattr(opts, "asyncOp", True) is False
        return self._scheduler.collective(fn, outputs, inline, inputs, event)


def pccl_group(group=None) -> ProcessGroupPCCL:
    """The ``ProcessGroupPCCL`` behind a c10d group (None: the default group).

    Raises:
        InvalidUsageError: no default group, or ``group`` is not a pccl group.
    """
    if group is None:
        if not dist.is_initialized():
            raise InvalidUsageError("no process group: call init_process_group(backend='pccl') "
                                    "first (init_method='pccl://host:port' for an elastic one)")
        group = default_group()
    pg = group if isinstance(group, ProcessGroupPCCL) else cpu_backend(group)
    if not isinstance(pg, ProcessGroupPCCL):
        raise InvalidUsageError(f"group {group!r} is not a pccl process group")
    return pg


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False) -> None:
    """``dist.monitored_barrier`` for pccl groups (torch allows that one on gloo only).

    Args:
        group: a pccl process group (None: the default group).
        timeout: timedelta or seconds (default: the group's timeout).
        wait_all_ranks: name every rank that did not arrive, not only the lowest.

    Raises:
        InvalidUsageError: ``group`` is not a pccl group.
        As ``ProcessGroupPCCL.monitored_barrier``.
    """
    pccl_group(group).monitored_barrier(timeout, wait_all_ranks)
