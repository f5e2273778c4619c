#include "pacing.hpp"

#include <netinet/in.h>
#include <linux/tcp.h>  // struct tcp_info with tcpi_bytes_acked (glibc's netinet/tcp.h lacks it)
#include <sys/socket.h>

#include <time.h>

#include <algorithm>
#include <cmath>
#include <climits>
#include <cstring>

#include "comm.hpp"
#include "socket.hpp"

namespace pccl {

namespace {
// Windows are tens of ms: their rates need a finer clock than the engine's milliseconds.
// The same clock as net::now_ms (CLOCK_MONOTONIC), so now_us() / 1000 is its reading.
int64_t now_us() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return int64_t(ts.tv_sec) * 1000000 + ts.tv_nsec / 1000;
}

// TCP_INFO of a stream; false when it has none or the kernel predates the fields read
// here (4.1 .. 4.19 return a shorter struct, without tcpi_bytes_sent).
bool read_tcp_info(int fd, tcp_info *ti) {
    std::memset(ti, 0, sizeof(*ti));
    socklen_t len = sizeof(*ti);
    return fd >= 0 && getsockopt(fd, IPPROTO_TCP, TCP_INFO, ti, &len) == 0 &&
           len >= offsetof(tcp_info, tcpi_bytes_sent) + sizeof(ti->tcpi_bytes_sent);
}

int64_t window_for(int64_t min_rtt_ms) {
    return std::min(kMaxWindowMs, std::max(kMinWindowMs, min_rtt_ms));
}

// The q-quantile (0 .. 1) of a non-empty set of window rates.
double quantile(std::vector<double> rates, double q) {
    const size_t k = std::min(rates.size() - 1, size_t(double(rates.size()) * q));
    std::nth_element(rates.begin(), rates.begin() + std::ptrdiff_t(k), rates.end());
    return rates[k];
}

// When a window that started at start_us is due, on the engine's millisecond clock
// (rounded up: polling a millisecond early would find the window unfinished).
int64_t due_ms(int64_t start_us, int64_t window) { return (start_us + 999) / 1000 + window; }
}  // namespace

double next_estimate(double estimate, double sample, double cap, bool full, bool lossy,
                     bool probed, int *streak) {
    if (!(sample > 0)) return estimate;
    if (!(estimate > 0)) return full ? sample : 0.0;
    if (lossy) {  // the path dropped what the cap let through: it carries the sample
        *streak = 0;
        // A probe's raised cap overran the path, which says nothing against the estimate.
        if (probed) return estimate;
        return std::max(std::min(sample, estimate), kPaceFloor * estimate);
    }
    if (!probed) return estimate;
    // A probe's cap is estimate x headroom x gain: the path took a share of the extra.
    const double raised = cap / kPaceHeadroom;
    // Below it, the path (or a neighbour) held the probe: the run ends, but what it carried
    // above the cap it would have had is still the path's.
    *streak = sample >= estimate + kPaceProbeTaken * (raised - estimate) ? *streak + 1 : 0;
    return std::max(estimate, std::min(sample, raised));
}

double probe_gain(uint64_t seq, double estimate, int streak, bool due) {
    if (!(estimate > 0) || (streak == 0 && !due && seq % kPaceProbeEvery != 0)) return 1.0;
    return std::pow(kPaceGrow, streak + 1);
}

double peer_cap(int64_t mode, double estimate, double gain) {
    if (mode == 0) return 0;
    if (mode > 0) return double(mode);
    return estimate > 0 ? estimate * kPaceHeadroom * gain : 0;
}

double min_rtt_s(pcclComm *comm, int peer) {
    const size_t S = size_t(comm->stripe), stride = size_t(comm->streams);
    uint32_t best = UINT32_MAX;
    for (size_t k = 0; k < S && size_t(peer) * stride + k < comm->links.size(); ++k) {
        tcp_info ti;
        if (!read_tcp_info(comm->links[size_t(peer) * stride + k].fd, &ti) || !ti.tcpi_min_rtt)
            continue;
        best = std::min(best, ti.tcpi_min_rtt);
    }
    return best == UINT32_MAX ? 0.0 : double(best) * 1e-6;
}

