// The collectives of pccl.h. Each entry point describes its call as a CollSpec
// and run_collective does the rest in one place: the argument checks (in the
// order, and with the messages, each collective has always had), the op lock,
// the sequence number, the world-size-1 shortcut, staging, the schedule, and the
// single copy of the finished result into the caller's buffer (a failed
// collective never writes it).
#include <cstring>

#include "api.hpp"
#include "engine.hpp"
#include "quantize.hpp"

using namespace pccl;

namespace {

enum class Kind { AllReduce, Quantized, Broadcast, AllGather, ReduceScatter, AllToAllv, Barrier };

// One collective call as its entry point received it. Buffers and counts are the
// caller's; nothing here is owned.
struct CollSpec {
    Kind kind;
    const void *sendbuf = nullptr;
    void *recvbuf = nullptr;           // broadcast: the same buffer as sendbuf
    uint64_t count = 0;                // elements per rank (all-gather, reduce-scatter: per slice)
    pcclDataType_t dtype = pcclUInt8;
    pcclRedOp_t op = pcclSum;          // reducing kinds only
    uint32_t tag = 0;
    int timeout_ms = 0;
    int root = 0;                      // broadcast
    pcclQuantType_t qtype = pcclQuantInt8;  // quantized all-reduce
    uint32_t block = 0;
    // All-to-all-v, in elements, world size entries each.
    const uint64_t *scounts = nullptr, *sdispls = nullptr, *rcounts = nullptr, *rdispls = nullptr;
};

CollSpec spec(Kind kind, const void *sendbuf, void *recvbuf, uint64_t count, pcclDataType_t dtype,
              uint32_t tag, int timeout_ms) {
    CollSpec s{kind};
    s.sendbuf = sendbuf;
    s.recvbuf = recvbuf;
    s.count = count;
    s.dtype = dtype;
    s.tag = tag;
    s.timeout_ms = timeout_ms;
    return s;
}

// What the checks worked out, in bytes.
struct Sizes {
    size_t mine = 0;     // this rank's slice of input or output
    size_t staging = 0;  // the memory the exchange lands in
};

pcclResult_t check_buffers(const CollSpec &s) {
    PCCL_REQUIRE(s.count == 0 || (s.sendbuf && s.recvbuf), "NULL buffer for %llu elements",
                 (unsigned long long)s.count);
    return pcclSuccess;
}

pcclResult_t check_quantized(const CollSpec &s) {
    PCCL_REQUIRE(s.dtype == pcclFloat32 || s.dtype == pcclFloat16 || s.dtype == pcclBFloat16,
                 "quantized all-reduce takes float32, float16 or bfloat16, got dtype %d", int(s.dtype));
    PCCL_REQUIRE(s.op == pcclSum || s.op == pcclAvg, "quantized all-reduce takes sum or avg, got op %d",
                 int(s.op));
    PCCL_REQUIRE(s.qtype == pcclQuantInt8 || s.qtype == pcclQuantInt4, "invalid quantization type %d",
                 int(s.qtype));
    PCCL_REQUIRE(s.block >= 1 && s.block <= PCCL_MAX_QUANT_BLOCK,
                 "block must be in [1, %d], got %u", PCCL_MAX_QUANT_BLOCK, s.block);
    // Keeps the plan's staging size (at most ~15 bytes per element plus
    // 10 * block * world size) far from overflow; a too large allocation then
    // fails cleanly with pcclOutOfMemory.
    size_t bytes = 0;
    PCCL_CHECK(byte_size(s.count, pcclFloat64, 3, &bytes));
    return check_buffers(s);
}

pcclResult_t check_alltoallv(const pcclComm *comm, const CollSpec &s, Sizes *sz) {
    PCCL_CHECK(check_type(s.dtype));
    PCCL_REQUIRE(s.scounts && s.sdispls && s.rcounts && s.rdispls, "NULL count or displacement array");
    const int me = comm->rank;
    uint64_t recv_end = 0, send_total = 0;
    for (int p = 0; p < comm->world_size; ++p) {
        size_t b;
        PCCL_REQUIRE(s.rdispls[p] <= UINT64_MAX - s.rcounts[p] && s.sdispls[p] <= UINT64_MAX - s.scounts[p],
                     "count + displacement overflows for rank %d", p);
        PCCL_CHECK(byte_size(s.rdispls[p] + s.rcounts[p], s.dtype, 1, &b));
        PCCL_CHECK(byte_size(s.sdispls[p] + s.scounts[p], s.dtype, 1, &b));
        if (s.rdispls[p] + s.rcounts[p] > recv_end) recv_end = s.rdispls[p] + s.rcounts[p];
        send_total += s.scounts[p];
    }
    PCCL_REQUIRE(s.scounts[me] == s.rcounts[me], "this rank sends itself %llu elements but expects %llu",
                 (unsigned long long)s.scounts[me], (unsigned long long)s.rcounts[me]);
    PCCL_REQUIRE((send_total == 0 || s.sendbuf) && (recv_end == 0 || s.recvbuf), "NULL buffer");
    sz->staging = size_t(recv_end) * type_size(s.dtype);
    return pcclSuccess;
}

// The caller's mistakes, each collective's checks in its own order; fills *sz.
pcclResult_t check_spec(const pcclComm *comm, const CollSpec &s, Sizes *sz) {
    const uint64_t world = uint64_t(comm->world_size);
    switch (s.kind) {
    case Kind::AllReduce:
    case Kind::ReduceScatter:
    case Kind::AllGather:
        PCCL_CHECK(check_type(s.dtype));
        if (s.kind != Kind::AllGather) PCCL_CHECK(check_op(s.op));
        PCCL_CHECK(byte_size(s.count, s.dtype, 1, &sz->mine));
        sz->staging = sz->mine;
        if (s.kind != Kind::AllReduce) PCCL_CHECK(byte_size(s.count, s.dtype, world, &sz->staging));
        return check_buffers(s);
    case Kind::Quantized:
        return check_quantized(s);
    case Kind::Broadcast:
        PCCL_CHECK(check_type(s.dtype));
        PCCL_REQUIRE(s.root >= 0 && s.root < comm->world_size && s.root <= 0xFFFF,
                     "root %d out of range for world size %d", s.root, comm->world_size);
        PCCL_CHECK(byte_size(s.count, s.dtype, 1, &sz->mine));
        sz->staging = sz->mine;
        return check_buffers(s);
    case Kind::AllToAllv:
        return check_alltoallv(comm, s, sz);
    case Kind::Barrier:
        sz->staging = size_t(comm->world_size);
        return pcclSuccess;
    }
    return failf(pcclInvalidArgument, "unknown collective %d", int(s.kind));
}

uint8_t coll_of(const CollSpec &s) {
    switch (s.kind) {
    case Kind::AllReduce: return wire::kCollAllReduce;
    case Kind::Quantized: return quant::coll_of(s.qtype);
    case Kind::Broadcast: return wire::kCollBroadcast;
    case Kind::AllGather: return wire::kCollAllGather;
    case Kind::ReduceScatter: return wire::kCollReduceScatter;
    case Kind::AllToAllv: return wire::kCollAllToAll;
    case Kind::Barrier: break;
    }
    return wire::kCollBarrier;
}

// What every frame header of the op carries.
OpInfo header(pcclComm *comm, const CollSpec &s, uint64_t seq) {
    bool reduces = s.kind == Kind::AllReduce || s.kind == Kind::ReduceScatter || s.kind == Kind::Quantized;
    uint64_t count = s.kind == Kind::AllToAllv ? 0 : s.count;  // its counts differ per peer
    OpInfo info = op_info(comm, coll_of(s), s.dtype, reduces ? uint8_t(s.op) : wire::kNoOp, s.tag, seq, count);
    if (s.kind == Kind::Broadcast) info.root = uint16_t(s.root);
    if (s.kind == Kind::Quantized) info.root = uint16_t(s.block);  // the block travels in the root field
    return info;
}

Schedule schedule_of(const CollSpec &s, const OpInfo &info, uint8_t *work) {
    const uint8_t *in = (const uint8_t *)s.sendbuf;
    switch (s.kind) {
    case Kind::AllReduce: return ring_allreduce(info, in, work);
    case Kind::Broadcast: return chain_broadcast(info, s.root, in, work);
    case Kind::ReduceScatter: return ring_reduce_scatter(info, in, work);
    case Kind::AllToAllv:
        return pairwise_alltoallv(info, in, s.scounts, s.sdispls, work, s.rcounts, s.rdispls);
    case Kind::AllGather:
    case Kind::Barrier:  // an all-gather of one byte: a rank leaves once every other rank entered
    case Kind::Quantized:  // not reached: two phases, see run_quantized
        break;
    }
    return ring_allgather(info, in, work);
}

// A world of one: the result is the input, where the collective has one. Also
// all-to-all-v's own slice in any world, which is copied, never sent.
void copy_local(const CollSpec &s, const Sizes &sz, int rank) {
    switch (s.kind) {
    case Kind::AllReduce:
    case Kind::ReduceScatter:
    case Kind::AllGather:
        if (sz.mine && s.recvbuf != s.sendbuf) std::memmove(s.recvbuf, s.sendbuf, sz.mine);
        break;
    case Kind::AllToAllv: {
        const size_t es = type_size(s.dtype);
        if (s.rcounts[rank])
            std::memmove((uint8_t *)s.recvbuf + s.rdispls[rank] * es,
                         (const uint8_t *)s.sendbuf + s.sdispls[rank] * es, s.rcounts[rank] * es);
        break;
    }
    case Kind::Broadcast:
    case Kind::Barrier:
    case Kind::Quantized:
        break;
    }
}

// The only write to the caller's output: after every byte of the exchange arrived.
void copy_out(const pcclComm *comm, const CollSpec &s, const Sizes &sz, const uint8_t *work) {
    uint8_t *out = (uint8_t *)s.recvbuf;
    const int me = comm->rank, n = comm->world_size;
    switch (s.kind) {
    case Kind::AllReduce:
        if (sz.mine) std::memcpy(out, work, sz.mine);
        break;
    case Kind::Broadcast:
        if (me != s.root && sz.mine) std::memcpy(out, work, sz.mine);
        break;
    case Kind::ReduceScatter:
        if (sz.mine) std::memcpy(out, work + size_t(me) * sz.mine, sz.mine);
        break;
    case Kind::AllGather: {
        // Own slice first: sendbuf may alias another slice of recvbuf.
        const size_t mine = size_t(me) * sz.mine;
        if (sz.mine && out + mine != s.sendbuf) std::memmove(out + mine, s.sendbuf, sz.mine);
        for (int r = 0; r < n; ++r)
            if (r != me && sz.mine) std::memcpy(out + size_t(r) * sz.mine, work + size_t(r) * sz.mine, sz.mine);
        break;
    }
    case Kind::AllToAllv: {
        // Own slice first: with sendbuf == recvbuf, later copies may overwrite it.
        copy_local(s, sz, me);
        const size_t es = type_size(s.dtype);
        for (int p = 0; p < n; ++p)
            if (p != me && s.rcounts[p])
                std::memcpy(out + s.rdispls[p] * es, work + s.rdispls[p] * es, s.rcounts[p] * es);
        break;
    }
    case Kind::Barrier:
    case Kind::Quantized:
        break;
    }
}

// The quantized all-reduce has two exchanges with the owners' reduction between
// them, and no world-size-1 shortcut: alone, a rank's result is its input
// quantized once, as it would be in any larger world.
pcclResult_t run_quantized(pcclComm *comm, const CollSpec &s, const OpInfo &info, int64_t deadline) {
    quant::AllReducePlan plan(info, s.qtype, s.block);
    uint8_t *work = staging(comm, plan.staging_bytes());
    if (!work) return pcclOutOfMemory;
    Schedule exchange = plan.exchange(s.sendbuf, work);
    if (comm->world_size > 1) PCCL_CHECK(run_schedule(comm, exchange, deadline));
    Schedule share = plan.reduce_and_share(s.sendbuf, work);
    if (comm->world_size > 1) PCCL_CHECK(run_schedule(comm, share, deadline));
    plan.decode_result(work, s.recvbuf);  // the only write to recvbuf, after every byte arrived
    return pcclSuccess;
}

// Checks, then runs the collective under the op lock (see the file comment).
pcclResult_t run_collective(pcclComm *comm, const CollSpec &s) {
    clear_thread_error();
    PCCL_REQUIRE(comm, "comm is NULL");
    Sizes sz;
    PCCL_CHECK(check_spec(comm, s, &sz));
    return run_locked(comm, s.timeout_ms, [&](int64_t deadline) -> pcclResult_t {
        // Numbered even at world size 1, so that every rank's count stays the number of calls.
        const uint64_t seq = comm->coll_seq++;
        if (s.kind == Kind::Quantized) return run_quantized(comm, s, header(comm, s, seq), deadline);
        if (comm->world_size == 1) {
            copy_local(s, sz, comm->rank);
            return pcclSuccess;
        }
        uint8_t *work = nullptr;
        bool stages = s.kind != Kind::Broadcast || comm->rank != s.root;  // the root sends its own buffer
        if (stages && !(work = staging(comm, sz.staging))) return pcclOutOfMemory;
        PCCL_CHECK(run_schedule(comm, schedule_of(s, header(comm, s, seq), work), deadline));
        copy_out(comm, s, sz, work);
        return pcclSuccess;
    });
}

}  // namespace

