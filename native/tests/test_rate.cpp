// The rate controller (src/rate.hpp) on its own: deterministic, no sockets, no clocks.
//
// Two kinds of input:
// - a model path in closed loop (PathModel): a bottleneck of a given rate, what the
//   streams send bounded by the controller's cap (or doubling per window with none, TCP's
//   start-up), delivered one window later; its cases put one thing wrong at a time (noise
//   on the delivery counter, random loss, a host stall, a rate halved or doubled);
// - windows recorded through the WAN emulator (native/tests/traces/*.csv, written with
//   PCCL_RATE_TRACE by benchmarks/rate_traces.py; their README says how and when), fed in
//   open loop: what the streams did under the caps of that run.
//
//   test_rate TRACE_DIR
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "expect.hpp"
#include "pacing.hpp"
#include "rate.hpp"

using pccl::rate::Controller;
using pccl::rate::Window;

namespace {

constexpr double kWin = 0.1;       // seconds per window (a 100 ms path)
constexpr double kMbit = 1e6 / 8;  // bytes/s

// A deterministic source of noise in [0, 1).
struct Lcg {
    uint64_t s = 12345;
    double next() {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        return double(s >> 11) / double(1ull << 53);
    }
};

// A bottleneck of `rate` bytes/s behind S streams, one op after another. With no cap the
// streams double what they send per window (start-up) up to what their windows hold.
struct PathModel {
    double rate;
    double noise = 0;        // share of a window's ACKs that bunch into the next one, at most
    double loss = 0;         // share of what is sent retransmitted
    int stall_at = -1;       // window (counted over all ops) in which the host stalls
    Lcg lcg;
    double sent_prev = 0, own = 0.15 * kMbit * kWin;  // bytes a start-up window sends
    double carried = 0;      // delivered bytes whose ACKs bunched into the next window
    double backlog = 0;      // bytes queued at the bottleneck
    int window = 0;

