// The C entry points of pccl.h: argument checks (caller errors are never
// sticky), the per-communicator lock, schedule + engine, and the single copy of
// a finished result into the caller's buffer (a failed op never writes it).
#include <sys/eventfd.h>
#include <unistd.h>

#include <climits>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "anysource.hpp"
#include "auth.hpp"
#include "comm.hpp"
#include "dtype.hpp"
#include "engine.hpp"
#include "error.hpp"
#include "handshake.hpp"
#include "quantize.hpp"
#include "schedule.hpp"
#include "socket.hpp"

using namespace pccl;

namespace {

constexpr uint64_t kMinChunk = 4096;
constexpr int64_t kMaxPacing = int64_t(1) << 40;  // bytes/s: ~8.8 Tbit/s, beyond any NIC
constexpr uint64_t kMaxChunk = 256ull << 20;

// Every timeout_ms is a C int, bounded by the type alone (checked > 0 below).
static_assert(PCCL_MAX_TIMEOUT_MS == INT_MAX, "pccl.h's PCCL_MAX_TIMEOUT_MS is the largest int");

pcclResult_t check_type(pcclDataType_t dtype) {
    if (type_size(dtype) == 0) return failf(pcclInvalidArgument, "invalid dtype %d", int(dtype));
    return pcclSuccess;
}

pcclResult_t check_op(pcclRedOp_t op) {
    if (op < 0 || op >= pcclNumOps) return failf(pcclInvalidArgument, "invalid reduce op %d", int(op));
    return pcclSuccess;
}

// count * size without overflow; pcclInvalidArgument if it would not fit.
pcclResult_t byte_size(uint64_t count, pcclDataType_t dtype, uint64_t mult, size_t *out) {
    uint64_t es = type_size(dtype);
    if (mult == 0 || count > (uint64_t(SIZE_MAX) / es) / mult)
        return failf(pcclInvalidArgument, "%llu elements overflow the address space",
                     (unsigned long long)count);
    *out = size_t(count * es * mult);
    return pcclSuccess;
}

// Runs `body(deadline)` under the communicator's lock once the communicator is
// usable; records the failure detail on the communicator.
template <typename Body>
pcclResult_t collective(pcclComm *comm, int timeout_ms, Body body) {
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

OpInfo op_info(pcclComm *comm, uint8_t coll, pcclDataType_t dtype, uint8_t op, uint32_t tag,
               uint64_t seq, uint64_t count) {
    OpInfo info{coll, dtype, op, 0, tag, seq, count, comm->rank, comm->world_size, comm->chunk_bytes};
    info.ring = comm->ring.empty() ? nullptr : comm->ring.data();
    info.streams = comm->streams;
    return info;
}

#define PCCL_CHECK(expr)                              \
    do {                                              \
        pcclResult_t rc_ = (expr);                    \
        if (rc_ != pcclSuccess) return rc_;           \
    } while (0)

#define PCCL_REQUIRE(cond, ...)                                       \
    do {                                                              \
        if (!(cond)) return failf(pcclInvalidArgument, __VA_ARGS__);  \
    } while (0)

// The part of communicator creation shared by both constructors: everything but
// the listener.
pcclResult_t new_comm(pcclComm_t *out, int rank, int world_size, uint64_t comm_id) {
    PCCL_REQUIRE(out, "comm output pointer is NULL");
    *out = nullptr;
    PCCL_REQUIRE(world_size >= 1, "world_size must be >= 1, got %d", world_size);
    PCCL_REQUIRE(rank >= 0 && rank < world_size, "rank %d out of range for world size %d", rank,
                 world_size);
    pcclComm *comm = new (std::nothrow) pcclComm;
    if (!comm) return fail(pcclOutOfMemory, "cannot allocate a communicator");
    comm->rank = rank;
    comm->world_size = world_size;
    comm->comm_id = comm_id;
    comm->links.resize(size_t(world_size));  // one stream each until connect_all
    comm->p2p_sent.assign(size_t(world_size), 0);
    comm->p2p_received.assign(size_t(world_size), 0);
    comm->items_sent.assign(size_t(world_size), 0);
    comm->items_received.assign(size_t(world_size), 0);
    try {
        comm->pacing = std::make_shared<pccl::Pacing>(world_size);
    } catch (const std::bad_alloc &) {
        destroy(comm);
        return fail(pcclOutOfMemory, "cannot allocate a communicator");
    }
    comm->abort_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (comm->abort_fd < 0) {
        pcclResult_t rc = fail(pcclSystemError, syscall_error("eventfd()", errno, ""));
        destroy(comm);
        return rc;
    }
    *out = comm;
    return pcclSuccess;
}

}  // namespace

extern "C" {

size_t pcclTypeSize(pcclDataType_t dtype) { return type_size(dtype); }

pcclResult_t pcclCommCreate(pcclComm_t *out, int rank, int world_size, uint64_t comm_id,
                            const char *listen_host) {
    clear_thread_error();
    PCCL_CHECK(new_comm(out, rank, world_size, comm_id));
    pcclComm *comm = *out;
    pcclResult_t rc = net::listen_on(listen_host, 0, &comm->listen_fd, &comm->port);
    if (rc != pcclSuccess) {
        destroy(comm);
        *out = nullptr;
    }
    return rc;
}

pcclResult_t pcclCommCreateOnListener(pcclComm_t *out, int rank, int world_size,
                                      uint64_t comm_id, pcclListener_t listener) {
    clear_thread_error();
    PCCL_REQUIRE(listener && listener->fd >= 0, "listener is NULL or closed");
    PCCL_CHECK(new_comm(out, rank, world_size, comm_id));
    (*out)->listen_fd = listener->fd;
    (*out)->port = listener->port;
    (*out)->owns_listener = false;
    return pcclSuccess;
}

pcclResult_t pcclListenerCreate(pcclListener_t *out, const char *host, int port) {
    clear_thread_error();
    PCCL_REQUIRE(out, "listener output pointer is NULL");
    *out = nullptr;
    pcclListener *l = new (std::nothrow) pcclListener;
    if (!l) return fail(pcclOutOfMemory, "cannot allocate a listener");
    pcclResult_t rc = net::listen_on(host, port, &l->fd, &l->port);
    if (rc != pcclSuccess) {
        delete l;
        return rc;
    }
    *out = l;
    return pcclSuccess;
}

pcclResult_t pcclListenerGetPort(pcclListener_t listener, int *port) {
    clear_thread_error();
    PCCL_REQUIRE(listener && port, "NULL argument");
    *port = listener->port;
    return pcclSuccess;
}

pcclResult_t pcclListenerDestroy(pcclListener_t listener) {
    if (listener) {
        if (listener->fd >= 0) close(listener->fd);
        delete listener;
    }
    return pcclSuccess;
}

pcclResult_t pcclCommGetPort(pcclComm_t comm, int *port) {
    clear_thread_error();
    PCCL_REQUIRE(comm && port, "NULL argument");
    *port = comm->port;
    return pcclSuccess;
}

pcclResult_t pcclCommConnect(pcclComm_t comm, const char *const *addrs, int timeout_ms) {
    return pcclCommConnectLanes(comm, addrs, 1, nullptr, timeout_ms);
}

pcclResult_t pcclCommConnectLanes(pcclComm_t comm, const char *const *addrs, int nlanes,
                                  pcclComm_t *lanes_out, int timeout_ms) {
    clear_thread_error();
    PCCL_REQUIRE(comm && addrs, "NULL argument");
    PCCL_REQUIRE(nlanes >= 1 && nlanes <= PCCL_MAX_LANES, "nlanes must be in [1, %d], got %d",
                 PCCL_MAX_LANES, nlanes);
    PCCL_REQUIRE(nlanes == 1 || lanes_out, "lanes_out is NULL for %d lanes", nlanes);
    PCCL_REQUIRE(timeout_ms > 0, "timeout_ms must be > 0, got %d", timeout_ms);
    for (int l = 1; l < nlanes; ++l) lanes_out[l - 1] = nullptr;
    std::lock_guard<std::mutex> g(comm->op_mutex);
    if (comm->connected) return fail(pcclInvalidUsage, "communicator is already connected");
    {
        std::lock_guard<std::mutex> e(comm->error_mutex);
        if (comm->sticky != pcclSuccess) return fail(comm->sticky, comm->sticky_detail);
    }
    // Lanes 1.. share nothing with comm but rank, world size, id and tuning.
    std::vector<pcclComm *> lanes(size_t(nlanes), nullptr);
    lanes[0] = comm;
    pcclResult_t rc = pcclSuccess;
    for (int l = 1; l < nlanes && rc == pcclSuccess; ++l) {
        rc = new_comm(&lanes[size_t(l)], comm->rank, comm->world_size, comm->comm_id);
        if (rc == pcclSuccess) {
            lanes[size_t(l)]->port = comm->port;
            lanes[size_t(l)]->owns_listener = false;
            lanes[size_t(l)]->chunk_bytes = comm->chunk_bytes;
            lanes[size_t(l)]->streams = comm->streams;
            lanes[size_t(l)]->pacing = comm->pacing;  // same paths, same measurements
        }
    }
    if (rc == pcclSuccess) rc = connect_all(lanes.data(), nlanes, addrs, timeout_ms);
    // Woken by pcclCommAbortWithError: report its cause, not a bare abort.
    if (rc == pcclAborted && comm->aborted.load()) rc = abort_error(comm);
    if (rc != pcclSuccess) {
        for (int l = 1; l < nlanes; ++l)
            if (lanes[size_t(l)]) destroy(lanes[size_t(l)]);
        if (is_network_error(rc)) fail_comm(comm, rc, nullptr);
        return rc;
    }
    for (int l = 1; l < nlanes; ++l) lanes_out[l - 1] = lanes[size_t(l)];
    return pcclSuccess;
}

pcclResult_t pcclCommGetUnreachedRanks(pcclComm_t comm, int *ranks, int *n) {
    clear_thread_error();
    PCCL_REQUIRE(comm && ranks && n, "NULL argument");
    std::lock_guard<std::mutex> g(comm->op_mutex);  // not during a connect on another thread
    int count = 0;
    for (int r = 0; r < comm->world_size; ++r) {
        if (r == comm->rank) continue;
        bool up = !comm->links_up.empty() && comm->links_up[size_t(r)] >= comm->links_per_peer;
        if (!up && !comm->connected) ranks[count++] = r;
    }
    *n = count;
    return pcclSuccess;
}

pcclResult_t pcclCommAbort(pcclComm_t comm) {
    PCCL_REQUIRE(comm, "comm is NULL");
    return pcclCommAbortWithError(comm, pcclAborted, nullptr);
}

pcclResult_t pcclCommAbortWithError(pcclComm_t comm, pcclResult_t code, const char *reason) {
    clear_thread_error();
    PCCL_REQUIRE(comm, "comm is NULL");
    PCCL_REQUIRE(is_network_error(code), "abort code %d is not a network error", int(code));
    if (code != pcclAborted) {
        std::string why = reason ? std::string(reason) : std::string(pcclGetErrorString(code));
        if (why.size() > PCCL_MAX_ABORT_REASON) why.resize(PCCL_MAX_ABORT_REASON);
        std::lock_guard<std::mutex> e(comm->error_mutex);
        // Only the first cause: an op already failing keeps its own error.
        if (!comm->aborted.load() && comm->sticky == pcclSuccess) {
            comm->abort_code = code;
            comm->abort_reason = why;
            comm->sticky = code;
            comm->sticky_detail = why;
            comm->last_error = why;
        }
    }
    comm->aborted.store(true);
    uint64_t one = 1;
    // The eventfd wakes a poll() in progress on another thread at once.
    ssize_t ignored = write(comm->abort_fd, &one, sizeof(one));
    (void)ignored;
    return pcclSuccess;
}

pcclResult_t pcclCommDestroy(pcclComm_t comm) {
    if (comm) destroy(comm);
    return pcclSuccess;
}

pcclResult_t pcclCommGetInfo(pcclComm_t comm, int *rank, int *world_size) {
    clear_thread_error();
    PCCL_REQUIRE(comm && rank && world_size, "NULL argument");
    *rank = comm->rank;
    *world_size = comm->world_size;
    return pcclSuccess;
}

pcclResult_t pcclCommGetError(pcclComm_t comm) {
    if (!comm) return pcclInvalidArgument;
    std::lock_guard<std::mutex> e(comm->error_mutex);
    if (comm->sticky != pcclSuccess) return comm->sticky;
    return comm->aborted.load() ? pcclAborted : pcclSuccess;
}

const char *pcclCommGetLastError(pcclComm_t comm) {
    // A copy per calling thread: another lane's executor may replace last_error as soon as
    // error_mutex is released, so its buffer must never be handed out.
    thread_local std::string copy;
    if (!comm) return "";
    {
        std::lock_guard<std::mutex> e(comm->error_mutex);
        copy = comm->last_error;
    }
    return copy.c_str();
}

pcclResult_t pcclCommSetOption(pcclComm_t comm, const char *name, int64_t value) {
    clear_thread_error();
    PCCL_REQUIRE(comm && name, "NULL argument");
    if (std::strcmp(name, "chunk_bytes") == 0) {
        PCCL_REQUIRE(value >= int64_t(kMinChunk) && value <= int64_t(kMaxChunk),
                     "chunk_bytes must be in [%llu, %llu], got %lld", (unsigned long long)kMinChunk,
                     (unsigned long long)kMaxChunk, (long long)value);
        std::lock_guard<std::mutex> g(comm->op_mutex);
        comm->chunk_bytes = uint64_t(value);
        return pcclSuccess;
    }
    if (std::strcmp(name, "streams") == 0) {
        PCCL_REQUIRE(value >= 1 && value <= PCCL_MAX_STREAMS, "streams must be in [1, %d], got %lld",
                     PCCL_MAX_STREAMS, (long long)value);
        std::lock_guard<std::mutex> g(comm->op_mutex);
        if (comm->connected)
            return fail(pcclInvalidUsage, "streams must be set before the communicator connects");
        comm->streams = int(value);
        return pcclSuccess;
    }
    if (std::strcmp(name, "link_timeout_ms") == 0) {
        PCCL_REQUIRE(value >= 1000 && value <= 3600000,
                     "link_timeout_ms must be in [1000, 3600000], got %lld", (long long)value);
        std::lock_guard<std::mutex> g(comm->op_mutex);
        if (comm->connected)
            return fail(pcclInvalidUsage, "link_timeout_ms must be set before connecting");
        comm->link_timeout_ms = int(value);
        return pcclSuccess;
    }
    if (std::strcmp(name, "pacing") == 0) {
        PCCL_REQUIRE(value >= -1 && value <= kMaxPacing,
                     "pacing must be -1 (measured), 0 (off) or bytes/s up to %lld, got %lld",
                     (long long)kMaxPacing, (long long)value);
        std::lock_guard<std::mutex> g(comm->pacing->mutex);
        comm->pacing->mode = value;
        return pcclSuccess;
    }
    return failf(pcclInvalidArgument, "unknown option '%s'", name);
}

pcclResult_t pcclCommSetSecret(pcclComm_t comm, const uint8_t *secret, size_t len) {
    clear_thread_error();
    PCCL_REQUIRE(comm && (secret || len == 0), "NULL argument");
    PCCL_REQUIRE(len <= auth::kMaxSecret, "a secret is at most %zu bytes, got %zu",
                 auth::kMaxSecret, len);
    std::lock_guard<std::mutex> g(comm->op_mutex);
    if (comm->connected) return fail(pcclInvalidUsage, "the secret must be set before connecting");
    comm->secret.assign(secret, secret + len);
    return pcclSuccess;
}

pcclResult_t pcclCommGetPacing(pcclComm_t comm, int peer, double *estimate, double *cap) {
    clear_thread_error();
    PCCL_REQUIRE(comm && estimate && cap, "NULL argument");
    PCCL_REQUIRE(peer >= 0 && peer < comm->world_size, "peer %d out of range for world size %d",
                 peer, comm->world_size);
    std::lock_guard<std::mutex> g(comm->pacing->mutex);
    *estimate = comm->pacing->estimate[size_t(peer)];
    *cap = comm->streams > 1 ? peer_cap(comm->pacing->mode, *estimate) : 0.0;
    return pcclSuccess;
}

pcclResult_t pcclCommSetRingOrder(pcclComm_t comm, const int *order, int n) {
    clear_thread_error();
    PCCL_REQUIRE(comm && order, "NULL argument");
    PCCL_REQUIRE(n == comm->world_size, "the ring order has %d entries, the world %d", n,
                 comm->world_size);
    std::vector<char> seen(size_t(n), 0);
    bool identity = true;
    for (int p = 0; p < n; ++p) {
        PCCL_REQUIRE(order[p] >= 0 && order[p] < n && !seen[size_t(order[p])],
                     "the ring order is not a permutation of 0 .. %d (entry %d is %d)", n - 1, p,
                     order[p]);
        seen[size_t(order[p])] = 1;
        identity = identity && order[p] == p;
    }
    std::lock_guard<std::mutex> g(comm->op_mutex);
    if (identity)
        comm->ring.clear();
    else
        comm->ring.assign(order, order + n);
    return pcclSuccess;
}

pcclResult_t pcclCommGetRingOrder(pcclComm_t comm, int *order) {
    clear_thread_error();
    PCCL_REQUIRE(comm && order, "NULL argument");
    std::lock_guard<std::mutex> g(comm->op_mutex);
    for (int p = 0; p < comm->world_size; ++p)
        order[p] = comm->ring.empty() ? p : comm->ring[size_t(p)];
    return pcclSuccess;
}

pcclResult_t pcclCommGetStats(pcclComm_t comm, uint64_t *bytes_sent, uint64_t *bytes_received) {
    clear_thread_error();
    PCCL_REQUIRE(comm && bytes_sent && bytes_received, "NULL argument");
    *bytes_sent = comm->bytes_sent.load();
    *bytes_received = comm->bytes_received.load();
    return pcclSuccess;
}

pcclResult_t pcclAllReduce(pcclComm_t comm, const void *sendbuf, void *recvbuf, uint64_t count,
                           pcclDataType_t dtype, pcclRedOp_t op, uint32_t tag, int timeout_ms) {
    clear_thread_error();
    PCCL_REQUIRE(comm, "comm is NULL");
    PCCL_CHECK(check_type(dtype));
    PCCL_CHECK(check_op(op));
    size_t bytes = 0;
    PCCL_CHECK(byte_size(count, dtype, 1, &bytes));
    PCCL_REQUIRE(count == 0 || (sendbuf && recvbuf), "NULL buffer for %llu elements",
                 (unsigned long long)count);
    return collective(comm, timeout_ms, [&](int64_t deadline) -> pcclResult_t {
        uint64_t seq = comm->coll_seq++;
        if (comm->world_size == 1) {
            if (bytes && recvbuf != sendbuf) std::memmove(recvbuf, sendbuf, bytes);
            return pcclSuccess;
        }
        uint8_t *work = staging(comm, bytes);
        if (!work) return pcclOutOfMemory;
        OpInfo info = op_info(comm, wire::kCollAllReduce, dtype, uint8_t(op), tag, seq, count);
        PCCL_CHECK(run_schedule(comm, ring_allreduce(info, (const uint8_t *)sendbuf, work), deadline));
        if (bytes) std::memcpy(recvbuf, work, bytes);
        return pcclSuccess;
    });
}

pcclResult_t pcclAllReduceQuantized(pcclComm_t comm, const void *sendbuf, void *recvbuf,
                                    uint64_t count, pcclDataType_t dtype, pcclRedOp_t op,
                                    pcclQuantType_t qtype, uint32_t block, uint32_t tag,
                                    int timeout_ms) {
    clear_thread_error();
    PCCL_REQUIRE(comm, "comm is NULL");
    PCCL_REQUIRE(dtype == pcclFloat32 || dtype == pcclFloat16 || dtype == pcclBFloat16,
                 "quantized all-reduce takes float32, float16 or bfloat16, got dtype %d", int(dtype));
    PCCL_REQUIRE(op == pcclSum || op == pcclAvg, "quantized all-reduce takes sum or avg, got op %d",
                 int(op));
    PCCL_REQUIRE(qtype == pcclQuantInt8 || qtype == pcclQuantInt4, "invalid quantization type %d",
                 int(qtype));
    PCCL_REQUIRE(block >= 1 && block <= PCCL_MAX_QUANT_BLOCK,
                 "block must be in [1, %d], got %u", PCCL_MAX_QUANT_BLOCK, block);
    // Keeps the plan's staging size (at most ~15 bytes per element plus
    // 10 * block * world size) far from overflow; a too large allocation then
    // fails cleanly with pcclOutOfMemory.
    size_t bytes = 0;
    PCCL_CHECK(byte_size(count, pcclFloat64, 3, &bytes));
    PCCL_REQUIRE(count == 0 || (sendbuf && recvbuf), "NULL buffer for %llu elements",
                 (unsigned long long)count);
    return collective(comm, timeout_ms, [&](int64_t deadline) -> pcclResult_t {
        uint64_t seq = comm->coll_seq++;
        OpInfo info = op_info(comm, quant::coll_of(qtype), dtype, uint8_t(op), tag, seq, count);
        info.root = uint16_t(block);
        quant::AllReducePlan plan(info, qtype, block);
        uint8_t *work = staging(comm, plan.staging_bytes());
        if (!work) return pcclOutOfMemory;
        Schedule exchange = plan.exchange(sendbuf, work);
        if (comm->world_size > 1) PCCL_CHECK(run_schedule(comm, exchange, deadline));
        Schedule share = plan.reduce_and_share(sendbuf, work);
        if (comm->world_size > 1) PCCL_CHECK(run_schedule(comm, share, deadline));
        plan.decode_result(work, recvbuf);  // the only write to recvbuf, after every byte arrived
        return pcclSuccess;
    });
}

pcclResult_t pcclBroadcast(pcclComm_t comm, void *buf, uint64_t count, pcclDataType_t dtype,
                           int root, uint32_t tag, int timeout_ms) {
    clear_thread_error();
    PCCL_REQUIRE(comm, "comm is NULL");
    PCCL_CHECK(check_type(dtype));
    PCCL_REQUIRE(root >= 0 && root < comm->world_size && root <= 0xFFFF,
                 "root %d out of range for world size %d", root, comm->world_size);
    size_t bytes = 0;
    PCCL_CHECK(byte_size(count, dtype, 1, &bytes));
    PCCL_REQUIRE(count == 0 || buf, "NULL buffer for %llu elements", (unsigned long long)count);
    return collective(comm, timeout_ms, [&](int64_t deadline) -> pcclResult_t {
        uint64_t seq = comm->coll_seq++;
        if (comm->world_size == 1) return pcclSuccess;
        uint8_t *work = nullptr;
        if (comm->rank != root && !(work = staging(comm, bytes))) return pcclOutOfMemory;
        OpInfo info = op_info(comm, wire::kCollBroadcast, dtype, wire::kNoOp, tag, seq, count);
        info.root = uint16_t(root);
        PCCL_CHECK(run_schedule(comm, chain_broadcast(info, root, (const uint8_t *)buf, work), deadline));
        if (comm->rank != root && bytes) std::memcpy(buf, work, bytes);
        return pcclSuccess;
    });
}

pcclResult_t pcclAllGather(pcclComm_t comm, const void *sendbuf, void *recvbuf, uint64_t count,
                           pcclDataType_t dtype, uint32_t tag, int timeout_ms) {
    clear_thread_error();
    PCCL_REQUIRE(comm, "comm is NULL");
    PCCL_CHECK(check_type(dtype));
    size_t bytes = 0, total = 0;
    PCCL_CHECK(byte_size(count, dtype, 1, &bytes));
    PCCL_CHECK(byte_size(count, dtype, uint64_t(comm->world_size), &total));
    PCCL_REQUIRE(count == 0 || (sendbuf && recvbuf), "NULL buffer for %llu elements",
                 (unsigned long long)count);
    return collective(comm, timeout_ms, [&](int64_t deadline) -> pcclResult_t {
        uint64_t seq = comm->coll_seq++;
        uint8_t *out = (uint8_t *)recvbuf;
        const size_t mine = size_t(comm->rank) * bytes;
        if (comm->world_size > 1) {
            uint8_t *work = staging(comm, total);
            if (!work) return pcclOutOfMemory;
            OpInfo info = op_info(comm, wire::kCollAllGather, dtype, wire::kNoOp, tag, seq, count);
            PCCL_CHECK(run_schedule(comm, ring_allgather(info, (const uint8_t *)sendbuf, work), deadline));
            // Own slice first: sendbuf may alias another slice of recvbuf.
            if (bytes && out + mine != sendbuf) std::memmove(out + mine, sendbuf, bytes);
            for (int r = 0; r < comm->world_size; ++r)
                if (r != comm->rank && bytes) std::memcpy(out + size_t(r) * bytes, work + size_t(r) * bytes, bytes);
        } else if (bytes && out != sendbuf) {
            std::memmove(out, sendbuf, bytes);
        }
        return pcclSuccess;
    });
}

pcclResult_t pcclReduceScatter(pcclComm_t comm, const void *sendbuf, void *recvbuf,
                               uint64_t count, pcclDataType_t dtype, pcclRedOp_t op,
                               uint32_t tag, int timeout_ms) {
    clear_thread_error();
    PCCL_REQUIRE(comm, "comm is NULL");
    PCCL_CHECK(check_type(dtype));
    PCCL_CHECK(check_op(op));
    size_t bytes = 0, total = 0;
    PCCL_CHECK(byte_size(count, dtype, 1, &bytes));
    PCCL_CHECK(byte_size(count, dtype, uint64_t(comm->world_size), &total));
    PCCL_REQUIRE(count == 0 || (sendbuf && recvbuf), "NULL buffer for %llu elements",
                 (unsigned long long)count);
    return collective(comm, timeout_ms, [&](int64_t deadline) -> pcclResult_t {
        uint64_t seq = comm->coll_seq++;
        if (comm->world_size == 1) {
            if (bytes && recvbuf != sendbuf) std::memmove(recvbuf, sendbuf, bytes);
            return pcclSuccess;
        }
        uint8_t *work = staging(comm, total);
        if (!work) return pcclOutOfMemory;
        OpInfo info = op_info(comm, wire::kCollReduceScatter, dtype, uint8_t(op), tag, seq, count);
        PCCL_CHECK(run_schedule(comm, ring_reduce_scatter(info, (const uint8_t *)sendbuf, work), deadline));
        if (bytes) std::memcpy(recvbuf, work + size_t(comm->rank) * bytes, bytes);
        return pcclSuccess;
    });
}

pcclResult_t pcclAllToAllv(pcclComm_t comm, const void *sendbuf, const uint64_t *scounts,
                           const uint64_t *sdispls, void *recvbuf, const uint64_t *rcounts,
                           const uint64_t *rdispls, pcclDataType_t dtype, uint32_t tag,
                           int timeout_ms) {
    clear_thread_error();
    PCCL_REQUIRE(comm, "comm is NULL");
    PCCL_CHECK(check_type(dtype));
    PCCL_REQUIRE(scounts && sdispls && rcounts && rdispls, "NULL count or displacement array");
    const int n = comm->world_size, me = comm->rank;
    uint64_t recv_end = 0, send_total = 0;
    for (int p = 0; p < n; ++p) {
        size_t b;
        PCCL_REQUIRE(rdispls[p] <= UINT64_MAX - rcounts[p] && sdispls[p] <= UINT64_MAX - scounts[p],
                     "count + displacement overflows for rank %d", p);
        PCCL_CHECK(byte_size(rdispls[p] + rcounts[p], dtype, 1, &b));
        PCCL_CHECK(byte_size(sdispls[p] + scounts[p], dtype, 1, &b));
        if (rdispls[p] + rcounts[p] > recv_end) recv_end = rdispls[p] + rcounts[p];
        send_total += scounts[p];
    }
    PCCL_REQUIRE(scounts[me] == rcounts[me], "this rank sends itself %llu elements but expects %llu",
                 (unsigned long long)scounts[me], (unsigned long long)rcounts[me]);
    PCCL_REQUIRE((send_total == 0 || sendbuf) && (recv_end == 0 || recvbuf), "NULL buffer");
    const size_t es = type_size(dtype);
    return collective(comm, timeout_ms, [&](int64_t deadline) -> pcclResult_t {
        uint64_t seq = comm->coll_seq++;
        uint8_t *out = (uint8_t *)recvbuf;
        const uint8_t *in = (const uint8_t *)sendbuf;
        uint8_t *work = nullptr;
        if (n > 1) {
            if (!(work = staging(comm, size_t(recv_end) * es))) return pcclOutOfMemory;
            OpInfo info = op_info(comm, wire::kCollAllToAll, dtype, wire::kNoOp, tag, seq, 0);
            PCCL_CHECK(run_schedule(
                comm, pairwise_alltoallv(info, in, scounts, sdispls, work, rcounts, rdispls), deadline));
        }
        // Own slice first: with sendbuf == recvbuf, later copies may overwrite it.
        if (rcounts[me]) std::memmove(out + rdispls[me] * es, in + sdispls[me] * es, rcounts[me] * es);
        for (int p = 0; p < n; ++p)
            if (p != me && rcounts[p])
                std::memcpy(out + rdispls[p] * es, work + rdispls[p] * es, rcounts[p] * es);
        return pcclSuccess;
    });
}

pcclResult_t pcclSend(pcclComm_t comm, const void *buf, uint64_t count, pcclDataType_t dtype,
                      int peer, uint32_t tag, int timeout_ms) {
    clear_thread_error();
    PCCL_REQUIRE(comm, "comm is NULL");
    PCCL_CHECK(check_type(dtype));
    PCCL_REQUIRE(peer >= 0 && peer < comm->world_size && peer != comm->rank,
                 "send to rank %d: not another rank of this world of %d", peer, comm->world_size);
    size_t bytes = 0;
    PCCL_CHECK(byte_size(count, dtype, 1, &bytes));
    PCCL_REQUIRE(count == 0 || buf, "NULL buffer for %llu elements", (unsigned long long)count);
    return collective(comm, timeout_ms, [&](int64_t deadline) -> pcclResult_t {
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
    PCCL_REQUIRE(comm, "comm is NULL");
    PCCL_CHECK(check_type(dtype));
    PCCL_REQUIRE(peer >= 0 && peer < comm->world_size && peer != comm->rank,
                 "recv from rank %d: not another rank of this world of %d", peer, comm->world_size);
    size_t bytes = 0;
    PCCL_CHECK(byte_size(count, dtype, 1, &bytes));
    PCCL_REQUIRE(count == 0 || buf, "NULL buffer for %llu elements", (unsigned long long)count);
    return collective(comm, timeout_ms, [&](int64_t deadline) -> pcclResult_t {
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
    return collective(comm, timeout_ms, [&](int64_t deadline) -> pcclResult_t {
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
    return collective(comm, timeout_ms, [&](int64_t deadline) -> pcclResult_t {
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

pcclResult_t pcclBarrier(pcclComm_t comm, uint32_t tag, int timeout_ms) {
    clear_thread_error();
    PCCL_REQUIRE(comm, "comm is NULL");
    return collective(comm, timeout_ms, [&](int64_t deadline) -> pcclResult_t {
        uint64_t seq = comm->coll_seq++;
        if (comm->world_size == 1) return pcclSuccess;
        // An all-gather of one byte: a rank leaves only after bytes that every
        // other rank sent on entering have reached it.
        uint8_t *work = staging(comm, size_t(comm->world_size));
        if (!work) return pcclOutOfMemory;
        uint8_t mine = 1;
        OpInfo info = op_info(comm, wire::kCollBarrier, pcclUInt8, wire::kNoOp, tag, seq, 1);
        return run_schedule(comm, ring_allgather(info, &mine, work), deadline);
    });
}

}  // extern "C"