RateProbe::RateProbe(pcclComm *comm, const std::vector<char> &sends_to)
    : comm_(comm), peers_(sends_to.size()), counted_(sends_to.size(), 0),
      seen_(sends_to.size(), 0) {
    comm->last_rate.assign(sends_to.size(), 0.0);
    std::vector<double> now_caps = caps(&mode_, comm->coll_seq, &probes_);
    apply_caps(now_caps);
    if (mode_ == 0) return;  // off: nothing to measure (pinned: last_rate only)
    const int64_t t_us = now_us();
    for (size_t p = 0; p < peers_.size(); ++p) {
        if (!sends_to[p] || int(p) == comm->rank) continue;
        Peer &st = peers_[p];
        if (!read(int(p), nullptr, &st.last)) continue;  // no TCP_INFO: not measured
        {
            std::lock_guard<std::mutex> g(comm->pacing->mutex);
            comm->pacing->sending[p] += 1;
            seen_[p] = ++comm->pacing->started[p];
        }
        counted_[p] = 1;
        st.first_retrans = st.last.retrans;
        st.first_segs = st.last.segs;
        st.cap = now_caps[p];
        st.active = true;
        st.last_us = t_us;
        st.window_ms = window_for(st.last.min_rtt_ms);
        next_ = std::min(next_, due_ms(t_us, st.window_ms));
    }
}

RateProbe::~RateProbe() {
    std::lock_guard<std::mutex> g(comm_->pacing->mutex);
    for (size_t p = 0; p < counted_.size(); ++p)
        if (counted_[p]) comm_->pacing->sending[p] -= 1;
}

bool RateProbe::shared(int peer) {
    std::lock_guard<std::mutex> g(comm_->pacing->mutex);
    const size_t p = size_t(peer);
    const bool other = comm_->pacing->sending[p] > 1 || comm_->pacing->started[p] != seen_[p];
    seen_[p] = comm_->pacing->started[p];
    return other;
}

bool RateProbe::read(int peer, const Counters *prev, Counters *out) const {
    // The streams the ops stripe over (the others are idle: stale RTTs, no samples).
    const size_t S = size_t(comm_->stripe), stride = size_t(comm_->streams);
    uint32_t min_rtt_us = UINT32_MAX, max_srtt_us = 0;
    out->acked.assign(S, 0);
    out->rate = 0.0;
    out->fresh = out->held = 0;
    out->retrans = out->segs = 0;
    for (size_t k = 0; k < S; ++k) {
        tcp_info ti;
        if (!read_tcp_info(comm_->links[size_t(peer) * stride + k].fd, &ti)) return false;
        out->acked[k] = ti.tcpi_bytes_acked;
        out->retrans += ti.tcpi_total_retrans;
        out->segs += ti.tcpi_segs_out;
        // Only a stream acknowledged since the last reading has a sample of this window.
        if (prev && prev->acked.size() == S && ti.tcpi_bytes_acked > prev->acked[k]) {
            out->rate += double(ti.tcpi_delivery_rate);
            out->fresh += 1;
            out->held += ti.tcpi_delivery_rate_app_limited ? 0 : 1;
        }
        max_srtt_us = std::max(max_srtt_us, ti.tcpi_rtt);
        if (ti.tcpi_min_rtt) min_rtt_us = std::min(min_rtt_us, ti.tcpi_min_rtt);
    }
    out->min_rtt_ms = min_rtt_us == UINT32_MAX ? kMinWindowMs : int64_t(min_rtt_us / 1000);
    // The millisecond keeps scheduling noise on short (LAN, loopback) paths from reading
    // as a queue.
    out->queue = min_rtt_us != UINT32_MAX &&
                 double(max_srtt_us) > kPaceQueueRtt * double(min_rtt_us) + 1000.0;
    return true;
}

void RateProbe::sample(const std::vector<char> &busy) {
    next_ = INT64_MAX;
    for (size_t p = 0; p < peers_.size(); ++p) {
        Peer &st = peers_[p];
        if (!st.active) continue;
        const int64_t t_us = now_us();
        if (t_us - st.last_us < st.window_ms * 1000) {
            next_ = std::min(next_, due_ms(st.last_us, st.window_ms));
            continue;
        }
        Counters now;
        if (!read(int(p), &st.last, &now)) {
            st.active = false;
            continue;
        }
        if (!shared(int(p))) {
            st.queued = st.queued || now.queue;
            if (now.rate > 0) {
                // BBR's test for a full pipe: the rate stopped growing by kPacePlateauGrowth.
                if (now.rate >= kPacePlateauGrowth * st.best) st.flat = 0;
                else st.flat += 1;
                st.best = std::max(st.best, now.rate);
                st.windows += 1;
                if (st.flat >= kPacePlateauWindows) st.full_rates.push_back(now.rate);
                // Most streams' samples taken with data waiting: the path (or the cap)
                // held them, not this rank's supply of bytes.
                if (2 * now.held >= now.fresh) {
                    st.held_windows += 1;
                    st.rates.push_back(now.rate);
                }
            }
        }
        st.last_us = t_us;
        st.last = std::move(now);
        st.window_ms = window_for(st.last.min_rtt_ms);
        if (busy[p]) {
            next_ = std::min(next_, due_ms(t_us, st.window_ms));
        } else {
            st.active = false;  // the op has handed the peer all its bytes
        }
    }
}

