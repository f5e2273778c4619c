// Pacing of striped links: the engine's side of the rate controller (rate.hpp).
//
// What is decided, and why, is in rate.hpp: this file only measures and applies. While an
// op still has bytes for a peer, the engine calls RateProbe::sample once per window (the
// path's minimum RTT, bounded by kMinWindowMs .. kMaxWindowMs). The probe reads TCP_INFO
// of the peer's striped streams, sums their counters into a rate::Window (segments
// delivered x MSS, new bytes sent, bytes retransmitted; whether the sockets ran dry),
// hands it to the path's Controller, and sets the cap
// it returns on the streams (SO_MAX_PACING_RATE, split evenly over the streams of every
// op then sending to the peer: lanes share the path). A window in which another lane's op
// also sent to the peer is not sampled: it saw a share of the path.
//
// The stripe is the sender's (rate.hpp): an op deals a peer's frames over the first
// RateProbe::stripe(peer) of its streams, and the receiver reads all of them.
//
// A path is the peer's IP address: its Controller lives in a process-wide registry, so
// what was measured carries across ops, lanes, idle time, new groups and membership
// changes (every epoch connects anew; the path stays).
//
// PCCL_RATE_TRACE=FILE appends every window (what was measured and the cap that followed)
// to FILE as CSV, the format native/tests/test_rate.cpp replays.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "rate.hpp"

struct pcclComm;

namespace pccl {

constexpr int64_t kMinWindowMs = 20;
constexpr int64_t kMaxWindowMs = 500;

// One path (a peer's address) as every communicator of this process to it knows it.
struct Path {
    std::mutex mutex;
    std::string key;          // the peer's IP address
    rate::Controller ctl;
    int sending = 0;          // ops now measuring streams to it (any lane, any group)
    uint64_t changes = 0;     // ops that started or ended measuring it (window_shared)
    uint64_t ops = 0;         // ops measured (the trace's op number)
    double min_rtt = 0;       // seconds: the smallest RTT its streams have seen (0: none)
};

// An op starts (+1) or ends (-1) measuring streams on `path`; the caller holds its mutex.
inline void path_sending(Path &path, int delta) {
    path.sending += delta;
    path.changes += 1;
}

// Whether an op's window on `path` saw the path shared: another op measured it at the
// window's end, or one started or ended during it (`seen`: Path::changes at the window's
// start). Either way the op's streams were paced at a share of the cap for part of the
// window (RateProbe::set_cap divides by the ops sending), so what it delivered is not the
// path's rate. An op that ended counts as much as one that started: its end leaves the
// others paced at their share until their next window, and those windows, read as the
// path's, pulled the estimate down to that share, then the cap with it, op after op
// (Streaming DiLoCo's overlapping exchanges on an emulated 100 ms link: 1 MB/s to 55 kB/s
// in a minute, until an exchange timed out). The caller holds the path's mutex.
inline bool window_shared(const Path &path, uint64_t seen) {
    return path.sending > 1 || path.changes != seen;
}

// The pacing of a communicator and its lanes. Lanes run ops concurrently: guarded by
// `mutex` (taken before a Path's, never after).
struct Pacing {
    std::mutex mutex;
    // < 0: measured; 0: off (the default: no cap, no measurement); > 0: pinned at this
    // many bytes per second per peer, all streams together.
    int64_t mode = 0;
    // Per peer: its path, found on the first measured op (null before).
    std::vector<std::shared_ptr<Path>> paths;

