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
// kMaxWindowMs). A window's rate is the sum, over the streams that had new bytes
// acknowledged in it, of the kernel's latest delivery-rate sample (tcpi_delivery_rate:
// what BBR's bandwidth filter is fed; the kernel measures each over the longer of its
// send and ACK intervals, so bunched ACKs do not inflate it, and a sample taken while the
// stream was short of data only reads low). Earlier versions read the bytes acknowledged
// and sent per window instead: through the emulator at 1 Gbit/s, 100 ms, those swing from
// 0 to 14.5 MB per 100 ms window with losses and bunched ACKs, while the delivery-rate sum
// of the same windows stayed at 720-1000 Mbit/s. A window counts only if no other lane of
// the communicator sent to the peer during it (lanes share the path: a lane that ran
// beside three others sees a quarter of it).
//
// The op's sample is its fastest counted window. A first estimate needs an op that filled
// the pipe: a queue on the path at one of its windows or at its end (a stream's smoothed RTT
// above kPaceQueueRtt x the smallest RTT any of them has seen, plus a millisecond), a rate
// that stopped growing (kPacePlateauWindows windows in a row that did not raise it by
// kPacePlateauGrowth: BBR's full-pipe test), and a window in which most streams' samples
// were not app-limited (tcpi_delivery_rate_app_limited). Its value is the third quartile
// of the windows from the plateau on (never below kPaceFloor x the fastest): loss recovery
// acknowledges bursts, so the fastest window reads up to 10 % high, and the median read
// 80 % of an emulated 100 Mbit/s link (a paced op's windows spread by 10-20 %). A queue alone does not
// do: in an all-reduce the ACKs queue behind the peer's own data, so a queue shows on a
// stream that is still starting up, and a cap from that (a few MB/s) would hold every later
// op there (measured earlier: a 64 MiB all-reduce at 9 % of the link).
//
// Later ops move it. Lower: an op that filled the pipe and retransmitted more than
// kPaceLossShare of its segments overran the path (random loss drops 10-100x fewer), so
// the estimate goes to that op's third quartile, at most kPaceFloor lower per op. A queue alone
// lowers nothing: it may be the reverse direction's (one rank's estimate fell to 63-75 %
// of a 100 Mbit/s link that way). Higher: a cap at the estimate never shows whether the
// path got faster, so ops probe, as BBR's ProbeBW does within a connection. Every
// kPaceProbeEvery-th collective of a lane runs at a cap kPaceGrow x higher; the lane's
// collective number is the same on every rank, so every rank of a ring probes in the same
// op (a rank probing alone is held by its neighbours' caps). The probe's typical window is
// the median, past the first, of the windows that were not app-limited (not its fastest,
// nor its third quartile: windows read up to 10-18 % high, which ratcheted the estimate up
// above a steady path). If it carried at least kPaceProbeTaken of the extra, the estimate rises to it
// (never above the raised cap) and the next op probes again at kPaceGrow^2, and so on:
// kPaceGrow^k for the k-th successful probe in a row. An op that ran at kPaceCapBound of
// its plain cap over kPaceGrowWindows windows without loss makes the next op a probe too
// (a first estimate from a lossy op reads ~80 % of the path: this lifts it within the
// group's warm-up; such an op is seen alike by the ranks of a symmetric path). A path that doubled is followed in
// ~4 probes (x1.1, 1.21, 1.33, 1.46: x2.6), the first within kPaceProbeEvery ops. A
// probe the path held ends the run (it still raises the estimate to what it carried, up
// to the raised cap; one that lost leaves it); on a steady path one op in
// kPaceProbeEvery runs ~10 % over it, which the path's queue absorbs. (A queue seen on
// the path cannot tell "at the rate" from "below it": with four streams' GSO bursts the
// smoothed RTT jitters by 5-35 % on an emulated 200 Mbit/s link that a 100 Mbit/s cap
// leaves half empty.) The cap is kPaceHeadroom x the estimate (a delivery rate counts
// payload, the pacing rate the headers too), split evenly over the streams. No estimate,
// no cap.
//
// Where the first estimate comes from: torch_pccl warms every lane of a new striped group
// up with a few all-reduces of growing size, one lane after another (core/warmup.py), and
// the first lane's ops overrun the path once, which shows the queue and the rate.
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

struct pcclComm;

namespace pccl {

constexpr double kPaceHeadroom = 1.05; // cap / estimate: what the headers add to the payload rate
constexpr double kPaceQueueRtt = 1.1;  // smoothed RTT / minimum RTT that shows a queue
constexpr double kPacePlateauGrowth = 1.25;  // windows that grew less than this ...
constexpr int kPacePlateauWindows = 2;       // ... this many in a row: the pipe is full
constexpr double kPaceLossShare = 0.002;  // retransmitted / sent segments that say "overrun"
constexpr double kPaceFloor = 0.75;    // a lossy op lowers the estimate to >= this x
constexpr double kPaceCapBound = 0.99;  // an op this close to its plain cap, without loss,
constexpr int kPaceGrowWindows = 3;     // over at least this many windows, makes the next probe
constexpr uint64_t kPaceProbeEvery = 3;  // and every this many collectives of a lane probe ...
constexpr double kPaceGrow = 1.1;         // ... at a cap this ^ (probes in a row) higher,
constexpr int kPaceProbeWindows = 2;      // judged when they counted more windows than this:
constexpr double kPaceProbeTaken = 0.25;  // this share of the extra taken raises the estimate
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
    // Per peer: the lanes' operations now measuring the streams to it, and how many have
    // started in all (so a window can tell whether another lane sent beside it).
    std::vector<int> sending;
    std::vector<uint64_t> started;
    std::vector<int> streak;  // per peer: probes in a row that raised the estimate
    std::vector<char> due;    // per peer: the last op ran at its plain cap: probe next

