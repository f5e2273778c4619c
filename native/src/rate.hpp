// The rate controller of one path: what the striped streams to one peer may send together.
// A pure state machine: no sockets, no clocks. The engine's RateProbe (pacing.hpp) reads
// the streams' TCP_INFO once per window of an op, turns the counters into a `Window`, and
// applies the cap this returns; the unit tests (native/tests/test_rate.cpp) feed it
// windows recorded through the WAN emulator instead.
//
// Why a cap at all: S TCP streams to one peer each run their own congestion control
// (BBR here). Between operations they go idle and come back with bandwidth estimates of
// their own that add up to more than the path carries, so an op's start overflows the
// bottleneck's queue (measured on an emulated 1 Gbit/s, 100 ms link: ~7,000 retransmitted
// segments per op and 54 % of the link, against 86 % with every stream capped at its
// share; docs/performance.md). The cap must follow the path, never bind below it, and
// never be the thing measured.
//
// How (BBR's model, Cardwell et al., ACM Queue 14(5), 2016; net/ipv4/tcp_bbr.c), applied
// to the stripe as one flow:
// - Signal: integrated delivery. A sample is the bytes the peer acknowledged in two
//   consecutive windows (segments delivered, SACKed ones included, times the MSS: a filled
//   hole does not show as a burst) over their length, bounded by what the streams sent in
//   the two windows before each (a window is about one round trip, so that is what was
//   delivered). Two windows, because ACKs bunched at a window's edge move bytes from one
//   window to the next (adjacent windows read -40 % / +40 % through the emulator); the
//   bound is BBR's send-interval rule: after a stall (a busy host, a stalled forwarder) a
//   queue drains at once and its ACKs come bunched, but nothing was sent faster than the
//   cap allowed.
// - Bandwidth: the max of the samples from windows that had bytes to send (a window the op
//   ran dry in can only raise it) over the last kBwWindows of them and at least kBwSeconds
//   of their time (BBR's 10 round trips alone let a loss episode of a second, a stalled
//   host or forwarder, push the path's rate out of the filter), kept across ops, lanes, idle time and
//   epochs (the registry in pacing.cpp keys it by the peer's address). Loss never lowers
//   it: random loss is not congestion, and a path that got slower shows as lower samples
//   that push the old max out of the filter within kBwSeconds of busy time.
// - Start-up: a path never measured starts as BBR's Startup does: the cap is kStartupGain
//   x the bandwidth (what lets the delivery rate double each round trip), until three busy
//   windows in a row raised the bandwidth by less than kFullGrowth (BBR's full-pipe test).
//   A cap from the first windows of a fresh connection would hold every later op there.
// - Probing: a gain cycle on the window index within the op, after BBR's ProbeBW gains
//   [1.25, 0.75, 1, 1, 1, 1, 1, 1]: here [1, 1.25, 1.25, 0.75, 0.75, 1] from the op's first
//   window. A probe spans two windows because a sample does (one window of 1.25 averaged
//   with its neighbour reads 1.125); two drain windows empty what it queued; the cycle is
//   shorter than BBR's because an op of 64 MiB at 1 Gbit/s is five windows at 100 ms and
//   a path that doubled must be found within a few ops. A drain window runs at gain 1
//   when the window before it ended with no queue on the path (at most kQueueSlack of a
//   window): the probe found room, and draining would only idle the path (two windows
//   at 0.75 cost 8 % of such an op through the emulator). The index counts
//   from the op's start on every rank, and ranks of a ring start an op within a one-way
//   delay of each other, so every rank probes in the same window of the same op (a rank
//   probing alone is held back by its neighbours). A probe lasts two windows, so loss in
//   it ends it without a rule of its own.
// - Cap: kHeadroom x bandwidth x gain. The streams' own BBR runs under it and paces each
//   at about its share of the path; the cap is there for an op's start, when streams back
//   from idle would together send more than the path holds, and must never bind below the
//   path: a cap at 1.05 x the estimate (headers over payload) was what the streams then
//   delivered, their BBR learned that, and estimate, cap and BBR held each other at
//   40-70 % of an emulated 1 Gbit/s link, climbing a few % per op (the samples read ~92 %
//   of the payload rate, and each stream's BBR probes in its own round trips, not in the
//   cap's probe windows). At 1.25 x the same link ran at 70-83 % with no tail drop.
//   No bandwidth yet, or a stripe of one stream: no cap.
// - Stripe: the sender's alone (a receiver reads every connected stream, native/src/
//   deal.hpp), so no rank has to agree with another. Once the pipe was found full, it
//   starts at what the bandwidth-delay product needs (kStripeMargin x bandwidth x minimum
//   RTT over what one stream holds in flight), and again whenever that need grows past
//   kStripeStep x the stripe (a longer or faster path) or falls by kStripeStep: a stream
//   new to the stripe starts cold, so small steps cost more than they give. A stripe
//   whose streams held kWindowBound of their windows in flight was held by them, not by
//   the path: its need is kStripeStep x wider. From there a hill climb on what each stripe
//   carried (the GridFTP literature's way of choosing a stream count): an op that ran at
//   least kStripeWindows busy windows scores its stripe with its median sample; every
//   kStripeTrialEvery-th scored op (rarely: a trial's new streams start cold) tries a wider stripe (x kStripeStep, within the
//   bounds), kept when it carried at least kStripeGain more; a stripe that carries
//   kStripeGain less than a narrower one did goes back to it, never below the need. Failed trials space the
//   next ones out (x2, up to kStripeTrialMax scored ops).
#pragma once