    // One op of `windows` windows; returns the caps the controller gave.
    std::vector<double> op(Controller &c, int windows, int stripe = 4) {
        std::vector<double> caps;
        double cap = c.begin_op(stripe, stripe).cap;
        for (int k = 0; k < windows; ++k, ++window) {
            caps.push_back(cap);
            double want = cap > 0 ? cap * kWin / pccl::rate::kHeadroom : (own *= 2.0);
            double sent = std::min(want, rate * 1.5 * kWin);  // a queue takes a burst
            double delivered = std::min(sent_prev, rate * kWin);
            Window w;
            w.seconds = kWin;
            if (window == stall_at) {
                delivered = sent = 0;           // nothing moves while the host stalls
            } else if (window == stall_at + 1) {
                delivered = 2 * rate * kWin;    // the stalled queue's ACKs all at once
            }
            const double late = noise * lcg.next() * delivered;
            w.delivered = delivered - late + carried;
            carried = late;
            w.sent = sent;
            w.retrans = loss * sent;
            backlog = std::max(0.0, backlog + sent - rate * kWin);
            w.queue = backlog / rate;
            sent_prev = sent;
            cap = c.on_window(w);
        }
        c.end_op();
        sent_prev = 0;
        backlog = 0;  // drained while the op's tail is delivered and the path idles
        return caps;
    }
};

bool near(double x, double want, double share) { return std::fabs(x - want) <= share * want; }

void fresh_path_starts_up_then_holds_the_rate() {
    Controller c;
    PathModel p{200 * kMbit};
    EXPECT(c.begin_op(4, 4).cap == 0);  // nothing measured: no cap
    c.end_op();
    int ops = 0;
    while (!c.filled() && ops < 20) {
        p.op(c, 6);
        ++ops;
    }
    EXPECT(c.filled());
    EXPECT(ops <= 4);  // ~10 windows of start-up
    EXPECT(near(c.bandwidth(), p.rate, 0.05));
    // From then on the cap at gain 1 never binds below the path, and no cap is more than
    // a probe above it.
    int drains = 0;
    for (int i = 0; i < 10; ++i)
        for (double cap : p.op(c, 6)) {
            // A drain window runs at 0.75 x: it empties what the probe before it queued.
            EXPECT(cap >= 0.75 * p.rate && cap <= pccl::rate::kHeadroom * 1.25 * 1.06 * p.rate);
            if (cap < p.rate) ++drains;
        }
    EXPECT(near(c.bandwidth(), p.rate, 0.06));
    EXPECT(drains <= 2 * 10);  // two per probe, one probe per 6-window op
}

void one_stream_is_never_capped() {
    Controller c;
    PathModel p{100 * kMbit};
    for (int i = 0; i < 5; ++i)
        for (double cap : p.op(c, 6, 1)) EXPECT(cap == 0);
}

void noise_on_the_counter_does_not_lift_the_estimate() {
    Controller c;
    PathModel p{200 * kMbit};
    p.noise = 0.4;  // a window reads up to 40 % low, the next one as much high (recorded)
    for (int i = 0; i < 20; ++i) p.op(c, 6);
    // Two windows sum what bunching moved between them, and deliveries are bounded by
    // what was sent: +40 % readings do not raise it.
    EXPECT(c.bandwidth() <= 1.1 * p.rate);
    EXPECT(c.bandwidth() >= 0.95 * p.rate);
}

void random_loss_does_not_lower_the_estimate() {
    Controller c;
    PathModel p{200 * kMbit};
    for (int i = 0; i < 5; ++i) p.op(c, 6);
    const double before = c.bandwidth();
    p.loss = 0.0001;
    for (int i = 0; i < 20; ++i) p.op(c, 6);
    EXPECT(c.bandwidth() >= 0.98 * before);
}

void a_stall_neither_inflates_nor_sinks_the_estimate() {
    Controller c;
    PathModel p{200 * kMbit};
    for (int i = 0; i < 5; ++i) p.op(c, 6);
    const double before = c.bandwidth();
    p.stall_at = p.window + 2;
    p.op(c, 6);
    p.op(c, 6);
    EXPECT(c.bandwidth() <= 1.1 * before);  // the burst of ACKs is not a faster path
    EXPECT(c.bandwidth() >= 0.95 * before);  // nor is the silent window a slower one
}

void a_halved_link_is_followed_within_three_ops() {
    Controller c;
    PathModel p{200 * kMbit};
    for (int i = 0; i < 8; ++i) p.op(c, 6);
    p.rate /= 2;
    // Ops at half the rate take twice the windows.
    for (int i = 0; i < 3; ++i) p.op(c, 12);
    EXPECT(near(c.bandwidth(), p.rate, 0.10));
}

void a_doubled_link_is_found_within_three_ops() {
    Controller c;
    PathModel p{200 * kMbit};
    for (int i = 0; i < 8; ++i) p.op(c, 6);
    p.rate *= 2;
    for (int i = 0; i < 3; ++i) p.op(c, 6);  // at the old cap an op is still 6 windows
    EXPECT(near(c.bandwidth(), p.rate, 0.10));
}

void every_rank_probes_in_the_same_window() {
    // The gain is a function of the window's index in the op alone: two ranks with any
    // histories (here, different rates and one losing 5 %) probe and drain together.
    Controller a, b;
    PathModel pa{200 * kMbit}, pb{150 * kMbit};
    pb.loss = 0.05;
    for (int i = 0; i < 6; ++i) {
        pa.op(a, 6);
        pb.op(b, 6);
    }
    std::vector<double> ca, cb;
    ca.push_back(a.begin_op(4, 4).cap);
    cb.push_back(b.begin_op(4, 4).cap);
    for (int k = 0; k < 8; ++k) {
        Window unmeasured;  // no sample: the caps show the gains alone
        ca.push_back(a.on_window(unmeasured));
        cb.push_back(b.on_window(unmeasured));
    }
    for (size_t k = 0; k < ca.size(); ++k) {
        EXPECT(near(ca[k] / ca[0], pccl::rate::gain_at(int(k)), 1e-9));
        EXPECT(near(cb[k] / cb[0], pccl::rate::gain_at(int(k)), 1e-9));
    }
}

// Runs ops of 6 windows on a path whose stripe of S streams carries carried(S) bytes per
// window; returns the stripes the controller chose, op by op.
template <class F>
std::vector<int> climb(Controller &c, int fewest, int most, int ops, F carried) {
    std::vector<int> seen;
    for (int op = 0; op < ops; ++op) {
        const int stripe = c.begin_op(fewest, most).stripe;
        seen.push_back(stripe);
        for (int k = 0; k < 6; ++k) {
            Window w;
            w.seconds = kWin;
            w.sent = w.delivered = carried(stripe);
            c.on_window(w);
        }
        c.end_op();
    }
    return seen;
}

void a_wider_stripe_is_kept_only_when_it_carries_more() {
    // Window-bound: each stream carries at most 40 Mbit/s on a 1 Gbit/s path.
    Controller c;
    auto bound = climb(c, 4, 12, 120, [](int s) { return std::min(1000.0, 40.0 * s) * kMbit * kWin; });
    EXPECT(bound.front() == 4);
    EXPECT(bound.back() == 12);  // 4 -> 6 -> 9 -> 12: each carried 8 % more
    // Path-bound: a wider stripe carries no more; each trial is taken back, and the trials
    // space out as they keep failing.
    Controller d;
    auto flat = climb(d, 4, 12, 120, [](int) { return 100.0 * kMbit * kWin; });
    EXPECT(flat.back() == 4);
    int wide = 0;
    for (int s : flat) wide += s > 4;
    EXPECT(wide >= 1 && wide <= 3);
    // Pinned: never moves.
    Controller e;
    for (int s : climb(e, 6, 6, 20, [](int s) { return 40.0 * s * kMbit * kWin; })) EXPECT(s == 6);
}

void the_stripe_starts_at_the_bandwidth_delay_product() {
    // 1 Gbit/s at 100 ms holds 12.5 MB; a stream 3 MB: 1.4 x 12.5 / 3 -> 6 streams.
    Controller c;
    PathModel p{1000 * kMbit};
    while (!c.filled()) p.op(c, 8);
    EXPECT(c.begin_op(4, 12, 0.1, 3e6).stripe == 6);
    c.end_op();
    // A path three times as long asks for more, without a trial.
    EXPECT(c.begin_op(4, 12, 0.3, 3e6).stripe == 12);
    c.end_op();
}

// --------------------------------------------------------------- recorded traces

struct Row {
    int op, index;
    Window w;
    int stripe;
    double cap;
    bool shared;
};

std::vector<Row> load(const std::string &path) {
    std::vector<Row> rows;
    FILE *f = fopen(path.c_str(), "r");
    if (!f) {
        fprintf(stderr, "cannot open %s\n", path.c_str());
        ++failures;
        return rows;
    }
    char line[512];
    if (!fgets(line, sizeof line, f)) line[0] = 0;  // the header
    while (fgets(line, sizeof line, f)) {
        Row r{};
        char key[64];
        int app = 0, shared = 0;
        unsigned srtt = 0, min_rtt = 0;
        double spot = 0;
        if (sscanf(line, "%63[^,],%d,%d,%lf,%lf,%lf,%lf,%d,%d,%lf,%lf,%u,%u,%d", key, &r.op,
                   &r.index, &r.w.seconds, &r.w.delivered, &r.w.sent, &r.w.retrans, &app,
                   &r.stripe, &r.cap, &spot, &srtt, &min_rtt, &shared) != 14)
            continue;
        if (min_rtt > 0 && srtt > min_rtt) r.w.queue = double(srtt - min_rtt) * 1e-6;
        r.w.app_limited = app != 0;
        r.shared = shared != 0;
        rows.push_back(r);
    }
    fclose(f);
    return rows;
}

// What a trace does to a new controller, op by op.
struct Replayed {
    int op;
    int windows;           // measured windows of the op
    double bandwidth;      // after the op, bytes/s
    double delivered;      // the op's median delivery rate over its busy windows, bytes/s
    bool filled;
};

std::vector<Replayed> replay(const std::vector<Row> &rows) {
    Controller c;
    std::vector<Replayed> out;
    std::vector<double> rates;
    int op = -1, windows = 0;
    auto close = [&] {
        c.end_op();
        std::sort(rates.begin(), rates.end());
        out.push_back({op, windows, c.bandwidth(), rates.empty() ? 0 : rates[rates.size() / 2],
                       c.filled()});
        rates.clear();
        windows = 0;
    };
    for (const Row &r : rows) {
        if (r.op != op) {
            if (op >= 0) close();
            op = r.op;
            c.begin_op(r.stripe, r.stripe);
        }
        Window w = r.w;
        if (r.shared) w.seconds = 0;
        if (w.seconds > 0 && !w.app_limited) rates.push_back(w.delivered / w.seconds);
        windows += w.seconds > 0;
        c.on_window(w);
    }
    if (op >= 0) close();
    return out;
}

// The ops of a trace that carried a tensor over several windows (the all-reduces, not the
// barriers and votes).
std::vector<Replayed> large(const std::vector<Replayed> &ops) {
    std::vector<Replayed> out;
    for (const Replayed &r : ops)
        if (r.windows >= 4) out.push_back(r);
    return out;
}

constexpr double kPayload = 1448.0 / 1500.0;  // payload per byte on the wire

void recorded_fresh_path(const std::string &dir) {
    // 1 Gbit/s, 100 ms: a new group, then 8 all-reduces of 64 MiB.
    const auto ops = large(replay(load(dir + "/fresh.csv")));
    EXPECT(ops.size() >= 8);
    if (ops.empty()) return;
    const double link = 1000 * kMbit * kPayload;
    EXPECT(ops.back().filled);
    EXPECT(ops.back().bandwidth >= 0.85 * link && ops.back().bandwidth <= 1.1 * link);
}

void recorded_loss_never_lowers(const std::string &dir) {
    // 0.01 % random loss: once filled, the estimate never falls below 95 % of its best.
    const auto ops = large(replay(load(dir + "/loss.csv")));
    double best = 0;
    int filled = 0;
    for (const Replayed &r : ops) {
        if (!r.filled) continue;
        ++filled;
        best = std::max(best, r.bandwidth);
        EXPECT(r.bandwidth >= 0.95 * best);
    }
    EXPECT(filled >= 4);
    EXPECT(best >= 0.85 * 1000 * kMbit * kPayload);
}

void recorded_stall(const std::string &dir) {
    // The forwarder stopped for 0.3 s in an op: its ACKs came in a burst after it.
    const auto ops = large(replay(load(dir + "/stall.csv")));
    const double link = 1000 * kMbit * kPayload;
    for (const Replayed &r : ops)
        if (r.filled) EXPECT(r.bandwidth <= 1.1 * link && r.bandwidth >= 0.8 * link);
}

// The index of the first large op after `from` whose delivery ran below `share` of the
// estimate before it: where the link changed.
size_t change_at(const std::vector<Replayed> &ops, double share, bool lower) {
    for (size_t i = 1; i < ops.size(); ++i) {
        const double before = ops[i - 1].bandwidth;
        if (lower ? ops[i].delivered < share * before : ops[i].delivered > share * before)
            return i;
    }
    return ops.size();
}

void recorded_halved(const std::string &dir) {
    // 1 Gbit/s for 6 ops, then 500 Mbit/s for 6: within 10 % of it within 3 ops.
    const auto ops = large(replay(load(dir + "/halved.csv")));
    const size_t at = change_at(ops, 0.7, true);
    EXPECT(at + 3 <= ops.size());
    if (at + 3 > ops.size()) return;
    const double link = 500 * kMbit * kPayload;
    bool found = false;
    for (size_t i = at; i < at + 3; ++i) found = found || near(ops[i].bandwidth, link, 0.10);
    EXPECT(found);
    EXPECT(near(ops.back().bandwidth, link, 0.10));
}

void recorded_doubled(const std::string &dir) {
    // 500 Mbit/s for 6 ops, then 1 Gbit/s: each stream's own BBR finds the room with its
    // 1.25x probes, one every eight round trips; the estimate follows what they carry:
    // >= 1.5x within 4 ops, never past the new link by more than 10 %.
    const auto ops = large(replay(load(dir + "/doubled.csv")));
    const size_t at = change_at(ops, 1.15, false);
    EXPECT(at >= 2 && at + 4 <= ops.size());
    if (at < 2 || at + 4 > ops.size()) return;
    const double before = ops[at - 1].bandwidth;
    EXPECT(ops[at + 3].bandwidth >= 1.5 * before);
    for (const Replayed &r : ops) EXPECT(r.bandwidth <= 1.1 * 1000 * kMbit * kPayload);
}

}  // namespace