    explicit Pacing(int world_size)
        : estimate(size_t(world_size), 0.0), sending(size_t(world_size), 0),
          started(size_t(world_size), 0), streak(size_t(world_size), 0),
          due(size_t(world_size), 0) {}
};

// The next estimate of a peer (bytes per second) from the current one, an op's sample
// (its fastest counted window; once the pipe was full, or for a probe, its typical one;
// <= 0: none) and the cap the op ran under (0: none).
// `full`: the op filled the path (a first estimate needs it); `lossy`: the path dropped
// the op's segments in windows it held the streams (the estimate may go down); `probed`:
// the op ran at a probe's raised cap; `streak` (in, out): the probes in a row that raised
// the estimate.
double next_estimate(double estimate, double sample, double cap, bool full, bool lossy,
                     bool probed, int *streak);

// The factor over the plain cap of a lane's collective number `seq` (equal on every
// rank) for a peer's estimate, streak and whether a probe is due (Pacing::due): > 1 when
// the op probes for more.
double probe_gain(uint64_t seq, double estimate, int streak, bool due);

// The cap on a peer's streams together, bytes per second, for a mode, an estimate and a
// probe gain; 0: no cap.
double peer_cap(int64_t mode, double estimate, double gain);

// The smallest RTT the kernel saw on comm's striped streams to peer, seconds (0: none or
// no TCP_INFO); the caller holds comm's op lock.
double min_rtt_s(pcclComm *comm, int peer);

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

    // Folds this op's samples into the shared estimates (when measured) and the comm's
    // last_rate.
    void finish();

    // Ends the op's share of the path (every op, failed or not).
    ~RateProbe();
    RateProbe(const RateProbe &) = delete;
    RateProbe &operator=(const RateProbe &) = delete;

private:
    // A peer's streams, from TCP_INFO.
    struct Counters {
        std::vector<uint64_t> acked;  // per stream: tcpi_bytes_acked
        double rate = 0.0;  // bytes/s: delivery rates of the streams acked since `prev`
        int fresh = 0;      // those streams
        int held = 0;       // those of them whose sample was not app-limited
        uint64_t retrans = 0;  // segments retransmitted, all streams (tcpi_total_retrans)
        uint64_t segs = 0;     // segments sent, all streams (tcpi_segs_out)
        bool queue = false;  // a stream's smoothed RTT shows a queue on the path
        int64_t min_rtt_ms = kMinWindowMs;
    };
    struct Peer {
        bool active = false;
        int64_t last_us = 0;  // when `last` was read (CLOCK_MONOTONIC, µs)
        Counters last;
        int64_t window_ms = kMinWindowMs;
        double best = 0.0;    // bytes/s: the op's fastest counted window
        bool queued = false;  // a window of the op, or its end, showed a queue on the path
        int windows = 0;      // counted windows
        int held_windows = 0; // counted windows in which the path held most streams
        uint64_t first_retrans = 0;  // Counters::retrans when the op started
        uint64_t first_segs = 0;     // Counters::segs when the op started
        bool lost = false;    // the streams retransmitted during the op
        int flat = 0;         // counted windows in a row that did not raise `best` by 25 %
        std::vector<double> full_rates;  // the rates of the windows since the pipe was full
        std::vector<double> rates;       // the rates of the held windows
        double cap = 0.0;   // the cap this op ran under, bytes per second (0: none)
    };
    // Every peer's cap now (peer_cap of the shared state), and the mode, under its lock;
    // with `probes`, for collective `seq`, probe gains included and (*probes)[peer] set
    // where the peer is probed.
    std::vector<double> caps(int64_t *mode, uint64_t seq, std::vector<char> *probes) const;
    // Sets caps[peer] / S on each of the peer's streams where it changed.
    void apply_caps(const std::vector<double> &caps);
    // Sets cap / S (bytes/s; 0: none) on each of peer's streams where it changed.
    void set_cap(size_t peer, double cap);
    // Reads the peer's streams; `prev` (may be null) is the last reading, whose acked
    // counts tell which streams have a fresh delivery-rate sample.
    bool read(int peer, const Counters *prev, Counters *out) const;
    // Whether another lane's op measured the peer's streams since this op's last window.
    bool shared(int peer);

    pcclComm *comm_;
    std::vector<Peer> peers_;
    std::vector<char> counted_;   // peers this op added to Pacing::sending
    std::vector<uint64_t> seen_;  // per peer: Pacing::started at the last window
    std::vector<char> probes_;    // per peer: this op probes it (a raised cap)
    int64_t mode_ = 0;            // Pacing::mode when the op started
    int64_t next_ = INT64_MAX;
};

}  // namespace pccl
