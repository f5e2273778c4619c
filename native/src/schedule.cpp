#include "schedule.hpp"

#include <algorithm>

#include "dtype.hpp"

namespace pccl {

namespace {

int mod(int a, int n) { return ((a % n) + n) % n; }

struct Builder {
    const OpInfo &info;
    Schedule s;
    size_t es;
    std::vector<uint32_t> send_steps, recv_steps;

    explicit Builder(const OpInfo &i)
        : info(i), es(type_size(i.dtype)),
          send_steps(size_t(i.world_size), 0), recv_steps(size_t(i.world_size), 0) {
        s.dtype = i.dtype;
        s.op = i.op == wire::kNoOp ? pcclSum : pcclRedOp_t(i.op);
        s.world_size = i.world_size;
    }

    wire::FrameHeader header(uint32_t step, uint64_t len, uint64_t count) const {
        wire::FrameHeader h;
        h.coll = info.coll;
        h.dtype = uint8_t(info.dtype);
        h.op = info.op;
        h.root = info.root;
        h.tag = info.tag;
        h.step = step;
        h.seq = info.seq;
        h.count = count;
        h.length = len;
        return h;
    }

    // Chunk k of a slice of n elements: its first element and its length.
    uint64_t chunks(uint64_t n) const { return chunk_count(info, n); }
    uint64_t chunk_off(uint64_t n, uint64_t k) const { return k * chunk_elems_for(info, n); }
    uint64_t chunk_len(uint64_t n, uint64_t k) const {
        uint64_t c = chunk_elems_for(info, n);
        return std::min<uint64_t>(c, n - std::min(n, k * c));
    }

    int32_t send(int peer, const uint8_t *data, uint64_t elems, int32_t dep, uint64_t count) {
        uint64_t len = elems * es;
        s.sends.push_back({peer, data, len, dep, header(send_steps[size_t(peer)]++, len, count)});
        return int32_t(s.sends.size() - 1);
    }

