// The point-to-point calls of pccl.h: send, receive (from one rank or any), and
// batches of sends and receives run in one engine pass. Each peer numbers its
// own messages both ways (p2p_sent / p2p_received), so a message is matched by
// its order, not by a collective sequence number.
#include <cstring>

#include "anysource.hpp"
#include "api.hpp"
#include "engine.hpp"

using namespace pccl;

extern "C" {

// The checks of one message to or from `peer`; `dir` ("send to", "recv from")
// starts the message that refuses the peer.
static pcclResult_t check_message(pcclComm *comm, const void *buf, uint64_t count,
                                  pcclDataType_t dtype, int peer, const char *dir, size_t *bytes) {
    PCCL_REQUIRE(comm, "comm is NULL");
    PCCL_CHECK(check_type(dtype));
    PCCL_REQUIRE(peer >= 0 && peer < comm->world_size && peer != comm->rank,
                 "%s rank %d: not another rank of this world of %d", dir, peer, comm->world_size);
    PCCL_CHECK(byte_size(count, dtype, 1, bytes));
    PCCL_REQUIRE(count == 0 || buf, "NULL buffer for %llu elements", (unsigned long long)count);
    return pcclSuccess;
}

pcclResult_t pcclSend(pcclComm_t comm, const void *buf, uint64_t count, pcclDataType_t dtype,
                      int peer, uint32_t tag, int timeout_ms) {
    clear_thread_error();
    size_t bytes = 0;
    PCCL_CHECK(check_message(comm, buf, count, dtype, peer, "send to", &bytes));
    return run_locked(comm, timeout_ms, [&](int64_t deadline) -> pcclResult_t {
        uint64_t seq = comm->p2p_sent[size_t(peer)]++;
        OpInfo info = op_info(comm, wire::kCollP2P, dtype, wire::kNoOp, tag, seq, count);
        return run_schedule(comm, p2p_send(info, peer, (const uint8_t *)buf), deadline);
    });
}

// The body of a receive from `peer` (under the op lock): staged, so `buf` is
// written only once the whole message has arrived and checked.
static pcclResult_t recv_from(pcclComm *comm, void *buf, uint64_t count, pcclDataType_t dtype,
                              int peer, uint32_t tag, size_t bytes, int64_t deadline) {
    uint64_t seq = comm->p2p_received[size_t(peer)]++;
    uint8_t *work = staging(comm, bytes);
    if (!work) return pcclOutOfMemory;
    OpInfo info = op_info(comm, wire::kCollP2P, dtype, wire::kNoOp, tag, seq, count);
    PCCL_CHECK(run_schedule(comm, p2p_recv(info, peer, work), deadline));
    if (bytes) std::memcpy(buf, work, bytes);
    return pcclSuccess;
}

pcclResult_t pcclRecv(pcclComm_t comm, void *buf, uint64_t count, pcclDataType_t dtype, int peer,
                      uint32_t tag, int timeout_ms) {
    clear_thread_error();
    size_t bytes = 0;
    PCCL_CHECK(check_message(comm, buf, count, dtype, peer, "recv from", &bytes));
    return run_locked(comm, timeout_ms, [&](int64_t deadline) -> pcclResult_t {
        return recv_from(comm, buf, count, dtype, peer, tag, bytes, deadline);
    });
}

pcclResult_t pcclRecvAnySource(pcclComm_t comm, void *buf, uint64_t count, pcclDataType_t dtype,
                               uint32_t tag, int timeout_ms, int *src) {
    clear_thread_error();
    PCCL_REQUIRE(comm, "comm is NULL");
    PCCL_REQUIRE(src, "src is NULL");
    PCCL_CHECK(check_type(dtype));
    PCCL_REQUIRE(comm->world_size > 1, "recv from any source in a world of 1: no other rank");
    size_t bytes = 0;
    PCCL_CHECK(byte_size(count, dtype, 1, &bytes));
    PCCL_REQUIRE(count == 0 || buf, "NULL buffer for %llu elements", (unsigned long long)count);
    return run_locked(comm, timeout_ms, [&](int64_t deadline) -> pcclResult_t {
        int peer = -1;
        PCCL_CHECK(wait_any_p2p(comm, tag, deadline, &peer));
        PCCL_CHECK(recv_from(comm, buf, count, dtype, peer, tag, bytes, deadline));
        *src = peer;
        return pcclSuccess;
    });
}

// Receives of a staged batch land in the communicator's staging buffer and are
// copied out only once every op succeeded; unstaged ones land in place.
static pcclResult_t p2p_batch(pcclComm_t comm, const pcclP2POp_t *ops, int nops, int timeout_ms,
                              bool staged_receives) {
    clear_thread_error();
    PCCL_REQUIRE(comm, "comm is NULL");
    PCCL_REQUIRE(nops >= 0 && (nops == 0 || ops), "bad op list (%d ops)", nops);
    size_t staged = 0;
    for (int i = 0; i < nops; ++i) {
        const pcclP2POp_t &op = ops[i];
        PCCL_CHECK(check_type(op.dtype));
        PCCL_REQUIRE(op.peer >= 0 && op.peer < comm->world_size && op.peer != comm->rank,
                     "op %d: rank %d is not another rank of this world of %d", i, op.peer,
                     comm->world_size);
        size_t bytes = 0;
        PCCL_CHECK(byte_size(op.count, op.dtype, 1, &bytes));
        PCCL_REQUIRE(op.count == 0 || op.buf, "op %d: NULL buffer", i);
        if (!op.is_send && staged_receives) {
            PCCL_REQUIRE(staged <= SIZE_MAX - bytes, "receives overflow the address space");
            staged += bytes;
        }
    }
    return run_locked(comm, timeout_ms, [&](int64_t deadline) -> pcclResult_t {
        uint8_t *work = nullptr;
        if (staged_receives && !(work = staging(comm, staged))) return pcclOutOfMemory;
        Schedule all;
        all.watch_all = false;
        size_t off = 0;
        for (int i = 0; i < nops; ++i) {
            const pcclP2POp_t &op = ops[i];
            auto &counter = op.is_send ? comm->p2p_sent : comm->p2p_received;
            OpInfo info = op_info(comm, wire::kCollP2P, op.dtype, wire::kNoOp, op.tag,
                                  counter[size_t(op.peer)]++, op.count);
            if (op.is_send) {
                append(all, p2p_send(info, op.peer, (const uint8_t *)op.buf));
            } else if (staged_receives) {
                append(all, p2p_recv(info, op.peer, work + off));
                off += size_t(op.count) * type_size(op.dtype);
            } else {
                append(all, p2p_recv(info, op.peer, (uint8_t *)op.buf));
            }
        }
        PCCL_CHECK(run_schedule(comm, all, deadline));
        if (!staged_receives) return pcclSuccess;
        off = 0;
        for (int i = 0; i < nops; ++i) {
            if (ops[i].is_send) continue;
            size_t bytes = size_t(ops[i].count) * type_size(ops[i].dtype);
            if (bytes) std::memcpy(ops[i].buf, work + off, bytes);
            off += bytes;
        }
        return pcclSuccess;
    });
}

pcclResult_t pcclP2PBatch(pcclComm_t comm, const pcclP2POp_t *ops, int nops, int timeout_ms) {
    return p2p_batch(comm, ops, nops, timeout_ms, true);
}

pcclResult_t pcclTransferBatch(pcclComm_t comm, const pcclP2POp_t *ops, int nops,
                               int timeout_ms) {
    return p2p_batch(comm, ops, nops, timeout_ms, false);
}

}  // extern "C"