// A path's first windows come from small ops that run dry (an 8-byte all-reduce): their
// samples are not the path's, and must not put a cap on it; after busy samples gave it an
// estimate, an app-limited window above it may still raise it.
void a_small_op_does_not_cap_a_fresh_path() {
    Controller c;
    for (int op = 0; op < 3; ++op) {
        EXPECT(c.begin_op(4, 4).cap == 0);
        Window w;
        w.seconds = kWin;
        w.delivered = w.sent = 160;     // 1.6 kB/s: what a small op delivered
        w.app_limited = true;
        for (int k = 0; k < 3; ++k) EXPECT(c.on_window(w) == 0);
        c.end_op();
    }
    EXPECT(c.bandwidth() == 0 && c.cap() == 0);
    PathModel p{200 * kMbit};
    for (int i = 0; i < 5; ++i) p.op(c, 6);
    const double bw = c.bandwidth();
    EXPECT(bw > 100 * kMbit);
    c.begin_op(4, 4);
    Window fast;
    fast.seconds = kWin;
    fast.delivered = fast.sent = 2.0 * bw * kWin;
    fast.app_limited = true;
    for (int k = 0; k < 3; ++k) c.on_window(fast);
    EXPECT(c.bandwidth() > 1.5 * bw);  // a faster app-limited window still raises it
}

