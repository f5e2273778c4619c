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
// Measurement: while an op still has bytes for a peer, the engine sums tcpi_bytes_acked
// over the peer's streams once per window (the path's minimum RTT, bounded by
// kMinWindowMs .. kMaxWindowMs). A window counts only if a stream had bytes queued and
// not yet sent (tcpi_notsent_bytes) at both its ends, i.e. the path or the cap held the
// streams back, not the op. A window's rate is the lesser of the bytes acknowledged and
// the bytes sent in it (tcpi_bytes_sent) over its length (the guard against bunched
// ACKs that BBR's delivery-rate samples also take); the op's sample is its fastest
// window: each is a lower bound of what the path carries.
// The estimate keeps the largest sample, decaying by kPaceDecay per sampled op so that
// it follows a path that got slower; the cap is kPaceHeadroom x the estimate, split
// evenly over the streams. A sample that reached the cap (kPaceCapBound) says the cap,
// not the path, held the streams: after kPaceHeldOps such ops in a row the estimate
// jumps to kPaceProbe x the sample, so a cap set from a slow first op (TCP still ramping
// up) opens within a few ops.
// Ops shorter than one window (small messages, barriers) neither sample nor decay.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

struct pcclComm;

namespace pccl {

constexpr double kPaceHeadroom = 1.1;  // cap / estimate
constexpr double kPaceDecay = 0.95;    // estimate kept per sampled op when samples are lower
constexpr double kPaceCapBound = 0.95; // a sample this close to the cap was held by it
constexpr double kPaceProbe = 1.25;    // then the estimate jumps to sample x this
constexpr int kPaceHeldOps = 2;        // after this many sampled ops in a row held at the cap
constexpr int64_t kMinWindowMs = 20;
constexpr int64_t kMaxWindowMs = 500;

// The pacing state of one communicator and its lanes (they share the paths, so they
// share what was measured on them). Lanes run ops concurrently: guarded by `mutex`.
struct Pacing {
    std::mutex mutex;
    // < 0: measured (the default); 0: off (no cap, no measurement); > 0: pinned at
    // this many bytes per second per peer, all streams together.
    int64_t mode = -1;
    std::vector<double> estimate;  // per peer, bytes per second; 0: nothing measured yet
    std::vector<int> held;         // per peer, sampled ops in a row held at the cap

    explicit Pacing(int world_size)
        : estimate(size_t(world_size), 0.0), held(size_t(world_size), 0) {}
};

// The next estimate of a peer from the current one, an op's fastest window and the cap
// the op ran under (all in bytes per second; sample <= 0: the op gave none; cap 0: none).
// *held counts the sampled ops in a row held at the cap (updated). Pure but for *held,
// for the tests' sake.
double next_estimate(double estimate, double sample, double cap, int *held);

// The cap on a peer's streams together, bytes per second, for a mode and an estimate;
// 0: no cap.
double peer_cap(int64_t mode, double estimate);

// One op's measurement and the caps it applies: constructed before the op's first
// send (it applies the caps from what earlier ops measured), sampled by the engine's
// loop at next_ms(), and finish()ed when the op succeeded. A failed op just drops it.
class RateProbe {
public:
    // sends_to[peer] != 0 for the peers this op sends to.
    RateProbe(pcclComm *comm, const std::vector<char> &sends_to);

    // When the next sample is due (the engine's now_ms() clock), or INT64_MAX.
    int64_t next_ms() const { return next_; }

    // Samples every peer whose window has elapsed; busy[peer] != 0 while the op still
    // has bytes for it that it has not handed to the sockets.
    void sample(int64_t now_ms, const std::vector<char> &busy);

    // Folds this op's samples into the shared estimates.
    void finish();

private:
    // A peer's streams summed, from TCP_INFO.
    struct Counters {
        uint64_t acked = 0, sent = 0;  // tcpi_bytes_acked, tcpi_bytes_sent
        bool backlogged = false;       // a stream has bytes not yet sent (tcpi_notsent_bytes)
        int64_t min_rtt_ms = kMinWindowMs;
    };
    struct Peer {
        bool active = false;
        bool was_busy = false;
        int64_t last_ms = 0;  // the engine's clock, for scheduling
        int64_t last_us = 0;  // steady clock, for rates
        Counters last;
        int64_t window_ms = kMinWindowMs;
        double best = 0.0;  // bytes per second: the op's fastest window that counts
        double cap = 0.0;   // the cap this op ran under, bytes per second (0: none)
    };
    void apply_caps();
    bool read(int peer, Counters *out) const;

    pcclComm *comm_;
    std::vector<Peer> peers_;
    int64_t next_ = INT64_MAX;
};

}  // namespace pccl