#include <cstdint>
#include <vector>

namespace pccl {
namespace rate {

constexpr int kBwWindows = 10;         // the bandwidth filter's length: at least this many busy
constexpr double kBwSeconds = 1.0;     // windows and this many seconds of them
constexpr double kHeadroom = 1.25;     // cap / bandwidth at gain 1 (see the cap above)
constexpr double kStartupGain = 2.885;  // 2 / ln 2: BBR's Startup, doubling per round trip
constexpr double kFullGrowth = 1.25;   // growth per busy window that says "still starting up"
constexpr int kFullWindows = 3;        // busy windows without it: the pipe is full
constexpr int kCycleLength = 6;
constexpr double kProbeGain = 1.25;
constexpr double kDrainGain = 0.75;
constexpr double kQueueSlack = 0.1;    // a queue this share of a window is no queue
constexpr int kStripeWindows = 3;      // busy windows an op needs to score its stripe
constexpr int kStripeTrialEvery = 16;  // scored ops between two trials of a wider stripe ...
constexpr int kStripeTrialMax = 64;    // ... doubled after each failed trial, up to this
constexpr double kStripeStep = 1.5;    // a trial's stripe / the current one
constexpr double kStripeGain = 1.08;   // what a wider stripe must carry more to be kept
constexpr double kStripeMargin = 1.4;  // streams for this x the bandwidth-delay product
constexpr double kWindowBound = 0.8;   // in flight / the stripe's windows that says "held by them"

// One window of an op, as the streams of the stripe saw it together.
struct Window {
    double seconds = 0;     // the window's length, > 0
    double delivered = 0;   // bytes the peer acknowledged in it (SACKed ones included)
    double sent = 0;        // new bytes the streams put on the path in it (not retransmitted)
    double retrans = 0;     // bytes retransmitted in it
    bool app_limited = false;  // the op ran out of bytes for the path during it
    double queue = 0;       // seconds of queue on the path at its end (smoothed RTT - minimum)
};

// The gain of window `index` (0-based) of an op: BBR's ProbeBW cycle.
double gain_at(int index);

// The delivery-rate sample (bytes/s) that window `w` gives after the op's two measured
// windows before it, `prev` and `before` (seconds 0: none, and then no sample: 0): what
// prev and w delivered over their length, bounded by what before and prev sent (see
// "Signal" above).
double sample(const Window &before, const Window &prev, const Window &w);

// A path's controller. Not thread-safe: the registry's lock guards it.
class Controller {
public:
    // stripe: the streams an op stripes over now; bounds: (fewest, most) the stripe may
    // take (fewest == most: the stripe is pinned).
    Controller(int stripe = 1, int fewest = 1, int most = 1);

    // What an op starts with: the cap of its first window, bytes/s for all streams
    // together (0: none), and how many streams it deals its frames over.
    struct Start {
        double cap;
        int stripe;
    };
    // An op starts. Its stripe ranges over fewest .. most (equal: pinned); min_rtt is the
    // path's (seconds, 0: unknown) and stream_window what one stream holds in flight at most
    // (bytes), which give the stripe the bandwidth-delay product needs once the pipe was
    // found full; the hill climb goes on from there.
    Start begin_op(int fewest, int most, double min_rtt = 0, double stream_window = 0);
    // A window of the op ended; returns the cap of the next one.
    double on_window(const Window &w);
    // The op ended (succeeded): scores its stripe.
    void end_op();

    double bandwidth() const;     // bytes/s; 0: nothing measured yet
    bool filled() const { return filled_; }  // the start-up found the pipe full
    double cap() const;           // the cap at gain 1, bytes/s (0: none)
    // The stripe the next op deals over (bounded; the current one while nothing says
    // otherwise). The sender alone decides it: a receiver reads every connected stream.
    int proposed_stripe() const { return proposal_; }
    int windows_seen() const { return int(seen_); }

private:
    double cap_at(double gain) const;
    void bound(int fewest, int most);
    void set_stripe(int stripe);
    void take(double sample, bool busy, double seconds);

    struct Sample {
        double rate;      // bytes/s
        double at;        // busy seconds (busy_) when it was taken
    };
    std::vector<Sample> filter_;  // the busy samples of the filter's span, oldest first
    double busy_ = 0;             // seconds of busy windows, all ops
    double app_max_ = 0;          // app-limited samples above the filter (none before it has one)
    uint64_t seen_ = 0;           // samples taken, all ops
    bool filled_ = false;         // out of start-up
    double full_bw_ = 0;          // the bandwidth at the last kFullGrowth step
    int full_cnt_ = 0;            // busy windows since it
    // The op in progress.
    int index_ = 0;               // the next window's index in the op
    Window prev_, before_;        // the op's last two measured windows (seconds 0: none)
    bool queued_ = true;          // the last measured window ended with a queue
    std::vector<double> op_samples_;
    // The stripe's hill climb.
    int stripe_ = 1, fewest_ = 1, most_ = 1, proposal_ = 1;
    std::vector<double> score_;   // per stripe (index = streams): median rate it carried; 0: none
    int scored_ = 0;              // scored ops since the last trial
    int trial_every_ = kStripeTrialEvery;
    int trial_from_ = 0;          // > 0: this op is a trial, coming from that stripe
    int anchor_ = 0;              // the stripe the bandwidth-delay product asked for last
};

}  // namespace rate
}  // namespace pccl
