// The communicator: one rank's links to every other rank, its abort flag, its
// sticky error and its staging memory. Collectives run under op_mutex. The
// handshake that opens the links is in handshake.hpp.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "pacing.hpp"
#include "pccl.h"
#include "seal.hpp"

struct pcclListener {
    int fd = -1;
    int port = 0;
};

struct pcclComm {
    struct Link {
        int fd = -1;
        std::string name;  // "rank 2 (10.0.0.2:4000)" for error messages
        uint32_t pace = ~0U;  // the SO_MAX_PACING_RATE set on fd, bytes/s (~0U: none)
        // The link's record keys when it is encrypted (seal.hpp); null: plain.
        std::unique_ptr<pccl::seal::LinkSeal> seal;
        int rcvlowat = 1;  // the SO_RCVLOWAT set on fd (set_rcvlowat)
    };

    int rank = 0;
    int world_size = 1;
    uint64_t comm_id = 0;
    int listen_fd = -1;
    int port = 0;
    bool owns_listener = true;  // false when borrowed from a pcclListener
    int abort_fd = -1;  // eventfd written by pcclCommAbort so that poll() wakes at once
    std::atomic<bool> aborted{false};
    bool connected = false;

    // Lanes on demand (pcclCommConnectLaneRange): the lane count this rank announced in
    // its hellos (every peer must announce the same), and how many of them are connected
    // (lanes 0 .. lanes_up-1). A peer may open a later range's connections while this
    // rank still accepts an earlier one: such a connection, its hello checked, waits in
    // `early` for the range it belongs to. All three guarded by lanes_mutex, which a range
    // connect holds throughout (not op_mutex: lane 0 runs collectives meanwhile).
    struct Early {
        int fd = -1;
        std::vector<uint8_t> bytes;  // what came of its hello (and nonce) so far
        std::string from;
    };
    std::mutex lanes_mutex;
    int nlanes = 1;
    int lanes_up = 0;
    std::vector<Early> early;

    std::mutex op_mutex;  // serialises collectives in call order
    // S streams to every peer: links[peer * streams + s], s in 0 .. streams-1
    // (links of this rank unused). An op's frames to a peer go on whichever of its
    // streams has room, and the receiver places each by the step its header names
    // (deal.hpp); each stream stays a FIFO, across ops too.
    int streams = 1;
    // How many of them each op deals its frames over (the first `stripe`), 1 .. streams;
    // equal on every rank at every op (pcclCommSetStripe). Set to `streams` with it.
    int stripe = 1;
    int link_timeout_ms = PCCL_DEFAULT_LINK_TIMEOUT_MS;  // see pcclConfig_t
    int op_timeout_ms = 0;  // the running collective's timeout, named when it times out
    std::vector<uint8_t> secret;  // pcclCommSetSecret; empty: links are not authenticated
    bool encrypt = true;  // pcclCommSetEncryption: with a secret, links are sealed (seal.hpp)
    std::vector<Link> links;
    // Per peer: the links (all lanes and streams) that came up in the last connect,
    // out of links_per_peer; what pcclCommGetUnreachedRanks reports after a failure.
    std::vector<int> links_up;
    int links_per_peer = 0;
    // What the streams to each peer may send together (pacing.hpp); shared by the lanes.
    std::shared_ptr<pccl::Pacing> pacing;
    // Per peer: the fastest counted window of this communicator's last striped op (with
    // pacing not off), bytes per second (0: none; pacing.hpp). Guarded by op_mutex.
    std::vector<double> last_rate;

    // Guarded by op_mutex (and error_mutex for readers on other threads).
    std::mutex error_mutex;
    pcclResult_t sticky = pcclSuccess;
    std::string sticky_detail;
    std::string last_error;
    // What an aborted call fails with (pcclCommAbortWithError; else pcclAborted).
    pcclResult_t abort_code = pcclAborted;
    std::string abort_reason = "communicator aborted";

    uint64_t coll_seq = 0;              // collectives started, equal on every rank
    std::vector<uint64_t> p2p_sent;     // per-peer count of sends
    std::vector<uint64_t> p2p_received; // per-peer count of receives
    uint64_t chunk_bytes = 1u << 20;
    // Ring order of the ring collectives: position p holds rank ring[p]; empty is
    // rank order. Guarded by op_mutex; equal on every rank (pcclCommSetRingOrder).
    std::vector<int> ring;

    std::atomic<uint64_t> bytes_sent{0};
    std::atomic<uint64_t> bytes_received{0};

    uint8_t *staging = nullptr;
    size_t staging_size = 0;
};

namespace pccl {

// Staging memory of at least `bytes`, grown on demand and reused across ops.
// Returns nullptr (with the thread error set) if the allocation fails.
uint8_t *staging(pcclComm *comm, size_t bytes);

// Makes `rc` the communicator's sticky error (the first one wins), and tells every
// peer with a best-effort ABORT frame so that ranks not directly connected to
// the failure stop waiting. mid_frame[link] != 0 marks links whose outgoing frame
// was cut short: an ABORT there would be read as payload, so they are shut down
// instead. Returns rc.
pcclResult_t fail_comm(pcclComm *comm, pcclResult_t rc, const std::vector<char> *mid_frame);

// pcclSuccess if collectives may run; else the sticky error or pcclInvalidUsage.
pcclResult_t check_ready(pcclComm *comm);

// The error a call woken by an abort fails with: pcclAborted, or the code and
// reason given to pcclCommAbortWithError. Sets the thread error; returns the code.
pcclResult_t abort_error(pcclComm *comm);

// Closes every link, the listener if owned and the abort eventfd; frees comm.
void destroy(pcclComm *comm);

// Sets the link's SO_RCVLOWAT to `bytes` unless it is already that: poll() then reports
// the link readable once that many bytes are there (or it ended). Readers of frame
// headers keep it at a header's size, so a header split across TCP segments is not
// polled for in a loop. Best effort.
void set_rcvlowat(pcclComm::Link &link, int bytes);

}  // namespace pccl