    explicit Pacing(int world_size) : paths(size_t(world_size)) {}
};

// The cap on a peer's streams together, bytes per second (0: none): pinned, or the path's
// controller's at gain 1. The caller holds Pacing::mutex.
double peer_cap(const Pacing &p, int peer);
// The path's bandwidth estimate, bytes per second (0: none). Caller holds Pacing::mutex.
double peer_estimate(const Pacing &p, int peer);
// Whether the path's controller left start-up. Caller holds Pacing::mutex.
bool path_filled(const Pacing &p, int peer);
// The stripe the path to peer asks for (rate.hpp's hill climb); `current` when unknown.
int proposed_stripe(const Pacing &p, int peer, int current);

// The smallest RTT the kernel saw on comm's striped streams to peer, seconds (0: none or
// no TCP_INFO); the caller holds comm's op lock.
double min_rtt_s(pcclComm *comm, int peer);

// The bytes one stream holds in flight at most: 3/4 of the send buffer's autotuning limit
// (net.ipv4.tcp_wmem's last field, 4 MiB when unreadable; the rest is the kernel's per-
// packet overhead: one stream through an emulated 100 ms link carried 3.4 MB per round
// trip with 4 MiB). Read once.
double stream_window();

// One op's measurement and the caps it applies, for a communicator with more than one
// stream: constructed before the op's first send (it applies the caps from what earlier
// ops measured), sampled by the engine's loop at next_ms(), and finish()ed when the op
// succeeded. A failed op just drops it.
class RateProbe {
public:
    // sends_to[peer] != 0 for the peers this op sends to.
    RateProbe(pcclComm *comm, const std::vector<char> &sends_to);

    // When the next sample is due (the engine's net::now_ms() clock), or INT64_MAX.
    int64_t next_ms() const { return next_; }

    // The streams this op deals its frames to `peer` over: the first stripe(peer) of them
    // (the path's controller decides, rate.hpp; comm's stripe where nothing is measured).
    int stripe(int peer) const { return peers_[size_t(peer)].stripe; }

    // Samples every peer whose window has elapsed; busy[peer] != 0 while the op still
    // has bytes for it that it has not handed to the sockets, 2 when a socket to it took no
    // more (the path or the window holds the op back).
    void sample(const std::vector<char> &busy);

    // Scores the op's stripe and records comm's last_rate.
    void finish();

    // Ends the op's share of the path (every op, failed or not).
    ~RateProbe();
    RateProbe(const RateProbe &) = delete;
    RateProbe &operator=(const RateProbe &) = delete;

    // A stream's cumulative counters, summed over a peer's stripe.
    struct Counters {
        double delivered = 0;   // bytes: tcpi_delivered x tcpi_snd_mss
        double sent = 0;        // bytes: tcpi_bytes_sent - tcpi_bytes_retrans
        double retrans = 0;     // bytes: tcpi_bytes_retrans
        double spot = 0;        // bytes/s: the streams' tcpi_delivery_rate summed
        double notsent = 0;     // bytes queued in the sockets and not yet sent
        int streams = 0;
        uint32_t srtt_us = 0, min_rtt_us = 0;  // the largest smoothed, the smallest minimum
    };

private:
    struct Peer {
        bool active = false;
        int64_t last_us = 0;  // when `last` was read (CLOCK_MONOTONIC, µs)
        Counters last;
        int64_t window_ms = kMinWindowMs;
        double best = 0.0;    // bytes/s: the op's fastest busy sample (comm's last_rate)
        rate::Window prev, before;  // the op's last two measured windows
        int index = 0;        // windows of the op so far
        int stripe = 1;       // the streams this op deals over
        std::shared_ptr<Path> path;
    };
    bool read(int peer, Counters *out) const;  // over the peer's stripe
    bool shared(size_t peer);
    void set_cap(size_t peer, double cap);  // cap / (S x ops sending) on each stream
    void trace(const Peer &st, const rate::Window &w, const Counters &now, bool shared,
               double cap, int64_t read_us) const;

    pcclComm *comm_;
    std::vector<Peer> peers_;
    std::vector<uint64_t> seen_;  // per peer: Path::changes at the last window
    int64_t mode_ = 0;            // Pacing::mode when the op started
    int64_t next_ = INT64_MAX;
};

}  // namespace pccl
