// The lifecycle and queries of pccl.h: creating a communicator (on its own
// listener or a shared one), connecting it and its lanes, aborting, destroying,
// and what a caller may read of it (rank, errors, ring order, pacing, byte
// counts). Tuning is in api_config.cpp, the operations in api_coll.cpp and
// api_p2p.cpp.
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <new>
#include <string>
#include <vector>

#include "api.hpp"
#include "handshake.hpp"

using namespace pccl;

namespace {

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
    comm->last_rate.assign(size_t(world_size), 0.0);
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
    return pcclCommConnectLaneRange(comm, addrs, 0, nlanes, nlanes, lanes_out, timeout_ms);
}

pcclResult_t pcclCommConnectLaneRange(pcclComm_t comm, const char *const *addrs, int first,
                                      int count, int nlanes, pcclComm_t *lanes_out,
                                      int timeout_ms) {
    clear_thread_error();
    PCCL_REQUIRE(comm && addrs, "NULL argument");
    PCCL_REQUIRE(nlanes >= 1 && nlanes <= PCCL_MAX_LANES, "nlanes must be in [1, %d], got %d",
                 PCCL_MAX_LANES, nlanes);
    PCCL_REQUIRE(first >= 0 && count >= 1 && first + count <= nlanes,
                 "lanes %d .. %d are not a range of %d lane(s)", first, first + count - 1,
                 nlanes);
    const int made = first == 0 ? count - 1 : count;  // new communicators, into lanes_out
    PCCL_REQUIRE(made == 0 || lanes_out, "lanes_out is NULL for %d new lane(s)", made);
    PCCL_REQUIRE(timeout_ms > 0, "timeout_ms must be > 0, got %d", timeout_ms);
    for (int l = 0; l < made; ++l) lanes_out[l] = nullptr;
    // A first range takes the op lock, as a connect always did; a later one must not:
    // lane 0 runs collectives meanwhile, and a peer's may wait for this rank's.
    std::unique_lock<std::mutex> op(comm->op_mutex, std::defer_lock);
    if (first == 0) op.lock();
    std::lock_guard<std::mutex> g(comm->lanes_mutex);
    if (first == 0 && comm->connected)
        return fail(pcclInvalidUsage, "communicator is already connected");
    if (first > 0 && (!comm->connected || comm->lanes_up != first || comm->nlanes != nlanes))
        return failf(pcclInvalidUsage,
                     "lanes %d .. %d do not follow the %d connected lane(s) of %d", first,
                     first + count - 1, comm->connected ? comm->lanes_up : 0,
                     comm->connected ? comm->nlanes : nlanes);
    {
        std::lock_guard<std::mutex> e(comm->error_mutex);
        if (comm->sticky != pcclSuccess) return fail(comm->sticky, comm->sticky_detail);
    }
    // New lanes share nothing with comm but rank, world size, id and tuning.
    std::vector<pcclComm *> lanes(size_t(nlanes), nullptr);
    lanes[0] = comm;
    pcclResult_t rc = pcclSuccess;
    for (int l = std::max(first, 1); l < first + count && rc == pcclSuccess; ++l) {
        rc = new_comm(&lanes[size_t(l)], comm->rank, comm->world_size, comm->comm_id);
        if (rc == pcclSuccess) {
            pcclComm *lane = lanes[size_t(l)];
            lane->port = comm->port;
            lane->owns_listener = false;
            lane->chunk_bytes = comm->chunk_bytes;
            lane->streams = comm->streams;
            lane->stripe = comm->stripe;
            lane->link_timeout_ms = comm->link_timeout_ms;  // what pcclCommGetConfig reports
            lane->pacing = comm->pacing;  // same paths, same measurements
            lane->nlanes = nlanes;
        }
    }
    if (rc == pcclSuccess) rc = connect_all(lanes.data(), first, count, nlanes, addrs, timeout_ms);
    // Woken by pcclCommAbortWithError: report its cause, not a bare abort.
    if (rc == pcclAborted && comm->aborted.load()) rc = abort_error(comm);
    if (rc != pcclSuccess) {
        for (int l = std::max(first, 1); l < first + count; ++l)
            if (lanes[size_t(l)]) destroy(lanes[size_t(l)]);
        // A later range's failure is its new lanes' alone: lane 0 keeps running.
        if (first == 0 && is_network_error(rc)) fail_comm(comm, rc, nullptr);
        return rc;
    }
    if (first == 0) comm->nlanes = nlanes;
    comm->lanes_up = first + count;
    for (int l = std::max(first, 1); l < first + count; ++l)
        lanes_out[l - std::max(first, 1)] = lanes[size_t(l)];
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

pcclResult_t pcclCommGetPacing(pcclComm_t comm, int peer, double *estimate, double *cap) {
    clear_thread_error();
    PCCL_REQUIRE(comm && estimate && cap, "NULL argument");
    PCCL_REQUIRE(peer >= 0 && peer < comm->world_size, "peer %d out of range for world size %d",
                 peer, comm->world_size);
    std::lock_guard<std::mutex> g(comm->pacing->mutex);
    *estimate = peer_estimate(*comm->pacing, peer);
    *cap = comm->streams > 1 ? peer_cap(*comm->pacing, peer) : 0.0;
    return pcclSuccess;
}

pcclResult_t pcclCommGetPathState(pcclComm_t comm, int peer, int *filled, int *stripe) {
    clear_thread_error();
    PCCL_REQUIRE(comm && filled && stripe, "NULL argument");
    PCCL_REQUIRE(peer >= 0 && peer < comm->world_size, "peer %d out of range for world size %d",
                 peer, comm->world_size);
    std::lock_guard<std::mutex> o(comm->op_mutex);
    std::lock_guard<std::mutex> g(comm->pacing->mutex);
    *stripe = std::max(1, std::min(comm->streams, proposed_stripe(*comm->pacing, peer, comm->stripe)));
    *filled = path_filled(*comm->pacing, peer) ? 1 : 0;
    return pcclSuccess;
}

pcclResult_t pcclCommGetLastRate(pcclComm_t comm, int peer, double *rate) {
    clear_thread_error();
    PCCL_REQUIRE(comm && rate, "NULL argument");
    PCCL_REQUIRE(peer >= 0 && peer < comm->world_size, "peer %d out of range for world size %d",
                 peer, comm->world_size);
    std::lock_guard<std::mutex> g(comm->op_mutex);
    *rate = size_t(peer) < comm->last_rate.size() ? comm->last_rate[size_t(peer)] : 0.0;
    return pcclSuccess;
}

pcclResult_t pcclCommSetStripe(pcclComm_t comm, int streams) {
    clear_thread_error();
    PCCL_REQUIRE(comm, "NULL argument");
    std::lock_guard<std::mutex> g(comm->op_mutex);
    PCCL_REQUIRE(streams >= 1 && streams <= comm->streams,
                 "stripe %d out of range: %d stream(s) per peer are connected", streams,
                 comm->streams);
    // The paths keep what they measured: the bandwidth is the path's, whatever the stripe
    // (the next op tells the controller, which scores the new stripe against the old).
    comm->stripe = streams;
    return pcclSuccess;
}

pcclResult_t pcclCommGetMinRtt(pcclComm_t comm, int peer, double *seconds) {
    clear_thread_error();
    PCCL_REQUIRE(comm && seconds, "NULL argument");
    PCCL_REQUIRE(peer >= 0 && peer < comm->world_size, "peer %d out of range for world size %d",
                 peer, comm->world_size);
    std::lock_guard<std::mutex> g(comm->op_mutex);
    *seconds = peer == comm->rank ? 0.0 : min_rtt_s(comm, peer);
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

}  // extern "C"