    int32_t recv(int peer, uint8_t *dst, uint64_t elems, uint64_t count,
                 const uint8_t *reduce_src = nullptr, bool finalize = false) {
        uint64_t len = elems * es;
        RecvItem r{peer, dst, len, header(recv_steps[size_t(peer)]++, len, count)};
        r.reduce_src = reduce_src;
        r.finalize_avg = finalize;
        s.recvs.push_back(r);
        return int32_t(s.recvs.size() - 1);
    }
};

}  // namespace

uint64_t chunk_elems_for(const OpInfo &info, uint64_t n) {
    const uint64_t es = type_size(info.dtype);
    uint64_t elems = std::max<uint64_t>(1, info.chunk_bytes / es);
    if (info.streams > 1) {
        uint64_t share = (n + uint64_t(info.streams) - 1) / uint64_t(info.streams);
        uint64_t floor = std::max<uint64_t>(1, kMinStripeBytes / es);
        elems = std::min(elems, std::max(share, floor));
    }
    return elems;
}

uint64_t chunk_count(const OpInfo &info, uint64_t n) {
    uint64_t c = chunk_elems_for(info, n);
    return n == 0 ? 1 : (n + c - 1) / c;
}

int rank_at(const OpInfo &info, int p) {
    p = mod(p, info.world_size);
    return info.ring ? info.ring[p] : p;
}

int ring_position(const OpInfo &info) {
    if (!info.ring) return info.rank;
    for (int p = 0; p < info.world_size; ++p)
        if (info.ring[p] == info.rank) return p;
    return info.rank;  // not reached: pcclCommSetRingOrder admits permutations only
}

namespace {

// Segment i of a buffer of `count` elements cut into n near-equal segments.
uint64_t seg_begin(uint64_t count, int n, int i) {
    uint64_t base = count / uint64_t(n), rem = count % uint64_t(n);
    return uint64_t(i) * base + std::min<uint64_t>(uint64_t(i), rem);
}
uint64_t seg_size(uint64_t count, int n, int i) {
    return count / uint64_t(n) + (uint64_t(i) < count % uint64_t(n) ? 1 : 0);
}

// Reduce-scatter over segments given by (begin, size) functions of a segment
// index; `shift` picks which segment each ring position ends up owning: position
// r owns segment (r + 1 - shift). last[seg][k] receives the index of the final
// receive of each chunk.
template <typename Begin, typename Size>
void reduce_scatter_steps(Builder &b, const uint8_t *input, uint8_t *work, int shift, Begin begin,
                          Size size, std::vector<std::vector<int32_t>> &last) {
    const OpInfo &in = b.info;
    int n = in.world_size, r = ring_position(in);
    int right = rank_at(in, r + 1), left = rank_at(in, r - 1);
    for (int s = 0; s < n - 1; ++s) {
        int ss = mod(r - s - shift, n), rs = mod(r - s - 1 - shift, n);
        for (uint64_t k = 0; k < b.chunks(size(ss)); ++k) {
            uint64_t off = (begin(ss) + b.chunk_off(size(ss), k)) * b.es;
            const uint8_t *src = s == 0 ? input + off : work + off;
            b.send(right, src, b.chunk_len(size(ss), k), s == 0 ? -1 : last[size_t(ss)][k],
                   in.count);
        }
        std::vector<int32_t> got;
        for (uint64_t k = 0; k < b.chunks(size(rs)); ++k) {
            uint64_t off = (begin(rs) + b.chunk_off(size(rs), k)) * b.es;
            bool finalize = s == n - 2 && in.op == pcclAvg;
            got.push_back(b.recv(left, work + off, b.chunk_len(size(rs), k), in.count,
                                 input + off, finalize));
        }
        last[size_t(rs)] = got;
    }
}

}  // namespace

Schedule ring_allreduce(const OpInfo &info, const uint8_t *input, uint8_t *work) {
    Builder b(info);
    // Segments are numbered by ring position: position r finalises segment r + 1.
    int n = info.world_size, r = ring_position(info);
    int right = rank_at(info, r + 1), left = rank_at(info, r - 1);
    auto begin = [&](int i) { return seg_begin(info.count, n, i); };
    auto size = [&](int i) { return seg_size(info.count, n, i); };
    std::vector<std::vector<int32_t>> last(static_cast<size_t>(n));
    reduce_scatter_steps(b, input, work, 0, begin, size, last);
    // All-gather: forward each owner's finished bytes unchanged.
    for (int s = 0; s < n - 1; ++s) {
        int ss = mod(r + 1 - s, n), rs = mod(r - s, n);
        for (uint64_t k = 0; k < b.chunks(size(ss)); ++k) {
            uint64_t off = (begin(ss) + b.chunk_off(size(ss), k)) * b.es;
            b.send(right, work + off, b.chunk_len(size(ss), k), last[size_t(ss)][k], info.count);
        }
        std::vector<int32_t> got;
        for (uint64_t k = 0; k < b.chunks(size(rs)); ++k) {
            uint64_t off = (begin(rs) + b.chunk_off(size(rs), k)) * b.es;
            got.push_back(b.recv(left, work + off, b.chunk_len(size(rs), k), info.count));
        }
        last[size_t(rs)] = got;
    }
    return b.s;
}

Schedule ring_reduce_scatter(const OpInfo &info, const uint8_t *input, uint8_t *work) {
    Builder b(info);
    int n = info.world_size;
    // Segment i (a ring position) is the block of the rank at that position, so
    // every rank ends owning its own block, whatever the ring order.
    auto begin = [&](int i) { return uint64_t(rank_at(info, i)) * info.count; };
    auto size = [&](int) { return info.count; };
    std::vector<std::vector<int32_t>> last(static_cast<size_t>(n));
    reduce_scatter_steps(b, input, work, 1, begin, size, last);
    return b.s;
}

Schedule ring_allgather(const OpInfo &info, const uint8_t *input, uint8_t *work) {
    Builder b(info);
    // ss and rs below are ring positions; the block of position p lands at the
    // rank-ordered offset of the rank there.
    int n = info.world_size, r = ring_position(info);
    int right = rank_at(info, r + 1), left = rank_at(info, r - 1);
    auto block = [&](int p) { return uint64_t(rank_at(info, p)); };
    uint64_t c = info.count;
    std::vector<std::vector<int32_t>> last(static_cast<size_t>(n));
    for (int s = 0; s < n - 1; ++s) {
        int ss = mod(r - s, n), rs = mod(r - s - 1, n);
        for (uint64_t k = 0; k < b.chunks(c); ++k) {
            uint64_t off = b.chunk_off(c, k) * b.es;
            if (s == 0)
                b.send(right, input + off, b.chunk_len(c, k), -1, c);
            else
                b.send(right, work + block(ss) * c * b.es + off, b.chunk_len(c, k),
                       last[size_t(ss)][k], c);
        }
        std::vector<int32_t> got;
        for (uint64_t k = 0; k < b.chunks(c); ++k) {
            uint64_t off = block(rs) * c * b.es + b.chunk_off(c, k) * b.es;
            got.push_back(b.recv(left, work + off, b.chunk_len(c, k), c));
        }
        last[size_t(rs)] = got;
    }
    return b.s;
}

Schedule chain_broadcast(const OpInfo &info, int root, const uint8_t *buf, uint8_t *work) {
    Builder b(info);
    int n = info.world_size, r = ring_position(info);
    int right = rank_at(info, r + 1), left = rank_at(info, r - 1);
    int root_pos = r;
    for (int p = 0; p < n; ++p)
        if (rank_at(info, p) == root) root_pos = p;
    int pos = mod(r - root_pos, n);
    uint64_t c = info.count;
    for (uint64_t k = 0; k < b.chunks(c); ++k) {
        uint64_t off = b.chunk_off(c, k) * b.es;
        if (pos == 0) {
            b.send(right, buf + off, b.chunk_len(c, k), -1, c);
            continue;
        }
        int32_t got = b.recv(left, work + off, b.chunk_len(c, k), c);
        if (pos < n - 1) b.send(right, work + off, b.chunk_len(c, k), got, c);
    }
    return b.s;
}

Schedule pairwise_alltoallv(const OpInfo &info, const uint8_t *sendbuf, const uint64_t *scounts,
                            const uint64_t *sdispls, uint8_t *work, const uint64_t *rcounts,
                            const uint64_t *rdispls) {
    Builder b(info);
    int n = info.world_size, r = info.rank;
    // Start with the next rank up so that not every rank sends to rank 0 first.
    for (int i = 1; i < n; ++i) {
        int p = mod(r + i, n);
        for (uint64_t k = 0; k < b.chunks(scounts[p]); ++k)
            b.send(p, sendbuf + (sdispls[p] + b.chunk_off(scounts[p], k)) * b.es, b.chunk_len(scounts[p], k),
                   -1, scounts[p]);
        int q = mod(r - i, n);
        for (uint64_t k = 0; k < b.chunks(rcounts[q]); ++k)
            b.recv(q, work + (rdispls[q] + b.chunk_off(rcounts[q], k)) * b.es, b.chunk_len(rcounts[q], k),
                   rcounts[q]);
    }
    return b.s;
}

Schedule p2p_send(const OpInfo &info, int peer, const uint8_t *buf) {
    Builder b(info);
    b.s.watch_all = false;
    for (uint64_t k = 0; k < b.chunks(info.count); ++k)
        b.send(peer, buf + b.chunk_off(info.count, k) * b.es, b.chunk_len(info.count, k), -1, info.count);
    return b.s;
}

Schedule p2p_recv(const OpInfo &info, int peer, uint8_t *work) {
    Builder b(info);
    b.s.watch_all = false;
    for (uint64_t k = 0; k < b.chunks(info.count); ++k)
        b.recv(peer, work + b.chunk_off(info.count, k) * b.es, b.chunk_len(info.count, k), info.count);
    return b.s;
}

void append(Schedule &into, const Schedule &part) {
    const int32_t base = int32_t(into.recvs.size());
    for (SendItem it : part.sends) {
        if (it.dep >= 0) it.dep += base;
        into.sends.push_back(it);
    }
    into.recvs.insert(into.recvs.end(), part.recvs.begin(), part.recvs.end());
    into.watch_all = into.watch_all && part.watch_all;
}

}  // namespace pccl
