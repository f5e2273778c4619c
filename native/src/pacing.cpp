#include "pacing.hpp"

#include <netinet/in.h>
#include <linux/tcp.h>  // struct tcp_info with tcpi_delivered (glibc's netinet/tcp.h lacks it)
#include <sys/socket.h>

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <map>

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
// here (tcpi_delivered and tcpi_bytes_retrans came with 4.18 and 4.19).
bool read_tcp_info(int fd, tcp_info *ti) {
    std::memset(ti, 0, sizeof(*ti));
    socklen_t len = sizeof(*ti);
    return fd >= 0 && getsockopt(fd, IPPROTO_TCP, TCP_INFO, ti, &len) == 0 &&
           len >= offsetof(tcp_info, tcpi_bytes_retrans) + sizeof(ti->tcpi_bytes_retrans);
}

int64_t window_for(uint32_t min_rtt_us) {
    const int64_t ms = min_rtt_us ? int64_t(min_rtt_us / 1000) : kMinWindowMs;
    return std::min(kMaxWindowMs, std::max(kMinWindowMs, ms));
}

// When a window that started at start_us is due, on the engine's millisecond clock
// (rounded up: polling a millisecond early would find the window unfinished).
int64_t due_ms(int64_t start_us, int64_t window) { return (start_us + 999) / 1000 + window; }

// The registry of paths, by the peer's IP address. Paths are never removed: a process
// talks to a bounded set of peers, and what it learned of one stays useful when it
// returns (a rejoin, the next epoch).
std::mutex registry_mutex;
std::map<std::string, std::shared_ptr<Path>> &registry() {
    static auto *paths = new std::map<std::string, std::shared_ptr<Path>>();
    return *paths;
}

std::shared_ptr<Path> find_path(int fd) {
    std::string key = net::peer_name(fd);
    const size_t colon = key.rfind(':');
    if (colon != std::string::npos) key.resize(colon);  // the address, not the port
    std::lock_guard<std::mutex> g(registry_mutex);
    std::shared_ptr<Path> &p = registry()[key];
    if (!p) {
        p = std::make_shared<Path>();
        p->key = key;
    }
    return p;
}

// PCCL_RATE_TRACE: one CSV file for the process, appended to under its own lock.
std::mutex trace_mutex;
FILE *trace_file() {
    static FILE *f = [] {
        const char *path = getenv("PCCL_RATE_TRACE");
        FILE *out = path && *path ? fopen(path, "a") : nullptr;
        if (out && ftell(out) == 0)
            fprintf(out, "path,op,index,seconds,delivered,sent,retrans,app_limited,stripe,"
                         "cap,spot,srtt_us,min_rtt_us,shared,notsent,read_us\n");
        return out;
    }();
    return f;
}
}  // namespace

double peer_cap(const Pacing &p, int peer) {
    if (p.mode == 0) return 0;
    if (p.mode > 0) return double(p.mode);
    const std::shared_ptr<Path> &path = p.paths[size_t(peer)];
    if (!path) return 0;
    std::lock_guard<std::mutex> g(path->mutex);
    return path->ctl.cap();
}

double peer_estimate(const Pacing &p, int peer) {
    const std::shared_ptr<Path> &path = p.paths[size_t(peer)];
    if (!path || p.mode >= 0) return 0;
    std::lock_guard<std::mutex> g(path->mutex);
    return path->ctl.bandwidth();
}

bool path_filled(const Pacing &p, int peer) {
    const std::shared_ptr<Path> &path = p.paths[size_t(peer)];
    if (!path || p.mode >= 0) return false;
    std::lock_guard<std::mutex> g(path->mutex);
    return path->ctl.filled();
}