// RateProbe's rule for a window that is not the path's: another op on the path at the
// window's end, or one that started or ended during it. Before the end counted, an op that
// overlapped another took the windows after the other's end (paced at half the cap until
// its next window) as the path's rate, and the estimate sank op after op.
void a_window_is_shared_when_another_op_starts_or_ends_in_it() {
    pccl::Path path;
    pccl::path_sending(path, +1);          // op A starts
    uint64_t seen = path.changes;
    EXPECT(!pccl::window_shared(path, seen));      // A alone: a sample
    pccl::path_sending(path, +1);          // B starts during A's next window
    EXPECT(pccl::window_shared(path, seen));
    seen = path.changes;
    EXPECT(pccl::window_shared(path, seen));       // both measuring: shared
    pccl::path_sending(path, -1);          // B ends: A alone again, but paced at half
    EXPECT(path.sending == 1);
    EXPECT(pccl::window_shared(path, seen));       // the window B ended in is not a sample
    seen = path.changes;
    EXPECT(!pccl::window_shared(path, seen));      // the next one is
    pccl::path_sending(path, -1);
    EXPECT(path.sending == 0);
}

int main(int argc, char **argv) {
    fresh_path_starts_up_then_holds_the_rate();
    one_stream_is_never_capped();
    noise_on_the_counter_does_not_lift_the_estimate();
    random_loss_does_not_lower_the_estimate();
    a_stall_neither_inflates_nor_sinks_the_estimate();
    a_halved_link_is_followed_within_three_ops();
    a_doubled_link_is_found_within_three_ops();
    every_rank_probes_in_the_same_window();
    a_wider_stripe_is_kept_only_when_it_carries_more();
    the_stripe_starts_at_the_bandwidth_delay_product();
    a_window_is_shared_when_another_op_starts_or_ends_in_it();
    a_small_op_does_not_cap_a_fresh_path();
    if (argc > 1) {
        const std::string dir = argv[1];
        recorded_fresh_path(dir);
        recorded_loss_never_lowers(dir);
        recorded_stall(dir);
        recorded_halved(dir);
        recorded_doubled(dir);
    }
    return report("test_rate");
}
