// What the C entry points share (api_comm.cpp, api_config.cpp, api_coll.cpp,
// api_p2p.cpp): argument checks that name the bad value, and run_locked, the
// frame of every operation on a connected communicator. A caller's mistake is
// reported through the thread error only; a failed operation also leaves its
// detail on the communicator for pcclCommGetLastError.
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>
#include <mutex>

#include "comm.hpp"
#include "dtype.hpp"
#include "error.hpp"
#include "schedule.hpp"
#include "socket.hpp"

#define PCCL_CHECK(expr)                              \
    do {                                              \
        pcclResult_t rc_ = (expr);                    \
        if (rc_ != pcclSuccess) return rc_;           \
    } while (0)

#define PCCL_REQUIRE(cond, ...)                                             \
    do {                                                                    \
        if (!(cond)) return ::pccl::failf(pcclInvalidArgument, __VA_ARGS__); \
    } while (0)

// Every timeout_ms is a C int, bounded by the type alone (checked > 0 by run_locked).
static_assert(PCCL_MAX_TIMEOUT_MS == INT_MAX, "pccl.h's PCCL_MAX_TIMEOUT_MS is the largest int");

namespace pccl {

inline pcclResult_t check_type(pcclDataType_t dtype) {
    if (type_size(dtype) == 0) return failf(pcclInvalidArgument, "invalid dtype %d", int(dtype));
    return pcclSuccess;
}

inline pcclResult_t check_op(pcclRedOp_t op) {
    if (op < 0 || op >= pcclNumOps) return failf(pcclInvalidArgument, "invalid reduce op %d", int(op));
    return pcclSuccess;
}

// count * size * mult without overflow; pcclInvalidArgument if it would not fit.
inline pcclResult_t byte_size(uint64_t count, pcclDataType_t dtype, uint64_t mult, size_t *out) {
    uint64_t es = type_size(dtype);
    if (mult == 0 || count > (uint64_t(SIZE_MAX) / es) / mult)
        return failf(pcclInvalidArgument, "%llu elements overflow the address space",
                     (unsigned long long)count);
    *out = size_t(count * es * mult);
    return pcclSuccess;
}

// Runs `body(deadline_ms)` under the communicator's op lock once the communicator
// is usable, and records a failure's detail on the communicator. The timeout is
// checked here, after the caller's own argument checks, so that the first bad
// argument is the one reported.
template <typename Body>
pcclResult_t run_locked(pcclComm *comm, int timeout_ms, Body body) {
    if (timeout_ms <= 0) return failf(pcclInvalidArgument, "timeout_ms must be > 0, got %d", timeout_ms);
    std::lock_guard<std::mutex> g(comm->op_mutex);
    pcclResult_t rc = check_ready(comm);
    comm->op_timeout_ms = timeout_ms;
    if (rc == pcclSuccess) rc = body(net::now_ms() + timeout_ms);
    if (rc != pcclSuccess) {
        std::lock_guard<std::mutex> e(comm->error_mutex);
        comm->last_error = thread_error();
    }
    return rc;
}

// The frame header fields of one operation on comm (under its op lock: reads the
// ring order, stream count and chunk size the operation runs with).
inline OpInfo op_info(pcclComm *comm, uint8_t coll, pcclDataType_t dtype, uint8_t op, uint32_t tag,
                      uint64_t seq, uint64_t count) {
    OpInfo info{coll, dtype, op, 0, tag, seq, count, comm->rank, comm->world_size, comm->chunk_bytes};
    info.ring = comm->ring.empty() ? nullptr : comm->ring.data();
    info.streams = comm->stripe;
    return info;
}

}  // namespace pccl