int proposed_stripe(const Pacing &p, int peer, int current) {
    const std::shared_ptr<Path> &path = p.paths[size_t(peer)];
    if (!path || p.mode >= 0) return current;
    std::lock_guard<std::mutex> g(path->mutex);
    return path->ctl.proposed_stripe();
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

double stream_window() {
    static const double window = [] {
        double limit = 4 << 20;
        if (FILE *f = fopen("/proc/sys/net/ipv4/tcp_wmem", "r")) {
            long lo = 0, mid = 0, hi = 0;
            if (fscanf(f, "%ld %ld %ld", &lo, &mid, &hi) == 3 && hi > 0) limit = double(hi);
            fclose(f);
        }
        return 0.75 * limit;
    }();
    return window;
}

RateProbe::RateProbe(pcclComm *comm, const std::vector<char> &sends_to)
    : comm_(comm), peers_(sends_to.size()), seen_(sends_to.size(), 0) {
    for (Peer &st : peers_) st.stripe = comm->stripe;
    comm->last_rate.assign(sends_to.size(), 0.0);
    {
        std::lock_guard<std::mutex> g(comm->pacing->mutex);
        mode_ = comm->pacing->mode;
    }
    const int64_t t_us = now_us();
    for (size_t p = 0; p < peers_.size(); ++p) {
        if (!sends_to[p] || int(p) == comm->rank) continue;
        Peer &st = peers_[p];
        if (mode_ == 0) {
            set_cap(p, 0);
            continue;
        }
        {
            std::lock_guard<std::mutex> g(comm->pacing->mutex);
            std::shared_ptr<Path> &path = comm->pacing->paths[p];
            if (!path) path = find_path(comm->links[p * size_t(comm->streams)].fd);
            st.path = path;
        }
        double cap = double(mode_);
        {
            std::lock_guard<std::mutex> g(st.path->mutex);
            // The stripe ranges from comm's up to every connected stream when the group
            // picks its own (it connected more than it stripes over); else it is pinned.
            if (mode_ < 0) {
                const rate::Controller::Start start = st.path->ctl.begin_op(
                    comm->stripe, comm->streams, st.path->min_rtt, stream_window());
                cap = start.cap;
                st.stripe = start.stripe;
            }
        }
        if (!read(int(p), &st.last)) {  // no TCP_INFO: not measured, not capped
            st.path.reset();
            continue;
        }
        {
            std::lock_guard<std::mutex> g(st.path->mutex);
            path_sending(*st.path, +1);
            seen_[p] = st.path->changes;
            st.path->ops += 1;
        }
        set_cap(p, cap);
        st.active = true;
        st.last_us = t_us;
        st.window_ms = window_for(st.last.min_rtt_us);
        next_ = std::min(next_, due_ms(t_us, st.window_ms));
    }
}

RateProbe::~RateProbe() {
    for (Peer &st : peers_) {
        if (!st.path) continue;
        std::lock_guard<std::mutex> g(st.path->mutex);
        path_sending(*st.path, -1);
    }
}

bool RateProbe::shared(size_t peer) {
    Path &path = *peers_[peer].path;
    std::lock_guard<std::mutex> g(path.mutex);
    const bool other = window_shared(path, seen_[peer]);
    seen_[peer] = path.changes;
    return other;
}

bool RateProbe::read(int peer, Counters *out) const {
    // The streams this op stripes over (the others are idle: stale RTTs, no samples).
    const size_t S = size_t(peers_[size_t(peer)].stripe), stride = size_t(comm_->streams);
    *out = Counters{};
    uint32_t min_rtt = UINT32_MAX;
    for (size_t k = 0; k < S; ++k) {
        tcp_info ti;
        if (!read_tcp_info(comm_->links[size_t(peer) * stride + k].fd, &ti)) return false;
        out->delivered += double(ti.tcpi_delivered) * double(ti.tcpi_snd_mss);
        out->sent += double(ti.tcpi_bytes_sent - ti.tcpi_bytes_retrans);
        out->retrans += double(ti.tcpi_bytes_retrans);
        out->spot += double(ti.tcpi_delivery_rate);
        out->notsent += double(ti.tcpi_notsent_bytes);
        out->streams += 1;
        out->srtt_us = std::max(out->srtt_us, ti.tcpi_rtt);
        if (ti.tcpi_min_rtt) min_rtt = std::min(min_rtt, ti.tcpi_min_rtt);
    }
    out->min_rtt_us = min_rtt == UINT32_MAX ? 0 : min_rtt;
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
        // How long the counters took to read: a probe descheduled here reads its window
        // long (in the trace, to tell that from the path).
        const int64_t read_us = now_us() - t_us;
        rate::Window w;
        const bool other = shared(p);
        // A window another lane sent in saw a share of the path: not a sample. (A stream
        // counter that went back is a stripe that changed under the op: neither.)
        if (!other && now.delivered >= st.last.delivered && now.sent >= st.last.sent) {
            w.seconds = double(t_us - st.last_us) * 1e-6;
            w.delivered = now.delivered - st.last.delivered;
            w.sent = now.sent - st.last.sent;
            w.retrans = now.retrans - st.last.retrans;
            // Ran dry: the op handed the peer its last bytes, or the sockets hold nothing
            // unsent and took all they were given (a ring waiting on its neighbour's bytes):
            // the path was not the limit. (Streams held by their windows hold nothing unsent
            // either, but refuse more: busy 2.)
            w.app_limited = !busy[p] || (now.notsent <= 0 && busy[p] < 2);
            if (now.min_rtt_us > 0 && now.srtt_us > now.min_rtt_us)
                w.queue = double(now.srtt_us - now.min_rtt_us) * 1e-6;
        }
        double cap = double(mode_);
        {
            std::lock_guard<std::mutex> g(st.path->mutex);
            if (mode_ < 0) cap = st.path->ctl.on_window(w);
            if (now.min_rtt_us > 0 && (st.path->min_rtt <= 0 || now.min_rtt_us * 1e-6 < st.path->min_rtt))
                st.path->min_rtt = now.min_rtt_us * 1e-6;
        }
        // The op's own rate, whatever the mode: the controller's signal (two windows,
        // bounded by what was sent), so a pinned cap is not read 35 % high off one
        // window's bunched ACKs.
        if (w.seconds > 0) {
            if (!w.app_limited && !st.prev.app_limited)
                st.best = std::max(st.best, rate::sample(st.before, st.prev, w));
            st.before = st.prev;
            st.prev = w;
        } else {
            st.prev = st.before = {};
        }
        trace(st, w, now, other, cap, read_us);
        set_cap(p, cap);
        st.index += 1;
        st.last_us = t_us;
        st.last = now;
        st.window_ms = window_for(now.min_rtt_us);
        if (busy[p]) {
            next_ = std::min(next_, due_ms(t_us, st.window_ms));
        } else {
            st.active = false;  // the op has handed the peer all its bytes
        }
    }
}