void RateProbe::finish() {
    // The queue is deepest when the last bytes leave: one more look at the streams.
    for (size_t p = 0; p < peers_.size(); ++p) {
        Peer &st = peers_[p];
        Counters now;
        if (counted_[p] && st.windows > 0 && read(int(p), nullptr, &now)) {
            st.queued = st.queued || (now.queue && !shared(int(p)));
            // Random loss (a lossy path drops one segment in 10^4) is not a cap above the
            // path: overrunning its queue drops a share of the segments that is 10-100x that.
            const double segs = double(now.segs - st.first_segs);
            st.lost = segs > 0 && double(now.retrans - st.first_retrans) > kPaceLossShare * segs;
        }
    }
    {
        std::lock_guard<std::mutex> g(comm_->pacing->mutex);
        for (size_t p = 0; p < peers_.size(); ++p) {
            const Peer &st = peers_[p];
            comm_->last_rate[p] = st.best;
            if (st.best <= 0 || mode_ >= 0) continue;  // pinned: the estimate is not used
            double &e = comm_->pacing->estimate[p];
            const bool full = st.queued && st.held_windows > 0 && !st.full_rates.empty();
            // Once the pipe is full the windows all read the path's rate; the third
            // quartile leaves out the spikes of loss recovery (a hole filled acknowledges
            // a burst: the fastest window reads up to 10 % high) and the dips of a pacer
            // (a paced op's windows spread by 10-20 %: their median read 80 % of an
            // emulated 100 Mbit/s link).
            double steady = st.best;
            if (!st.full_rates.empty()) {
                // A stall (a timeout, a slow peer) can pass for a plateau: never far
                // below what the op did carry.
                steady = std::max(quantile(st.full_rates, 0.75), kPaceFloor * st.best);
            }
            // Only an op that filled the pipe says what the path carries when it lost.
            const bool lossy = st.lost && !st.full_rates.empty();
            // A probe is judged by the median of its windows past the first (a start-up)
            // that the path or the cap held (in a ring a rank also waits for its
            // neighbour's bytes): the third quartile let the estimate creep to 1.15-1.18x
            // an emulated 1 Gbit/s link, probe after probe.
            const bool probed = probes_[p] && st.rates.size() > size_t(kPaceProbeWindows);
            const double typical =
                probed ? quantile(std::vector<double>(st.rates.begin() + 1, st.rates.end()), 0.5)
                       : 0.0;
            e = next_estimate(e, full || lossy ? steady : probed ? typical : st.best, st.cap,
                              full, lossy, probed, &comm_->pacing->streak[p]);
            // An op held at its plain cap, without loss: the path may have room above it.
            // (Too short an op, a barrier say, says nothing either way.)
            if (st.windows >= kPaceGrowWindows)
                comm_->pacing->due[p] = !probed && !lossy && st.cap > 0 &&
                                        st.best >= kPaceCapBound * st.cap;
        }
    }
    int64_t mode;
    apply_caps(caps(&mode, 0, nullptr));  // idle streams keep the plain cap until the next op
}
std::vector<double> RateProbe::caps(int64_t *mode, uint64_t seq, std::vector<char> *probes) const {
    std::lock_guard<std::mutex> g(comm_->pacing->mutex);
    *mode = comm_->pacing->mode;
    std::vector<double> out(peers_.size());
    if (probes) probes->assign(peers_.size(), 0);
    for (size_t p = 0; p < out.size(); ++p) {
        const double e = comm_->pacing->estimate[p];
        const double gain = probes && *mode < 0 ? probe_gain(seq, e, comm_->pacing->streak[p],
                                                                  comm_->pacing->due[p] != 0)
                                                     : 1.0;
        if (probes) (*probes)[p] = gain > 1.0;
        out[p] = peer_cap(*mode, e, gain);
    }
    return out;
}

void RateProbe::apply_caps(const std::vector<double> &caps) {
    for (size_t p = 0; p < caps.size(); ++p)
        if (int(p) != comm_->rank) set_cap(p, caps[p]);
}

void RateProbe::set_cap(size_t peer, double cap) {
    const size_t S = size_t(comm_->stripe), stride = size_t(comm_->streams);
    // SO_MAX_PACING_RATE takes a 32-bit bytes/s on every kernel; ~0U means no cap.
    uint32_t rate = cap > 0 ? uint32_t(std::max(1.0, std::min(cap / double(S), double(UINT32_MAX - 1))))
                            : ~0U;
    for (size_t k = 0; k < S; ++k) {
        pcclComm::Link &l = comm_->links[peer * stride + k];
        if (l.fd < 0 || l.pace == rate) continue;
        // Best effort: a kernel without the option just does not pace.
        setsockopt(l.fd, SOL_SOCKET, SO_MAX_PACING_RATE, &rate, sizeof(rate));
        l.pace = rate;
    }
}

}  // namespace pccl