extern "C" {

pcclResult_t pcclAllReduce(pcclComm_t comm, const void *sendbuf, void *recvbuf, uint64_t count,
                           pcclDataType_t dtype, pcclRedOp_t op, uint32_t tag, int timeout_ms) {
    CollSpec s = spec(Kind::AllReduce, sendbuf, recvbuf, count, dtype, tag, timeout_ms);
    s.op = op;
    return run_collective(comm, s);
}

pcclResult_t pcclAllReduceQuantized(pcclComm_t comm, const void *sendbuf, void *recvbuf,
                                    uint64_t count, pcclDataType_t dtype, pcclRedOp_t op,
                                    pcclQuantType_t qtype, uint32_t block, uint32_t tag,
                                    int timeout_ms) {
    CollSpec s = spec(Kind::Quantized, sendbuf, recvbuf, count, dtype, tag, timeout_ms);
    s.op = op;
    s.qtype = qtype;
    s.block = block;
    return run_collective(comm, s);
}

pcclResult_t pcclBroadcast(pcclComm_t comm, void *buf, uint64_t count, pcclDataType_t dtype,
                           int root, uint32_t tag, int timeout_ms) {
    CollSpec s = spec(Kind::Broadcast, buf, buf, count, dtype, tag, timeout_ms);
    s.root = root;
    return run_collective(comm, s);
}

pcclResult_t pcclAllGather(pcclComm_t comm, const void *sendbuf, void *recvbuf, uint64_t count,
                           pcclDataType_t dtype, uint32_t tag, int timeout_ms) {
    return run_collective(comm, spec(Kind::AllGather, sendbuf, recvbuf, count, dtype, tag, timeout_ms));
}

pcclResult_t pcclReduceScatter(pcclComm_t comm, const void *sendbuf, void *recvbuf,
                               uint64_t count, pcclDataType_t dtype, pcclRedOp_t op,
                               uint32_t tag, int timeout_ms) {
    CollSpec s = spec(Kind::ReduceScatter, sendbuf, recvbuf, count, dtype, tag, timeout_ms);
    s.op = op;
    return run_collective(comm, s);
}

pcclResult_t pcclAllToAllv(pcclComm_t comm, const void *sendbuf, const uint64_t *scounts,
                           const uint64_t *sdispls, void *recvbuf, const uint64_t *rcounts,
                           const uint64_t *rdispls, pcclDataType_t dtype, uint32_t tag,
                           int timeout_ms) {
    CollSpec s = spec(Kind::AllToAllv, sendbuf, recvbuf, 0, dtype, tag, timeout_ms);
    s.scounts = scounts;
    s.sdispls = sdispls;
    s.rcounts = rcounts;
    s.rdispls = rdispls;
    return run_collective(comm, s);
}

pcclResult_t pcclBarrier(pcclComm_t comm, uint32_t tag, int timeout_ms) {
    static const uint8_t kPresent = 1;  // the byte every rank contributes
    return run_collective(comm, spec(Kind::Barrier, &kPresent, nullptr, 1, pcclUInt8, tag, timeout_ms));
}

}  // extern "C"
