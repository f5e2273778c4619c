#include "pacing.hpp"

#include <netinet/in.h>
#include <linux/tcp.h>  // struct tcp_info with tcpi_bytes_acked (glibc's netinet/tcp.h lacks it)
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>

#include "comm.hpp"
#include "socket.hpp"

namespace pccl {

namespace {
// Windows are tens of ms: their rates need a finer clock than the engine's milliseconds.
int64_t now_us() {
    return std::chrono::duration_cast<std::chrono::microseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}
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
    if (comm->streams <= 1 || !comm->pacing) return;  // one stream has no siblings to overrun
    int64_t mode;
    {
        std::lock_guard<std::mutex> g(comm->pacing->mutex);
        mode = comm->pacing->mode;
    }
    if (mode >= 0) {
        apply_caps();
        return;  // off or pinned: nothing to measure
    }
    const int64_t now = net::now_ms();
    for (size_t p = 0; p < peers_.size(); ++p) {
        if (!sends_to[p] || int(p) == comm->rank) continue;
        Peer &st = peers_[p];
        {
            std::lock_guard<std::mutex> g(comm->pacing->mutex);
            st.cap = peer_cap(mode, comm->pacing->estimate[p]);
        }
        if (!read(int(p), &st.last)) continue;  // no TCP_INFO (kernel < 4.19): not measured
        st.active = true;
        st.was_busy = false;  // the op has not queued anything yet
        st.last_ms = now;
        st.last_us = now_us();
        st.window_ms = std::min(kMaxWindowMs, std::max(kMinWindowMs, st.last.min_rtt_ms));
        next_ = std::min(next_, now + st.window_ms);
    }
    apply_caps();
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

void RateProbe::sample(int64_t now_ms, const std::vector<char> &busy) {
    next_ = INT64_MAX;
    for (size_t p = 0; p < peers_.size(); ++p) {
        Peer &st = peers_[p];
        if (!st.active) continue;
        if (now_ms - st.last_ms < st.window_ms) {
            next_ = std::min(next_, st.last_ms + st.window_ms);
            continue;
        }
        Counters now;
        const int64_t t_us = now_us();
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
        const int64_t us = t_us - st.last_us;
        if (st.was_busy && now_busy && now.acked >= st.last.acked && now.sent >= st.last.sent &&
            us > 0) {
            uint64_t bytes = std::min(now.acked - st.last.acked, now.sent - st.last.sent);
            const double rate = double(bytes) * 1e6 / double(us);
            if (2 * now.supplied >= comm_->streams) st.best = std::max(st.best, rate);
        }
        st.was_busy = now_busy;
        st.last_ms = now_ms;
        st.last_us = t_us;
        st.last = now;
        st.window_ms = std::min(kMaxWindowMs, std::max(kMinWindowMs, now.min_rtt_ms));
        if (busy[p]) next_ = std::min(next_, now_ms + st.window_ms);
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
    if (changed) apply_caps();
}

void RateProbe::apply_caps() {
    const size_t S = size_t(comm_->streams);
    std::vector<double> caps(peers_.size(), 0.0);
    {
        std::lock_guard<std::mutex> g(comm_->pacing->mutex);
        for (size_t p = 0; p < peers_.size() && p < comm_->pacing->estimate.size(); ++p)
            caps[p] = peer_cap(comm_->pacing->mode, comm_->pacing->estimate[p]);
    }
    for (size_t p = 0; p < caps.size(); ++p) {
        if (int(p) == comm_->rank) continue;
        // SO_MAX_PACING_RATE takes a 32-bit bytes/s on every kernel; ~0U means no cap.
        double share = caps[p] / double(S);
        uint32_t rate = caps[p] > 0 ? uint32_t(std::min(share, double(UINT32_MAX - 1))) : ~0U;
        if (caps[p] > 0 && rate == 0) rate = 1;
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
