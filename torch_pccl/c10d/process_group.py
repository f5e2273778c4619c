"""ProcessGroupPCCL: the c10d glue between torch.distributed and a Communicator.

c10d (Python ``dist.*`` functions, DDP's reducer, FSDP2 and functional
collectives through C++) calls the methods below; each returns a ``PcclWork``.
The traps of subclassing ``dist.ProcessGroup`` from Python are documented in
torch-c10d.md: ``super().__init__(rank, size)``, override ``getRank/getSize``
(not ``rank/size``), the group name/desc accessors, and a Work whose
``wait()`` re-raises.

Argument mistakes (dtype, layout, sizes, list lengths, ranks, ops) raise at
call time on the caller's thread, before the op takes a lane, so an op refused
on one rank does not shift the lanes of the next ones; network errors arrive
through the Work. Tensors that are not on the CPU (CUDA) are staged through host memory:
copied to the CPU, reduced there, copied back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist
# The options classes (AllgatherOptions is not re-exported by torch.distributed).
from torch.distributed import distributed_c10d as c10d

from .. import config
from ..config import BACKEND_NAME
from ..core.communicator import Communicator
from ..core.tensors import check_tensor, checked_tag, op_code, quantized_args
from ..errors import InvalidArgumentError, InvalidUsageError, PcclError
from . import monitored_barrier as monitored
from .sparse import all_reduce_sparse, check_sparse
from .torch_internals import cpu_backend, default_group, profiler_enabled, record_begin, record_end
from .work import Executor, PcclWork


def _guarded(fn: Callable[[], None], tensors: list[torch.Tensor]) -> Callable[[], None]:
    """``fn``, run only if every tensor still has the storage, address and size it had now.

    Holding the tensors (and so their storages) keeps ``del`` by the caller harmless; a
    ``resize_``/``set_`` on a tensor between the call and the op's turn changes what these
    read, and the op then raises ``InvalidUsageError`` without touching any tensor.
    """
    return _guarded_by(tensors, [_layout(t) for t in tensors], fn)


def _guarded_by(tensors: list[torch.Tensor], layouts: list[tuple],
                fn: Callable[[], None]) -> Callable[[], None]:
    """``fn``, run only if ``tensors`` still have the ``layouts`` (``_layout``) taken earlier.

    The storages the tensors have now are held until ``fn`` returns: a caller that gives a
    tensor other storage (``set_``) and frees the old one while the op runs cannot free
    the memory the native op reads or writes (gloo's ``UnboundBuffer`` keeps its memory
    alive the same way). Such an op completes into the old storage, and then raises
    ``InvalidUsageError``: the caller's tensor does not hold its result.
    """
    storages = [t.untyped_storage() for t in tensors]

    def check(when: str) -> None:
        for i, (t, layout) in enumerate(zip(tensors, layouts)):
            if _layout(t) != layout:
                raise InvalidUsageError(
                    f"tensor {i} of this operation was resized or given other storage {when} "
                    f"({layout} -> {_layout(t)}); keep a tensor unchanged until its Work "
                    f"completes")

    def run():
        check("after the call and before the operation ran")
        try:
            fn()
        finally:
            del storages[:]         # not before fn returns: see above
        check("while the operation ran (its result went to the storage the tensor had at "
              "the call)")

    return run


class _P2POp(NamedTuple):
    """A send or receive held back until its batch is flushed (``_flush_p2p``)."""

    is_send: bool
    tensor: torch.Tensor
    peer: int
    tag: int
    work: PcclWork
    layout: tuple          # _layout of the tensor at the call
    event: object | None   # its profiler event, when a profiler runs


def _recorded(event: object, fn: Callable[[], None]) -> Callable[[], None]:
    """``fn``, then the end of the profiler ``event`` (``record_begin``), whatever ``fn`` does."""
    def run():
        try:
            fn()
        finally:
            record_end(event)

    return run


def _layout(t: torch.Tensor) -> tuple[int, int, int, tuple[int, ...]]:
    """(storage address, storage bytes, element address, shape) of ``t``."""
    storage = t.untyped_storage()
    return (storage.data_ptr(), storage.nbytes(), t.data_ptr(), tuple(t.shape))


class ProcessGroupPCCL(dist.ProcessGroup):
    """A ``dist.ProcessGroup`` whose collectives run on a PCCL ``Communicator``.

    The communicator's K lanes (``Communicator.lanes``, env ``PCCL_LANES``)
    each have an executor that runs its ops one at a time in call order. The
    n-th collective issued on the group (n counted from 0, and from 0 again
    after ``reconfigure``) runs on lane ``n % K``: c10d requires every rank to
    issue collectives in the same order, so every rank picks the same lane,
    and up to K async collectives are in flight at once and may finish in any
    order (as with gloo's worker threads, a tensor an unfinished op uses must
    not be used by another op). Point-to-point ops run on lane 0. A
    synchronous op (``async_op=False``) whose lane has nothing queued runs
    inline on the caller's thread. Each op's deadline is
    ``opts.timeout`` when the caller set one, else the group's ``timeout_s``.
    Each call takes one tensor per list (one device per process); more raises
    ``InvalidArgumentError`` (a ValueError).

    Errors are ``PcclError`` subclasses; network errors are sticky per lane:
    after one, every later op on that lane fails the same way until the group
    is rebuilt, while the other lanes stay usable unless the cause (a lost
    peer) reaches them too.

    A group formed through a master (``init_method="pccl://host:port"``)
    carries its ``membership`` (client, listener, current assignment) and can
    be rebuilt in place by ``torch_pccl.update_topology`` (``reconfigure``);
    ``getRank``/``getSize`` then report the new world.

    Public seams for the layers above (as torchft's ``ProcessGroup`` has):
    ``communicator``, ``timeout_s``, ``membership``, ``drain()``,
    ``reconfigure()``, ``errored()``, ``set_ring_order()``.
    """

    def __init__(self, comm: Communicator, timeout_s: float | None = None, membership=None):
        """Wraps a connected ``comm``; the group takes ownership (``shutdown`` closes it).

        Args:
            comm: a connected Communicator (see ``Communicator.bootstrap``).
            timeout_s: default per-op deadline in seconds (default: ``comm.timeout_s``).
            membership: a ``torch_pccl.elastic.Membership`` for a group formed
                through a master (None for a fixed group); the group owns it
                and ``shutdown`` leaves the master cleanly.
        """
        super().__init__(comm.rank, comm.world_size)
        self._lanes: tuple[Communicator, ...] = comm.lanes
        self._lane_local = threading.local()  # .comm: the lane of the op on this thread
        self._seq_lock = threading.Lock()
        self._coll_seq = 0  # collectives issued (since reconfigure); picks their lanes
        self.membership = membership
        self._timeout_s = comm.timeout_s if timeout_s is None else float(timeout_s)
        self._executors = [Executor(f"pccl-rank{comm.rank}" + (f"-lane{k}" if k else ""))
                           for k in range(len(self._lanes))]
        self._p2p_lock = threading.Lock()
        self._p2p_pending: list[_P2POp] = []
        self._group_name: str | None = None
        self._group_desc = "undefined"

    # -- identity (c10d calls these through its C++ view) ------------------

    def getRank(self) -> int:
        return self._comm.rank

    def getSize(self) -> int:
        return self._comm.world_size

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        if self._group_name is None:
            raise RuntimeError("ProcessGroup name not set")
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    # -- c10d's view of the group's backends -------------------------------
    # c10d code (dist.recv without src, FSDP2, DeviceMesh, object collectives,
    # dist.distributed_c10d helpers) asks a group for the backend of a device.
    # A group built in Python cannot register a c10d Backend (its constructor is
    # not exposed), so this group is its own backend for every device it serves,
    # and answers what c10d reads from a backend.

    DEVICE_TYPES = ("cpu", "cuda")
    supports_splitting = False
    supports_coalescing = False
    supports_shrinking = False
    supports_time_estimate = False

    def _get_backend(self, device) -> ProcessGroupPCCL:
        """This group, for a cpu or cuda device (``torch.device`` or str); mirrors c10d's.

        Raises:
            RuntimeError: another device type, with c10d's message.
        """
        kind = torch.device(device).type
        if kind not in self.DEVICE_TYPES:
            raise RuntimeError(f"No backend type associated with device type {kind}")
        return self

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device(kind) for kind in self.DEVICE_TYPES]

    def supports_tensor_alloc(self, device) -> bool:
        """False: tensors come from torch's allocator (no symmetric memory)."""
        return False

    @property
    def communicator(self) -> Communicator:
        """The underlying Communicator, lane 0 (``stats()`` and tuning cover every lane)."""
        return self._lanes[0]

    @property
    def collectives_issued(self) -> int:
        """Collectives issued on this group since it was built or reconfigured (not p2p).

        Equal on every member at the same point of the op sequence (c10d's contract),
        so membership queries key their answers by it.
        """
        with self._seq_lock:
            return self._coll_seq

    @property
    def num_lanes(self) -> int:
        """K: how many collectives can be in flight at once (``Communicator.lanes``)."""
        return len(self._lanes)

    @property
    def timeout_s(self) -> float:
        """The default per-op deadline, seconds (``opts.timeout`` overrides it per op)."""
        return self._timeout_s

    def errored(self) -> PcclError | None:
        """The sticky network error of the group's communicator (any lane), else None.

        Mirrors torchft's ``ProcessGroup.errored()``: after a lost peer or a
        timeout every later op on that lane fails the same way until
        ``update_topology`` rebuilds the group.
        """
        return self._lanes[0].errored()

    @property
    def _comm(self) -> Communicator:
        # The lane of the op running on this thread (set by _on_lane), else lane 0:
        # the ops' bodies call self._comm.<collective> and so run on their lane.
        return getattr(self._lane_local, "comm", None) or self._lanes[0]

    # -- lifecycle ---------------------------------------------------------

    def abort(self) -> None:
        """Fails the running op and every queued op with ``AbortedError``, then frees the communicator.

        A group formed through a master also leaves it (the others see this
        peer gone at their next update round).
        """
        self._flush_p2p()
        self._lanes[0].abort()  # every lane
        for executor in self._executors:
            executor.close(drain=False)
        self._lanes[0].close()
        self._leave()

    def shutdown(self) -> None:
        """Runs the queued ops to completion, then frees the communicator (``destroy_process_group``).

        A group formed through a master then leaves it cleanly (``leave``,
        not an error) and closes its listener.
        """
        self._flush_p2p()
        for executor in self._executors:
            executor.close(drain=True)
        self._lanes[0].close()
        self._leave()

    def _leave(self) -> None:
        membership, self.membership = self.membership, None
        if membership is not None:
            membership.close(leave=True)

    def drain(self) -> None:
        """Returns once every op submitted so far, on every lane, has finished (or failed).

        Raises:
            InvalidUsageError: the group was shut down or aborted.
        """
        self._flush_p2p()
        if self._executors[0].closed:
            raise InvalidUsageError("process group was shut down or aborted")
        for marker in self._markers(range(len(self._executors))):
            marker.get_future().wait()

    def _markers(self, lanes) -> list[PcclWork]:
        # One no-op per lane in `lanes`: each completes once the lane's earlier ops have.
        return [self._executors[k].submit(lambda: None, PcclWork([]), inline=False)
                for k in lanes]

    def set_ring_order(self, order) -> None:
        """Runs the group's ring collectives around ``order`` (rank at each ring position).

        Waits for the queued ops, then sets the order on every lane
        (``Communicator.set_ring_order``). A collective: every rank passes the
        same order at the same point of its op sequence; ``torch_pccl.optimize_topology``
        measures the links and calls this. ``reconfigure`` starts over in rank order.

        Raises:
            InvalidArgumentError: ``order`` is not a permutation of the ranks.
            InvalidUsageError: the group was shut down or aborted.
        """
        self.drain()
        self._lanes[0].set_ring_order(order)

    @property
    def ring_order(self) -> tuple[int, ...]:
        """The rank at each position of the group's ring (rank order by default)."""
        return self._lanes[0].ring_order

    def reconfigure(self, new_comm: Communicator) -> Communicator:
        """Swaps in ``new_comm`` after draining the queued ops; closes and returns the old one.

        Must be called on every rank at the same point of the op sequence (it
        is part of ``update_topology``, a collective). Ops issued afterwards run
        on ``new_comm``'s lanes, numbered from lane 0 again (as a joiner's new
        group numbers them); ``getRank``/``getSize`` report its rank and size.

        Raises:
            InvalidArgumentError: ``new_comm`` has another number of lanes.
            InvalidUsageError: the group was shut down or aborted.
        """
        if len(new_comm.lanes) != len(self._lanes):
            raise InvalidArgumentError(f"new communicator has {len(new_comm.lanes)} lanes, "
                                       f"the group runs {len(self._lanes)}")
        self.drain()
        old, self._lanes = self._lanes[0], new_comm.lanes
        with self._seq_lock:
            self._coll_seq = 0
        old.close()
        return old

    # -- all-reduce family -------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts=None) -> PcclWork:
        """In-place all-reduce of ``tensors[0]``; mirrors ``dist.all_reduce``.

        ``opts.reduceOp``: SUM, AVG, MIN, MAX, PRODUCT (others raise InvalidArgumentError).
        """
        opts = c10d.AllreduceOptions() if opts is None else opts
        tensor = _single(tensors, "tensors")
        if tensor.layout == torch.sparse_coo:
            return self._allreduce_sparse(tensor, opts)
        _check_tensor(tensor, "tensor")
        op = _reduce_op(opts)
        timeout_s = self._op_timeout(opts)

        def run():
            host = _host(tensor)
            self._comm.all_reduce(host, host, op, timeout_s=timeout_s)
            _copy_back(tensor, host)

        return self._submit(run, [tensor], opts, event=("all_reduce", [tensor]))

    def _allreduce_sparse(self, tensor: torch.Tensor, opts) -> PcclWork:
        # The result is copied in only after every gather succeeded.
        check_sparse(tensor, opts.reduceOp.op)
        timeout_s = self._op_timeout(opts)

        def run():
            result = all_reduce_sparse(self._comm, tensor, timeout_s)
            tensor.copy_(result.to(tensor.device))

        return self._submit(run, [tensor], opts, event=("all_reduce_sparse", []))

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
        _check_tensor(tensor, "tensor")
        quantized_args(tensor, bits, block, op)
        opts = c10d.AllreduceOptions()
        opts.asyncOp = async_op
        if timeout is not None:
            opts.timeout = timeout
        timeout_s = self._op_timeout(opts)

        def run():
            host = _host(tensor)
            self._comm.all_reduce_quantized(host, host, bits=bits, block=block, op=op,
                                            timeout_s=timeout_s)
            _copy_back(tensor, host)

        return self._submit(run, [tensor], opts, event=("all_reduce_quantized", [tensor]))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts=None) -> PcclWork:
        """All-reduces each tensor in place; mirrors ``dist.all_reduce_coalesced``.

        Tensors of one dtype are flattened into one buffer and reduced with one
        native call (one per dtype, in order of first appearance).
        """
        opts = c10d.AllreduceCoalescedOptions() if opts is None else opts
        for i, t in enumerate(tensors):
            _check_tensor(t, f"tensors[{i}]")
        op = _reduce_op(opts)
        timeout_s = self._op_timeout(opts)
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault(t.dtype, []).append(t)

        def run():
            for group in groups.values():
                flat = torch.cat([_host(t).reshape(-1) for t in group])
                self._comm.all_reduce(flat, flat, op, timeout_s=timeout_s)
                offset = 0
                for t in group:
                    t.copy_(flat[offset:offset + t.numel()].view(t.shape))
                    offset += t.numel()

        return self._submit(run, list(tensors), opts, event=("all_reduce", list(tensors)))

    def reduce(self, tensors: list[torch.Tensor], opts=None) -> PcclWork:
        """Reduces ``tensors[0]`` of all ranks into the root's; mirrors ``dist.reduce``.

        Implemented as an all-reduce into a temporary that only the root copies
        out; other ranks' tensors are left unchanged.
        """
        opts = c10d.ReduceOptions() if opts is None else opts
        tensor = _single(tensors, "tensors")
        _check_tensor(tensor, "tensor")
        op = _reduce_op(opts)
        root = self._check_root(opts.rootRank)
        timeout_s = self._op_timeout(opts)

        def run():
            host = _host(tensor)
            result = torch.empty_like(host)
            self._comm.all_reduce(host, result, op, timeout_s=timeout_s)
            if self._comm.rank == root:
                tensor.copy_(result)

        return self._submit(run, [tensor], opts, event=("reduce", [tensor]))

    def broadcast(self, tensors: list[torch.Tensor], opts=None) -> PcclWork:
        """Broadcasts ``tensors[0]`` from ``opts.rootRank``; mirrors ``dist.broadcast``."""
        opts = c10d.BroadcastOptions() if opts is None else opts
        tensor = _single(tensors, "tensors")
        _check_tensor(tensor, "tensor")
        if opts.rootTensor != 0:
            raise InvalidArgumentError(f"rootTensor {opts.rootTensor} out of range for 1 tensor")
        root = self._check_root(opts.rootRank)
        timeout_s = self._op_timeout(opts)

        def run():
            host = _host(tensor)
            self._comm.broadcast(host, root, timeout_s=timeout_s)
            _copy_back(tensor, host)

        return self._submit(run, [tensor], opts, event=("broadcast", [tensor]))

    # -- all-gather family -------------------------------------------------

    def allgather(self, output_tensors: list[list[torch.Tensor]],
                  input_tensors: list[torch.Tensor], opts=None) -> PcclWork:
        """``output_tensors[0][r] = input_tensors[0]`` of rank r; mirrors ``dist.all_gather``."""
        opts = c10d.AllgatherOptions() if opts is None else opts
        outputs = _single(output_tensors, "output_tensors")
        inp = _single(input_tensors, "input_tensors")
        self._check_gather_list(outputs, inp, "output_tensors[0]")
        timeout_s = self._op_timeout(opts)

        def run():
            self._gather_into_list(inp, outputs, timeout_s)

        return self._submit(run, list(outputs), opts, inputs=[inp], event=("all_gather", [inp]))

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            input_list: list[torch.Tensor], opts=None) -> PcclWork:
        """``output_lists[r][i] = input_list[i]`` of rank r, as one Work.

        Mirrors ``dist.all_gather_coalesced``: one output list per rank, each
        holding one tensor per input.
        """
        opts = c10d.AllgatherOptions() if opts is None else opts
        n = self._comm.world_size
        if len(output_lists) != n:
            raise InvalidArgumentError(f"output_lists needs one list per rank ({n}), got {len(output_lists)}")
        for r, outputs in enumerate(output_lists):
            if len(outputs) != len(input_list):
                raise InvalidArgumentError(
                    f"output_lists[{r}] holds {len(outputs)} tensors for {len(input_list)} inputs")
        per_input = [[output_lists[r][i] for r in range(n)] for i in range(len(input_list))]
        for i, (outputs, inp) in enumerate(zip(per_input, input_list)):
            self._check_gather_list(outputs, inp, f"output_lists[*][{i}]")
        timeout_s = self._op_timeout(opts)

        def run():
            for outputs, inp in zip(per_input, input_list):
                self._gather_into_list(inp, outputs, timeout_s)

        return self._submit(run, [t for outs in output_lists for t in outs], opts, inputs=input_list,
                            event=("all_gather", list(input_list)))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts=None) -> PcclWork:
        """``output`` (world_size * N elements) = inputs (N) of all ranks in rank order.

        Mirrors ``dist.all_gather_into_tensor``.
        """
        opts = c10d.AllgatherOptions() if opts is None else opts
        _check_tensor(input, "input")
        _check_tensor(output, "output")
        _check_scaled(output, input, self._comm.world_size, "output", "input")
        timeout_s = self._op_timeout(opts)

        def run():
            host_out = _host(output)
            self._comm.all_gather(_host(input), host_out, timeout_s=timeout_s)
            _copy_back(output, host_out)

        return self._submit(run, [output], opts, inputs=[input],
                            event=("all_gather", [input]))

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor],
                                    inputs: list[torch.Tensor], opts=None) -> PcclWork:
        """``all_gather_single`` on each (outputs[i], inputs[i]) pair, as one Work."""
        opts = c10d.AllgatherOptions() if opts is None else opts
        pairs = self._check_pairs(outputs, inputs)
        for i, (out, inp) in enumerate(pairs):
            _check_scaled(out, inp, self._comm.world_size, f"outputs[{i}]", f"inputs[{i}]")
        timeout_s = self._op_timeout(opts)

        def run():
            for out, inp in pairs:
                host_out = _host(out)
                self._comm.all_gather(_host(inp), host_out, timeout_s=timeout_s)
                _copy_back(out, host_out)

        return self._submit(run, list(outputs), opts, inputs=inputs,
                            event=("all_gather", list(inputs)))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_tensors: list[list[torch.Tensor]],
               input_tensors: list[torch.Tensor], opts=None) -> PcclWork:
        """Root's ``output_tensors[0][r] = input_tensors[0]`` of rank r; mirrors ``dist.gather``.

        An all-to-all-v in which only the root receives.
        """
        opts = c10d.GatherOptions() if opts is None else opts
        inp = _single(input_tensors, "input_tensors")
        _check_tensor(inp, "input")
        root = self._check_root(opts.rootRank)
        n, me = self._comm.world_size, self._comm.rank
        if me == root:
            outputs = _single(output_tensors, "output_tensors")
            self._check_gather_list(outputs, inp, "output_tensors[0]")
        elif any(len(lst) for lst in output_tensors):
            raise InvalidArgumentError("output_tensors must be empty on a non-root rank")
        else:
            outputs = []
        count = inp.numel()
        timeout_s = self._op_timeout(opts)

        def run():
            host_in = _host(inp)
            send_counts = [count if r == root else 0 for r in range(n)]
            if me == root:
                gathered = torch.empty(n * count, dtype=inp.dtype)
                self._comm.all_to_all_v(host_in, send_counts, [0] * n, gathered, [count] * n,
                                        [r * count for r in range(n)], timeout_s=timeout_s)
                for r, out in enumerate(outputs):
                    out.copy_(gathered[r * count:(r + 1) * count].view(out.shape))
            else:
                # Receives nothing: the input doubles as the (unwritten) receive buffer.
                self._comm.all_to_all_v(host_in, send_counts, [0] * n, host_in, [0] * n,
                                        [0] * n, timeout_s=timeout_s)

        return self._submit(run, list(outputs), opts, inputs=[inp], event=("gather", [inp]))

    # -- reduce-scatter family ---------------------------------------------

    def reduce_scatter(self, output_tensors: list[torch.Tensor],
                       input_tensors: list[list[torch.Tensor]], opts=None) -> PcclWork:
        """``output_tensors[0] = op over ranks of input_tensors[0][rank]``; mirrors ``dist.reduce_scatter``."""
        opts = c10d.ReduceScatterOptions() if opts is None else opts
        out = _single(output_tensors, "output_tensors")
        inputs = _single(input_tensors, "input_tensors")
        self._check_gather_list(inputs, out, "input_tensors[0]")
        op = _reduce_op(opts)
        timeout_s = self._op_timeout(opts)

        def run():
            flat = torch.cat([_host(t).reshape(-1) for t in inputs])
            host_out = _host(out)
            self._comm.reduce_scatter(flat, host_out, op, timeout_s=timeout_s)
            _copy_back(out, host_out)

        return self._submit(run, [out], opts, inputs=inputs, event=("reduce_scatter", list(inputs)))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts=None) -> PcclWork:
        """``output`` (N) = op over ranks of ``input[rank*N:(rank+1)*N]`` (input: world_size * N).

        Mirrors ``dist.reduce_scatter_tensor``.
        """
        opts = c10d.ReduceScatterOptions() if opts is None else opts
        _check_tensor(input, "input")
        _check_tensor(output, "output")
        _check_scaled(input, output, self._comm.world_size, "input", "output")
        op = _reduce_op(opts)
        timeout_s = self._op_timeout(opts)

        def run():
            host_out = _host(output)
            self._comm.reduce_scatter(_host(input), host_out, op, timeout_s=timeout_s)
            _copy_back(output, host_out)

        return self._submit(run, [output], opts, inputs=[input],
                            event=("reduce_scatter_tensor", [input]))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts=None) -> PcclWork:
        """``reduce_scatter_single`` on each (outputs[i], inputs[i]) pair, as one Work."""
        opts = c10d.ReduceScatterOptions() if opts is None else opts
        pairs = self._check_pairs(outputs, inputs)
        for i, (out, inp) in enumerate(pairs):
            _check_scaled(inp, out, self._comm.world_size, f"inputs[{i}]", f"outputs[{i}]")
        op = _reduce_op(opts)
        timeout_s = self._op_timeout(opts)

        def run():
            for out, inp in pairs:
                host_out = _host(out)
                self._comm.reduce_scatter(_host(inp), host_out, op, timeout_s=timeout_s)
                _copy_back(out, host_out)

        return self._submit(run, list(outputs), opts, inputs=inputs,
                            event=("reduce_scatter_tensor_coalesced", list(inputs)))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def scatter(self, output_tensors: list[torch.Tensor],
                input_tensors: list[list[torch.Tensor]], opts=None) -> PcclWork:
        """``output_tensors[0] = input_tensors[0][rank]`` of the root; mirrors ``dist.scatter``.

        An all-to-all-v in which only the root sends.
        """
        opts = c10d.ScatterOptions() if opts is None else opts
        out = _single(output_tensors, "output_tensors")
        _check_tensor(out, "output")
        root = self._check_root(opts.rootRank)
        n, me = self._comm.world_size, self._comm.rank
        if me == root:
            inputs = _single(input_tensors, "input_tensors")
            self._check_gather_list(inputs, out, "input_tensors[0]")
        elif any(len(lst) for lst in input_tensors):
            raise InvalidArgumentError("input_tensors must be empty on a non-root rank")
        else:
            inputs = []
        count = out.numel()
        timeout_s = self._op_timeout(opts)

        def run():
            host_out = _host(out)
            recv_counts = [count if r == root else 0 for r in range(n)]
            if me == root:
                flat = torch.cat([_host(t).reshape(-1) for t in inputs])
                self._comm.all_to_all_v(flat, [count] * n, [r * count for r in range(n)],
                                        host_out, recv_counts, [0] * n, timeout_s=timeout_s)
            else:
                # Sends nothing: the output doubles as the (unread) send buffer.
                self._comm.all_to_all_v(host_out, [0] * n, [0] * n, host_out, recv_counts,
                                        [0] * n, timeout_s=timeout_s)
            _copy_back(out, host_out)

        return self._submit(run, [out], opts, inputs=inputs, event=("scatter", list(inputs)))

    # -- all-to-all --------------------------------------------------------

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: Sequence[int], input_split_sizes: Sequence[int],
                          opts=None) -> PcclWork:
        """Splits ``input`` by rows (dim 0) and sends split p to rank p; mirrors ``dist.all_to_all_single``.

        Empty split-size lists mean equal splits (dim 0 divisible by world size).
        """
        opts = c10d.AllToAllOptions() if opts is None else opts
        _check_tensor(input, "input")
        _check_tensor(output, "output")
        _check_scaled(output, input, None, "output", "input")
        n = self._comm.world_size
        send_counts, send_displs = _row_splits(input, input_split_sizes, n, "input")
        recv_counts, recv_displs = _row_splits(output, output_split_sizes, n, "output")
        timeout_s = self._op_timeout(opts)

        def run():
            host_out = _host(output)
            self._comm.all_to_all_v(_host(input), send_counts, send_displs, host_out,
                                    recv_counts, recv_displs, timeout_s=timeout_s)
            _copy_back(output, host_out)

        return self._submit(run, [output], opts, inputs=[input], event=("all_to_all", [input]))

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts=None) -> PcclWork:
        """``output_tensors[p]`` = rank p's ``input_tensors[me]``; mirrors ``dist.all_to_all``."""
        opts = c10d.AllToAllOptions() if opts is None else opts
        n = self._comm.world_size
        for name, lst in (("output_tensors", output_tensors), ("input_tensors", input_tensors)):
            if len(lst) != n:
                raise InvalidArgumentError(f"{name} needs {n} tensors, got {len(lst)}")
            for i, t in enumerate(lst):
                _check_tensor(t, f"{name}[{i}]")
                if t.dtype != input_tensors[0].dtype:
                    raise InvalidArgumentError(f"{name}[{i}] is {t.dtype}, "
                                               f"input_tensors[0] is {input_tensors[0].dtype}")
        send_counts = [t.numel() for t in input_tensors]
        recv_counts = [t.numel() for t in output_tensors]
        timeout_s = self._op_timeout(opts)

        def run():
            flat_in = torch.cat([_host(t).reshape(-1) for t in input_tensors])
            flat_out = torch.empty(sum(recv_counts), dtype=flat_in.dtype)
            self._comm.all_to_all_v(flat_in, send_counts, _offsets(send_counts), flat_out,
                                    recv_counts, _offsets(recv_counts), timeout_s=timeout_s)
            for out, part in zip(output_tensors, flat_out.split(recv_counts)):
                out.copy_(part.view(out.shape))

        return self._submit(run, list(output_tensors), opts, inputs=input_tensors,
                            event=("all_to_all", list(input_tensors)))

    # -- point to point and barrier ----------------------------------------

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> PcclWork:
        """Sends ``tensors[0]`` to group rank ``dstRank``; mirrors ``dist.send``/``dist.isend``.

        Point-to-point ops are held back and run together as one batch (see
        ``_flush_p2p``) when one of their Works is waited on or queried, or
        before the group's next other op, so an ``isend`` followed by an
        ``irecv`` between two ranks cannot deadlock on full socket buffers.
        """
        return self._queue_p2p(True, tensors, dstRank, tag)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> PcclWork:
        """Receives into ``tensors[0]`` from group rank ``srcRank``; mirrors ``dist.recv``/``dist.irecv``.

        Batched with neighbouring sends and receives, as ``send`` says.
        """
        return self._queue_p2p(False, tensors, srcRank, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> PcclWork:
        """Receives into ``tensors[0]`` from whichever rank sends to this one first.

        Mirrors ``dist.recv``/``dist.irecv`` with no ``src``: the Work's
        ``_source_rank()`` is the sender's group rank once it completes
        (``Communicator.recv_any_source``). Runs after the sends and receives
        issued before it, not batched with them: a rank that ``isend``s more than
        a socket buffer holds to a peer and then receives from any source waits
        until that peer reads (gloo overlaps the two).
        """
        tensor = _single(tensors, "tensors")
        _check_tensor(tensor, "tensor")
        checked_tag(tag)
        if self._comm.world_size == 1:
            raise InvalidArgumentError("recv from any source in a group of 1: no other rank")
        timeout_s = self._timeout_s
        work = PcclWork([tensor])

        def run():
            host = _host(tensor)
            src = self._comm.recv_any_source(host, tag, timeout_s=timeout_s)
            _copy_back(tensor, host)
            work.source = src

        self._flush_p2p()
        run = _guarded(run, [tensor])
        if profiler_enabled():
            run = _recorded(record_begin(f"{BACKEND_NAME}:recvAnySource", [tensor]), run)
        return self._executors[0].submit(run, work, inline=False)

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
        work = self._executors[0].submit(
            lambda: monitored.run(self._comm, timeout_s, wait_all_ranks),
            PcclWork([]), inline=True)
        work.wait()

    def _queue_p2p(self, is_send: bool, tensors: list[torch.Tensor], peer: int,
                   tag: int) -> PcclWork:
        tensor = _single(tensors, "tensors")
        _check_tensor(tensor, "tensor")
        self._check_peer(peer)
        work = PcclWork([tensor], start=self._flush_p2p)
        if not is_send:
            work.source = peer
        event = (record_begin(f"{BACKEND_NAME}:{'send' if is_send else 'recv'}", [tensor])
                 if profiler_enabled() else None)
        with self._p2p_lock:
            self._p2p_pending.append(_P2POp(is_send, tensor, peer, tag, work, _layout(tensor),
                                            event))
        return work

    def _flush_p2p(self, blocking: bool = False) -> None:
        # Hands every held-back send/recv to the executor as one native batch,
        # in call order, ahead of whatever op comes next. `blocking`: a caller
        # that waits for one of them right away (dist.send / dist.recv) runs the
        # batch itself when lane 0 is idle, sparing two thread hand-offs.
        with self._p2p_lock:
            batch, self._p2p_pending = self._p2p_pending, []
            if not batch:
                return
            timeout_s = self._timeout_s

            def run():
                hosts = [(op.is_send, _host(op.tensor), op.peer, op.tag) for op in batch]
                self._comm.p2p_batch(hosts, timeout_s=timeout_s)
                for op, (_, host, _, _) in zip(batch, hosts):
                    if not op.is_send:
                        _copy_back(op.tensor, host)

            outputs = [op.tensor for op in batch]
            run = _guarded_by(outputs, [op.layout for op in batch], run)
            events = [op.event for op in batch if op.event is not None]
            for event in events:
                run = _recorded(event, run)
            carrier = PcclWork(outputs)
            carrier.get_future().add_done_callback(lambda fut: _settle(batch, fut))
            # While a profiler runs, ops end on the executor's thread (see _submit).
            inline = blocking and not events
            if not inline:
                self._executors[0].submit(run, carrier, inline=False)
                return
        # Outside the lock, so that other threads can queue sends meanwhile; the
        # executor still runs it only if nothing is queued ahead of it on lane 0.
        self._executors[0].submit(run, carrier, inline=True)

    def barrier(self, opts=None) -> PcclWork:
        """Completes once every rank has called it; mirrors ``dist.barrier``.

        Like gloo's, it first waits for every op this rank issued before it,
        on every lane (an error of those ops is theirs, not the barrier's).
        """
        opts = c10d.BarrierOptions() if opts is None else opts
        timeout_s = self._op_timeout(opts)
        self._flush_p2p()
        earlier = self._markers(range(len(self._executors))) if len(self._executors) > 1 else []

        def run():
            for marker in earlier:
                marker.get_future().wait()
            self._comm.barrier(timeout_s=timeout_s)

        return self._submit(run, [], opts, event=("barrier", []))

    # -- internals ---------------------------------------------------------

    def _submit(self, fn: Callable[[], None], outputs: list[torch.Tensor], opts,
                inputs: Sequence[torch.Tensor] = (),
                event: tuple[str, Sequence[torch.Tensor]] = ("", ())) -> PcclWork:
        # event: the op's profiler name (after "pccl:") and the tensors whose shapes it records.
        self._flush_p2p()
        # The op keeps its tensors alive, and what they were at the call: a queued op
        # whose tensor was resized or re-pointed since fails instead of reading or
        # writing memory that may be gone. (A sparse tensor has no storage of its
        # own to check: its op replaces its indices and values at the end.)
        fn = _guarded(fn, [t for t in list(outputs) + list(inputs) if t.layout == torch.strided])
        # asyncOp=False means the caller waits right away (dist.* with
        # async_op=False): run it inline if nothing is ahead of it on its lane.
        inline = opts is not None and getattr(opts, "asyncOp", True) is False
        with self._seq_lock:
            lane = self._coll_seq % len(self._executors)
            self._coll_seq += 1
        if len(self._executors) > 1:
            fn = self._on_lane(lane, fn)
        if profiler_enabled():
            # Ended on the executor's thread, so the profiler shows the op async, as
            # it shows gloo's (which always run on a worker thread).
            fn = _recorded(record_begin(f"{BACKEND_NAME}:{event[0]}", event[1]), fn)
            inline = False
        return self._executors[lane].submit(fn, PcclWork(outputs), inline)

    def _on_lane(self, lane: int, fn: Callable[[], None]) -> Callable[[], None]:
        # Runs fn with self._comm bound to lane `lane` on whichever thread runs it.
        def run():
            self._lane_local.comm = self._lanes[lane]
            try:
                fn()
            finally:
                self._lane_local.comm = None

        return run

    def _op_timeout(self, opts) -> float:
        timeout = getattr(opts, "timeout", None)
        # Unset options carry c10d's kUnsetTimeout (-1 ms).
        if isinstance(timeout, timedelta) and timeout > timedelta(0):
            return config.as_seconds(timeout)
        return self._timeout_s

    def _check_root(self, root: int) -> int:
        if not 0 <= root < self._comm.world_size:
            raise InvalidArgumentError(
                f"root {root} is not a rank of a group of {self._comm.world_size}")
        return root

    def _check_peer(self, peer: int) -> None:
        self._check_root(peer)
        if peer == self._comm.rank:
            raise InvalidArgumentError(f"peer {peer} is this rank")

    def _check_gather_list(self, tensors: Sequence[torch.Tensor], single: torch.Tensor,
                           name: str) -> None:
        _check_tensor(single, "tensor")
        n = self._comm.world_size
        if len(tensors) != n:
            raise InvalidArgumentError(f"{name} needs {n} tensors, got {len(tensors)}")
        for i, t in enumerate(tensors):
            _check_tensor(t, f"{name}[{i}]")
            if t.dtype != single.dtype or t.numel() != single.numel():
                raise InvalidArgumentError(
                    f"{name}[{i}] is {t.dtype} with {t.numel()} elements, "
                    f"expected {single.dtype} with {single.numel()}")

    def _check_pairs(self, outputs: Sequence[torch.Tensor],
                     inputs: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if len(outputs) != len(inputs):
            raise InvalidArgumentError(f"{len(outputs)} outputs for {len(inputs)} inputs")
        for i, (out, inp) in enumerate(zip(outputs, inputs)):
            _check_tensor(out, f"outputs[{i}]")
            _check_tensor(inp, f"inputs[{i}]")
        return list(zip(outputs, inputs))

    def _gather_into_list(self, inp: torch.Tensor, outputs: Sequence[torch.Tensor],
                          timeout_s: float) -> None:
        host_in = _host(inp)
        gathered = torch.empty(self._comm.world_size * inp.numel(), dtype=inp.dtype)
        self._comm.all_gather(host_in, gathered, timeout_s=timeout_s)
        for out, part in zip(outputs, gathered.split(inp.numel())):
            out.copy_(part.view(out.shape))


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


def _reduce_op(opts) -> dist.ReduceOp.RedOpType:
    # Checked now, so an unsupported op raises on the caller's thread.
    op = opts.reduceOp.op
    op_code(op)
    return op


def _check_scaled(big: torch.Tensor, small: torch.Tensor, factor: int | None, big_name: str,
                  small_name: str) -> None:
    """Raises InvalidArgumentError unless both have one dtype and ``big`` holds ``factor`` times
    ``small``'s elements (``factor`` None: any count). At call time: see the module docstring."""
    if big.dtype != small.dtype:
        raise InvalidArgumentError(f"{big_name} is {big.dtype} but {small_name} is {small.dtype}")
    if factor is not None and big.numel() != factor * small.numel():
        raise InvalidArgumentError(
            f"{big_name} has {big.numel()} elements, need world_size * {small_name} = "
            f"{factor} * {small.numel()}")


def _single(tensors: Sequence, name: str):
    # One process drives one device: c10d's multi-device lists are not supported.
    if len(tensors) != 1:
        raise InvalidArgumentError(
            f"{name} must hold exactly one entry (one device per process), got {len(tensors)}")
    return tensors[0]


def _check_tensor(tensor: torch.Tensor, name: str) -> None:
    # CUDA tensors are staged through host memory (_host / _copy_back).
    check_tensor(tensor, name, cpu_only=False)


def _settle(batch: list[_P2POp], fut: torch.futures.Future) -> None:
    # Resolves each send/recv Work of a batch from the batch's outcome.
    try:
        fut.wait()
    except BaseException as exc:  # noqa: BLE001 - handed to every waiter of the batch
        for op in batch:
            op.work.set_exception(exc)
    else:
        for op in batch:
            op.work.set_result()


def _host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.device.type == "cpu" else tensor.detach().to("cpu")


def _copy_back(tensor: torch.Tensor, host: torch.Tensor) -> None:
    if host is not tensor:
        tensor.copy_(host)


def _offsets(counts: Sequence[int]) -> list[int]:
    offsets, total = [], 0
    for c in counts:
        offsets.append(total)
        total += c
    return offsets


def _row_splits(tensor: torch.Tensor, split_sizes: Sequence[int], n: int,
                name: str) -> tuple[list[int], list[int]]:
    """Turns row split sizes along dim 0 into element counts and displacements."""
    rows = tensor.shape[0] if tensor.dim() > 0 else 1
    row_elems = tensor.numel() // rows if rows else 0
    if not split_sizes:
        if rows % n:
            raise InvalidArgumentError(
                f"{name} has {rows} rows, not divisible by world size {n}")
        split_sizes = [rows // n] * n
    if len(split_sizes) != n or sum(split_sizes) != rows or min(split_sizes) < 0:
        raise InvalidArgumentError(
            f"{name} split sizes {list(split_sizes)} must be {n} non-negative values "
            f"summing to {rows} rows")
    counts = [s * row_elems for s in split_sizes]
    return counts, _offsets(counts)
