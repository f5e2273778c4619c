// Pacing of striped links: a measured cap on what each peer's S streams send together.
//
// Why: the S TCP streams to one peer each run their own congestion control (BBR by
// default). Between operations they go idle and come back with bandwidth estimates of
// their own that add up to more than the path carries (a stream that ran alone at the
// end of an op measured the whole path for itself), so at the next op's start they
// overflow the bottleneck's queue together. Measured on an emulated 1 Gbit/s, 100 ms
// link (benchmarks/wan.py, 4 streams, 64 MiB all-reduce): ~7,000 retransmitted segments
// per op and 1.0 s (54 % of the link); with every stream capped at its share of the link
// (SO_MAX_PACING_RATE), no drop and 0.62 s (86 %). A cap 25 % above the link already
// costs 20 %: the cap has to follow the path's measured rate, not a guess.
//
// Measurement: while an op still has bytes for a peer, the engine reads TCP_INFO of the
// peer's streams once per window (the path's minimum RTT, bounded by kMinWindowMs ..
// kMaxWindowMs). A window counts only if a stream had bytes queued and not yet sent
// (tcpi_notsent_bytes) at both its ends: the network or the cap held the streams back,
// not the op. Its rate is the lesser of the bytes acknowledged and the bytes sent in it
// (tcpi_bytes_acked, tcpi_bytes_sent) over its length: ACKs queued behind the reverse
// direction's data arrive bunched, and acknowledged bytes alone read up to 1.4x the path
// in one window (measured through the emulator: 281 Mbit/s on a 200 Mbit/s link).
//
// A window counts only if, at its end, at least half the streams' latest delivery-rate
// samples were not app-limited (tcpi_delivery_rate_app_limited): a rank that forwards
// what a slow upstream peer sends it must not read its fast downstream path as slow.
// The op's sample is its fastest counted window, and it is trusted only if the op saw
// a queue on the path at one of its samples (a stream's smoothed RTT above kPaceQueueRtt
// x the smallest RTT any of them has seen, plus a millisecond): the bottleneck was busy,
// so the streams had reached the path's rate. Without a queue they may still have been
// ramping up (TCP's start-up reads as a path of a few MB/s), and a cap set from that
// would hold every later op there (measured: a 64 MiB all-reduce at 9 % of the link
// after a few small ops). A trusted sample becomes the estimate, unless the previous
// estimate decayed by kPaceDecay is larger (so that it follows a path that got slower);
// the cap is kPaceHeadroom x the estimate, split evenly over the streams. An op without
// a queue whose sample reached kPaceCapBound of the cap says the path may carry more
// than the cap: the estimate grows by kPaceGrow. No estimate, no cap: until the path has
// shown a queue, the streams run as TCP drives them.
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

struct pcclComm;

namespace pccl {

constexpr double kPaceHeadroom = 1.05; // cap / estimate
constexpr double kPaceDecay = 0.95;    // estimate kept per sampled op when samples are lower
constexpr double kPaceQueueRtt = 1.1;  // smoothed RTT / minimum RTT that shows a queue
constexpr double kPaceCapBound = 0.97; // an op this close to the cap without a queue ...
constexpr double kPaceGrow = 1.25;     // ... grows the estimate by this
constexpr int64_t kMinWindowMs = 20;
constexpr int64_t kMaxWindowMs = 500;

// The pacing state of one communicator and its lanes (they share the paths, so they
// share what was measured on them). Lanes run ops concurrently: guarded by `mutex`.
struct Pacing {
    std::mutex mutex;
    // < 0: measured; 0: off (the default: no cap, no measurement); > 0: pinned at this
    // many bytes per second per peer, all streams together.
    int64_t mode = 0;
    std::vector<double> estimate;  // per peer, bytes per second; 0: nothing measured yet

    explicit Pacing(int world_size) : estimate(size_t(world_size), 0.0) {}
};

// The next estimate of a peer (bytes per second) from the current one, an op's sample
// (<= 0: none), whether the op saw a queue on the path, and the cap the op ran under
// (0: none).
double next_estimate(double estimate, double sample, bool queued, double cap);

// The cap on a peer's streams together, bytes per second, for a mode and an estimate;
// 0: no cap.
double peer_cap(int64_t mode, double estimate);

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

    // Samples every peer whose window has elapsed; busy[peer] != 0 while the op still
    // has bytes for it that it has not handed to the sockets.
    void sample(const std::vector<char> &busy);

    // Folds this op's samples into the shared estimates.
    void finish();

private:
    // A peer's streams summed, from TCP_INFO.
    struct Counters {
        uint64_t acked = 0, sent = 0;  // tcpi_bytes_acked, tcpi_bytes_sent
        bool queue = false;            // a stream's smoothed RTT shows a queue on the path
        int supplied = 0;              // streams whose last delivery sample was not app-limited
        bool backlogged = false;       // a stream has bytes not yet sent (tcpi_notsent_bytes)
        int64_t min_rtt_ms = kMinWindowMs;
    };
    struct Peer {
        bool active = false;
        bool was_busy = false;
        int64_t last_us = 0;  // when `last` was read (CLOCK_MONOTONIC, µs)
        Counters last;
        int64_t window_ms = kMinWindowMs;
        double best = 0.0;    // bytes/s: the op's fastest counted window
        bool queued = false;  // a sample of the op showed a queue on the path
        double cap = 0.0;   // the cap this op ran under, bytes per second (0: none)
    };
    // Every peer's cap now (peer_cap of the shared state), and the mode, under its lock.
    std::vector<double> caps(int64_t *mode) const;
    // Sets caps[peer] / S on each of the peer's streams where it changed.
    void apply_caps(const std::vector<double> &caps);
    bool read(int peer, Counters *out) const;

    pcclComm *comm_;
    std::vector<Peer> peers_;
    int64_t next_ = INT64_MAX;
};

}  // namespace pccl