void RateProbe::finish() {
    for (size_t p = 0; p < peers_.size(); ++p) {
        Peer &st = peers_[p];
        comm_->last_rate[p] = st.best;
        if (!st.path || mode_ >= 0) continue;
        double cap;
        {
            std::lock_guard<std::mutex> g(st.path->mutex);
            st.path->ctl.end_op();
            cap = st.path->ctl.cap();
        }
        set_cap(p, cap);  // idle streams wait at gain 1 for the next op
    }
}

void RateProbe::set_cap(size_t peer, double cap) {
    const size_t S = size_t(peers_[peer].stripe), stride = size_t(comm_->streams);
    int sharing = 1;
    if (peers_[peer].path) {
        std::lock_guard<std::mutex> g(peers_[peer].path->mutex);
        sharing = std::max(1, peers_[peer].path->sending);
    }
    // SO_MAX_PACING_RATE takes a 32-bit bytes/s on every kernel; ~0U means no cap.
    const double each = cap / double(S) / double(sharing);
    uint32_t rate = cap > 0 ? uint32_t(std::max(1.0, std::min(each, double(UINT32_MAX - 1)))) : ~0U;
    for (size_t k = 0; k < S; ++k) {
        pcclComm::Link &l = comm_->links[peer * stride + k];
        if (l.fd < 0 || l.pace == rate) continue;
        // Best effort: a kernel without the option just does not pace.
        setsockopt(l.fd, SOL_SOCKET, SO_MAX_PACING_RATE, &rate, sizeof(rate));
        l.pace = rate;
    }
}

void RateProbe::trace(const Peer &st, const rate::Window &w, const Counters &now, bool other,
                      double cap, int64_t read_us) const {
    FILE *f = trace_file();
    if (!f) return;
    uint64_t op;
    {
        std::lock_guard<std::mutex> g(st.path->mutex);
        op = st.path->ops;
    }
    std::lock_guard<std::mutex> g(trace_mutex);
    fprintf(f, "%s,%llu,%d,%.6f,%.0f,%.0f,%.0f,%d,%d,%.0f,%.0f,%u,%u,%d,%.0f,%lld\n",
            st.path->key.c_str(), (unsigned long long)op, st.index, w.seconds, w.delivered,
            w.sent, w.retrans, w.app_limited ? 1 : 0, comm_->stripe, cap, now.spot, now.srtt_us,
            now.min_rtt_us, other ? 1 : 0, now.notsent, (long long)read_us);
    fflush(f);
}

}  // namespace pccl
