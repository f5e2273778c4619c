#include "pacing.hpp"

#include <netinet/in.h>
#include <linux/tcp.h>  // struct tcp_info with tcpi_bytes_acked (glibc's netinet/tcp.h lacks it)
#include <sys/socket.h>

#include <time.h>

#include <algorithm>
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

int64_t window_for(int64_t min_rtt_ms) {
    return std::min(kMaxWindowMs, std::max(kMinWindowMs, min_rtt_ms));
}

// When a window that started at start_us is due, on the engine's millisecond clock
// (rounded up: polling a millisecond early would find the window unfinished).
int64_t due_ms(int64_t start_us, int64_t window) { return (start_us + 999) / 1000 + window; }
}  // namespace

double next_estimate(double estimate, double sample, bool queued, double cap) {
    if (!(sample > 0)) return estimate;
    if (queued) return std::max(sample, estimate * kPaceDecay);
    if (estimate > 0 && cap > 0 && sample >= kPaceCapBound * cap) return estimate * kPaceGrow;
    return estimate;
}

double peer_cap(int64_t mode, double estimate) {
    if (mode == 0) return 0;
    if (mode > 0) return double(mode);
    return estimate > 0 ? estimate * kPaceHeadroom : 0;
}

RateProbe::RateProbe(pcclComm *comm, const std::vector<char> &sends_to)
    : comm_(comm), peers_(sends_to.size()) {
    int64_t mode;
    std::vector<double> now_caps = caps(&mode);
    apply_caps(now_caps);
    if (mode >= 0) return;  // off or pinned: nothing to measure
    const int64_t t_us = now_us();
    for (size_t p = 0; p < peers_.size(); ++p) {
        if (!sends_to[p] || int(p) == comm->rank) continue;
        Peer &st = peers_[p];
        if (!read(int(p), &st.last)) continue;  // no TCP_INFO (kernel < 4.19): not measured
        st.cap = now_caps[p];
        st.active = true;
        st.was_busy = false;  // the op has not queued anything yet
        st.last_us = t_us;
        st.window_ms = window_for(st.last.min_rtt_ms);
        next_ = std::min(next_, due_ms(t_us, st.window_ms));
    }
}

bool RateProbe::read(int peer, Counters *out) const {
    const size_t S = size_t(comm_->streams);
    uint64_t acked = 0, sent = 0;
    uint32_t min_rtt_us = UINT32_MAX, max_srtt_us = 0;
    bool any_waiting = false;
    for (size_t k = 0; k < S; ++k) {
        tcp_info ti;
        std::memset(&ti, 0, sizeof(ti));
        socklen_t len = sizeof(ti);
        int fd = comm_->links[size_t(peer) * S + k].fd;
        // Kernels older than the field (4.1) return a shorter struct: no measurement.
        if (fd < 0 || getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0 ||
            len < offsetof(tcp_info, tcpi_bytes_sent) + sizeof(ti.tcpi_bytes_sent))
            return false;
        acked += ti.tcpi_bytes_acked;
        sent += ti.tcpi_bytes_sent;
        max_srtt_us = std::max(max_srtt_us, ti.tcpi_rtt);
        out->supplied += ti.tcpi_delivery_rate_app_limited ? 0 : 1;
        // Bytes queued but not yet sent: this stream is held back by the network (or the
        // cap), not waiting for the op to give it more.
        any_waiting = any_waiting || ti.tcpi_notsent_bytes > 0;
        if (ti.tcpi_min_rtt) min_rtt_us = std::min(min_rtt_us, ti.tcpi_min_rtt);
    }
    out->acked = acked;
    out->sent = sent;
    out->backlogged = any_waiting;
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
        if (!read(int(p), &now)) {
            st.active = false;
            continue;
        }
        const bool now_busy = busy[p] != 0 && now.backlogged;
        // Any sample of the op may show the queue (the op's start, when every stream
        // sends at once, most often does): the path was full at some point.
        st.queued = st.queued || now.queue;
        // A window must start and end with bytes waiting on a stream: one in which every
        // stream ran dry measures how fast the op produced bytes, not the path (a small
        // op waiting a round trip for its peer would read as a path of a few KB/s).
        // Its rate: the lesser of what was acknowledged and what was sent (pacing.hpp).
        if (st.was_busy && now_busy && now.acked >= st.last.acked && now.sent >= st.last.sent &&
            2 * now.supplied >= comm_->streams) {
            uint64_t bytes = std::min(now.acked - st.last.acked, now.sent - st.last.sent);
            st.best = std::max(st.best, double(bytes) * 1e6 / double(t_us - st.last_us));
        }
        st.was_busy = now_busy;
        st.last_us = t_us;
        st.last = now;
        st.window_ms = window_for(now.min_rtt_ms);
        if (busy[p]) next_ = std::min(next_, due_ms(t_us, st.window_ms));
        else st.active = false;  // the op has handed the peer all its bytes
    }
}

void RateProbe::finish() {
    bool changed = false;
    {
        std::lock_guard<std::mutex> g(comm_->pacing->mutex);
        for (size_t p = 0; p < peers_.size(); ++p) {
            const Peer &st = peers_[p];
            if (st.best <= 0) continue;
            double &e = comm_->pacing->estimate[p];
            e = next_estimate(e, st.best, st.queued, st.cap);
            changed = true;
        }
    }
    int64_t mode;
    if (changed) apply_caps(caps(&mode));
}

std::vector<double> RateProbe::caps(int64_t *mode) const {
    std::lock_guard<std::mutex> g(comm_->pacing->mutex);
    *mode = comm_->pacing->mode;
    std::vector<double> out(peers_.size());
    for (size_t p = 0; p < out.size(); ++p) out[p] = peer_cap(*mode, comm_->pacing->estimate[p]);
    return out;
}

void RateProbe::apply_caps(const std::vector<double> &caps) {
    const size_t S = size_t(comm_->streams);
    for (size_t p = 0; p < caps.size(); ++p) {
        if (int(p) == comm_->rank) continue;
        // SO_MAX_PACING_RATE takes a 32-bit bytes/s on every kernel; ~0U means no cap.
        uint32_t rate = caps[p] > 0
                            ? uint32_t(std::max(1.0, std::min(caps[p] / double(S), double(UINT32_MAX - 1))))
                            : ~0U;
        for (size_t k = 0; k < S; ++k) {
            pcclComm::Link &l = comm_->links[p * S + k];
            if (l.fd < 0 || l.pace == rate) continue;
            // Best effort: a kernel without the option just does not pace.
            setsockopt(l.fd, SOL_SOCKET, SO_MAX_PACING_RATE, &rate, sizeof(rate));
            l.pace = rate;
        }
    }
}

}  // namespace pccl
