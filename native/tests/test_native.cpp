// Unit tests of the parts of the data plane that do no I/O: the wire codec,
// float16/bfloat16 conversion, the reduce kernels, the schedules and the sealed records. The
// schedules are executed in memory by matching every rank's sends with its
// peers' receives, so ring correctness is checked without a socket.
// Built and run by tests/test_native.py (with ASan/UBSan).
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <algorithm>
#include <random>
#include <vector>

#include "../src/deal.hpp"
#include "../src/dtype.hpp"
#include "../src/quantize.hpp"
#include "../src/reduce.hpp"
#include "../src/schedule.hpp"
#include "../src/seal.hpp"
#include "../src/wire.hpp"
#include "expect.hpp"

using namespace pccl;

static void test_hello_roundtrip_and_rejects() {
    wire::Hello h;
    h.comm_id = 0x1122334455667788ull;
    h.rank = 3;
    h.world_size = 5;
    uint8_t buf[wire::kHelloSize];
    wire::encode_hello(h, buf);
    EXPECT(buf[0] == 'P' && buf[1] == 'C' && buf[2] == 'C' && buf[3] == 'L');
    wire::Hello out;
    std::string why;
    EXPECT(wire::decode_hello(buf, &out, &why) == pcclSuccess);
    EXPECT(out.comm_id == h.comm_id && out.rank == 3 && out.world_size == 5);

    uint8_t bad[wire::kHelloSize];
    memcpy(bad, buf, sizeof(bad));
    bad[0] = 'G';  // "GET /" from a stray HTTP client
    EXPECT(wire::decode_hello(bad, &out, &why) == pcclProtocolError);
    memcpy(bad, buf, sizeof(bad));
    bad[4] = 99;  // version
    EXPECT(wire::decode_hello(bad, &out, &why) == pcclProtocolError);
    EXPECT(why.find("version") != std::string::npos);
    memcpy(bad, buf, sizeof(bad));
    bad[16] = 9;  // rank 9 of world 5
    EXPECT(wire::decode_hello(bad, &out, &why) == pcclProtocolError);

    // Lanes: lane and lane count round-trip; a lane count of 0 (older builds) reads as 1;
    // a lane outside the sender's count is refused.
    h.lane = 2;
    h.lanes = 4;
    wire::encode_hello(h, buf);
    EXPECT(wire::decode_hello(buf, &out, &why) == pcclSuccess && out.lane == 2 && out.lanes == 4);
    h.lane = 0;
    h.lanes = 0;
    wire::encode_hello(h, buf);
    EXPECT(wire::decode_hello(buf, &out, &why) == pcclSuccess && out.lanes == 1);
    h.lane = 4;
    h.lanes = 4;
    wire::encode_hello(h, buf);
    EXPECT(wire::decode_hello(buf, &out, &why) == pcclProtocolError);
    EXPECT(why.find("lane 4 of 4") != std::string::npos);

    // Streams: stream and stream count round-trip next to the lane; 0 streams (older
    // builds) reads as 1; a stream outside the count is refused. An older build's
    // 32-bit lane/lanes fields read the same (stream 0 of 1).
    h.lane = 1;
    h.lanes = 2;
    h.stream = 3;
    h.streams = 8;
    wire::encode_hello(h, buf);
    EXPECT(wire::decode_hello(buf, &out, &why) == pcclSuccess && out.lane == 1 && out.lanes == 2 &&
           out.stream == 3 && out.streams == 8);
    h.stream = 8;
    wire::encode_hello(h, buf);
    EXPECT(wire::decode_hello(buf, &out, &why) == pcclProtocolError);
    EXPECT(why.find("stream 8 of 8") != std::string::npos);
    memset(buf + 24, 0, 8);
    buf[24] = 1;  // old layout: lane = 1 (32 bits), lanes = 2 (32 bits)
    buf[28] = 2;
    EXPECT(wire::decode_hello(buf, &out, &why) == pcclSuccess && out.lane == 1 && out.lanes == 2 &&
           out.stream == 0 && out.streams == 1);
}

static void test_frame_bounds() {
    wire::FrameHeader h;
    h.coll = wire::kCollAllReduce;
    h.dtype = pcclFloat32;
    h.op = pcclSum;
    h.tag = 7;
    h.step = 2;
    h.seq = 1ull << 40;
    h.count = 12345;
    h.length = 4096;
    uint8_t buf[wire::kFrameHeaderSize];
    wire::encode_frame(h, buf);
    wire::FrameHeader out;
    std::string why;
    EXPECT(wire::decode_frame(buf, &out, &why) == pcclSuccess);
    EXPECT(out.seq == h.seq && out.count == 12345 && out.length == 4096 && out.tag == 7);
    EXPECT(wire::check_expected(out, h, &why) == pcclSuccess);

    h.length = wire::kMaxFramePayload + 1;  // a hostile length must not reach an allocation
    wire::encode_frame(h, buf);
    EXPECT(wire::decode_frame(buf, &out, &why) == pcclProtocolError);
    h.length = 16;
    h.type = wire::kFrameAbort;
    h.length = wire::kMaxAbortPayload + 1;
    wire::encode_frame(h, buf);
    EXPECT(wire::decode_frame(buf, &out, &why) == pcclProtocolError);

    // Every single-byte corruption of a valid header is either rejected or
    // decodes to a header that check_expected distinguishes from the original.
    h = wire::FrameHeader();
    h.coll = wire::kCollAllGather;
    h.dtype = pcclInt32;
    h.count = 10;
    h.length = 40;
    wire::encode_frame(h, buf);
    for (size_t i = 0; i < sizeof(buf); ++i) {
        for (int bit = 0; bit < 8; ++bit) {
            uint8_t c[wire::kFrameHeaderSize];
            memcpy(c, buf, sizeof(c));
            c[i] ^= uint8_t(1u << bit);
            if (wire::decode_frame(c, &out, &why) != pcclSuccess) continue;
            if (out.type == wire::kFrameAbort) continue;
            EXPECT(wire::check_expected(out, h, &why) == pcclMismatch);
        }
    }

    // An ABORT carries the origin's result code: a lost peer stays a lost peer.
    wire::FrameHeader ab;
    ab.type = wire::kFrameAbort;
    ab.count = pcclPeerLost;
    EXPECT(wire::abort_code(ab) == pcclPeerLost);
    ab.count = pcclTimeout;
    EXPECT(wire::abort_code(ab) == pcclRemoteError);
    ab.count = 1ull << 40;  // garbage from the wire is not trusted as a code
    EXPECT(wire::abort_code(ab) == pcclRemoteError);

    // Mismatch messages name the field that differs.
    wire::FrameHeader a = h, b = h;
    b.count = 11;
    EXPECT(wire::check_expected(a, b, &why) == pcclMismatch && why.find("elements") != std::string::npos);
    b = h;
    b.coll = wire::kCollAllReduce;
    EXPECT(wire::check_expected(a, b, &why) == pcclMismatch && why.find("called") != std::string::npos);
    b = h;
    b.root = 2;  // broadcast from a different root
    EXPECT(wire::check_expected(a, b, &why) == pcclMismatch && why.find("root") != std::string::npos);
}

static void test_half_conversions() {
    // Every finite half survives half -> float -> half exactly.
    for (uint32_t u = 0; u < 0x10000; ++u) {
        uint16_t hv = uint16_t(u);
        float f = half_to_float(hv);
        if (std::isnan(f)) {
            EXPECT(std::isnan(half_to_float(float_to_half(f))));
            continue;
        }
        EXPECT(float_to_half(f) == hv);
        uint16_t bv = uint16_t(u);
        float g = bf16_to_float(bv);
        if (!std::isnan(g)) EXPECT(float_to_bf16(g) == bv);
    }
    // Round half to even at midpoints: 1 + 2^-11 lies between 1 and 1 + 2^-10.
    EXPECT(float_to_half(1.0f + std::ldexp(1.0f, -11)) == 0x3C00);
    EXPECT(float_to_half(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3C02);
    EXPECT(float_to_half(65520.0f) == 0x7C00);  // rounds to +inf
    EXPECT(float_to_half(65519.0f) == 0x7BFF);
    EXPECT(float_to_half(std::ldexp(1.0f, -25)) == 0x0000);            // tie to even (zero)
    EXPECT(float_to_half(std::ldexp(1.5f, -25)) == 0x0001);
    EXPECT(float_to_bf16(1.0f + std::ldexp(1.0f, -8)) == 0x3F80);      // tie to even
    EXPECT(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)) == 0x3F82);
}

static void test_reduce_kernels() {
    int8_t a[3] = {127, -128, 5}, b[3] = {1, -1, -7};
    reduce_into(a, b, 3, pcclInt8, pcclSum);  // wraps, no UB (UBSan checks)
    EXPECT(a[0] == -128 && a[1] == 127 && a[2] == -2);
    int64_t m[2] = {INT64_MAX, 3}, n[2] = {2, -5};
    reduce_into(m, n, 2, pcclInt64, pcclProd);
    EXPECT(m[0] == -2 && m[1] == -15);
    float f[3] = {1.0f, NAN, -3.0f}, g[3] = {2.0f, 0.0f, -4.0f};
    reduce_into(f, g, 3, pcclFloat32, pcclMin);
    EXPECT(f[0] == 1.0f && std::isnan(f[1]) && f[2] == -4.0f);
    int32_t s[2] = {7, -7};
    finalize_avg(s, 2, pcclInt32, 2);
    EXPECT(s[0] == 3 && s[1] == -3);  // truncation toward zero
    uint16_t h1 = float_to_half(1.5f), h2 = float_to_half(2.25f);
    reduce_into(&h1, &h2, 1, pcclFloat16, pcclSum);
    EXPECT(half_to_float(h1) == 3.75f);
    uint8_t u[1] = {200}, v[1] = {100};
    reduce_into(u, v, 1, pcclUInt8, pcclMax);
    EXPECT(u[0] == 200);
}

// Executes the schedules of all ranks in memory as the engine deals them (deal.hpp): each
// rank's ready frames to a peer go onto a random one of `streams` FIFO streams, the fronts
// of the streams are delivered in a random order, and each frame is placed by its header
// (Arrivals), after which the receive's reduce runs and its dependent sends become ready.
// Returns false on any refused header (mismatch) or a frame left undelivered.
static bool simulate(std::vector<Schedule> &s, int streams = 3, unsigned seed = 1) {
    const int n = int(s.size());
    std::mt19937 rng(seed);
    std::vector<Dealer> dealers;
    std::vector<Arrivals> arrivals;
    std::vector<size_t> left(size_t(n), 0);
    for (int r = 0; r < n; ++r) {
        dealers.emplace_back(s[size_t(r)], n);
        arrivals.emplace_back(s[size_t(r)], n, 1);
        left[size_t(r)] = s[size_t(r)].sends.size() + s[size_t(r)].recvs.size();
    }
    // wires[(from * n + to) * streams + k]: send items of `from` in flight to `to`.
    std::vector<std::deque<int32_t>> wires(size_t(n * n * streams));
    bool progress = true;
    while (progress) {
        progress = false;
        for (int r = 0; r < n; ++r)
            for (int p = 0; p < n; ++p)
                for (int32_t it; (it = dealers[size_t(r)].take(p)) >= 0; progress = true) {
                    wires[size_t((r * n + p) * streams) + rng() % unsigned(streams)].push_back(it);
                    --left[size_t(r)];
                }
        std::vector<size_t> order(wires.size());
        for (size_t i = 0; i < order.size(); ++i) order[i] = i;
        std::shuffle(order.begin(), order.end(), rng);
        for (size_t w : order) {
            if (wires[w].empty() || (progress && rng() % 2)) continue;
            const int from = int(w / size_t(streams)) / n, to = int(w / size_t(streams)) % n;
            const SendItem &it = s[size_t(from)].sends[size_t(wires[w].front())];
            wires[w].pop_front();
            int32_t ri = -1;
            pcclResult_t rc = pcclSuccess;
            std::string why;
            if (arrivals[size_t(to)].place(from, it.hdr, &ri, &rc, &why) != Arrivals::kPlace) {
                fprintf(stderr, "simulate: %s\n", why.c_str());
                return false;
            }
            RecvItem &rv = s[size_t(to)].recvs[size_t(ri)];
            if (it.len) memcpy(rv.dst, it.data, it.len);  // equal: place checked the length
            size_t es = type_size(s[size_t(to)].dtype);
            if (rv.reduce_src) reduce_into(rv.dst, rv.reduce_src, rv.len / es, s[size_t(to)].dtype, s[size_t(to)].op);
            if (rv.finalize_avg) finalize_avg(rv.dst, rv.len / es, s[size_t(to)].dtype, n);
            dealers[size_t(to)].landed(ri);
            --left[size_t(to)];
            progress = true;
        }
    }
    for (int r = 0; r < n; ++r)
        if (left[size_t(r)] != 0) return false;
    for (const auto &w : wires)
        if (!w.empty()) return false;
    return true;
}

static OpInfo info_for(uint8_t coll, pcclRedOp_t op, uint64_t count, int rank, int n, uint64_t chunk) {
    return OpInfo{coll, pcclInt64, uint8_t(op), 0, 0, 0, count, rank, n, chunk};
}

static void test_schedules() {
    std::mt19937_64 rng(42);
    for (int n = 1; n <= 7; ++n) {
        for (uint64_t count : {0ull, 1ull, 5ull, 64ull, 1001ull}) {
            for (uint64_t chunk : {8ull, 64ull, 1ull << 20}) {
                // all-reduce SUM and AVG on int64 (exact arithmetic)
                for (pcclRedOp_t op : {pcclSum, pcclAvg, pcclMax}) {
                    std::vector<std::vector<int64_t>> in(static_cast<size_t>(n)), work(static_cast<size_t>(n));
                    std::vector<int64_t> want(count, op == pcclMax ? INT64_MIN : 0);
                    for (int r = 0; r < n; ++r) {
                        in[size_t(r)].resize(count);
                        work[size_t(r)].assign(count, -999);
                        for (auto &x : in[size_t(r)]) x = int64_t(rng() % 1000) - 500;
                        for (uint64_t i = 0; i < count; ++i)
                            want[i] = op == pcclMax ? std::max(want[i], in[size_t(r)][i])
                                                    : want[i] + in[size_t(r)][i];
                    }
                    if (op == pcclAvg)
                        for (auto &w : want) w /= n;
                    if (n == 1) continue;  // the API copies; no schedule
                    std::vector<Schedule> s;
                    for (int r = 0; r < n; ++r)
                        s.push_back(ring_allreduce(info_for(wire::kCollAllReduce, op, count, r, n, chunk),
                                                   (const uint8_t *)in[size_t(r)].data(),
                                                   (uint8_t *)work[size_t(r)].data()));
                    EXPECT(simulate(s, 1 + int(chunk % 3), unsigned(n * 1000 + count)));
                    for (int r = 0; r < n; ++r) EXPECT(work[size_t(r)] == want);
                }
                if (n == 1) continue;
                // reduce-scatter: rank r owns slice r
                {
                    std::vector<std::vector<int64_t>> in(static_cast<size_t>(n)), work(static_cast<size_t>(n));
                    std::vector<int64_t> want(count * uint64_t(n), 0);
                    for (int r = 0; r < n; ++r) {
                        in[size_t(r)].resize(count * uint64_t(n));
                        work[size_t(r)].assign(count * uint64_t(n), -999);
                        for (size_t i = 0; i < in[size_t(r)].size(); ++i) {
                            in[size_t(r)][i] = int64_t(rng() % 100);
                            want[i] += in[size_t(r)][i];
                        }
                    }
                    std::vector<Schedule> s;
                    for (int r = 0; r < n; ++r)
                        s.push_back(ring_reduce_scatter(info_for(wire::kCollReduceScatter, pcclSum, count, r, n, chunk),
                                                        (const uint8_t *)in[size_t(r)].data(),
                                                        (uint8_t *)work[size_t(r)].data()));
                    EXPECT(simulate(s));
                    for (int r = 0; r < n; ++r)
                        for (uint64_t i = 0; i < count; ++i)
                            EXPECT(work[size_t(r)][uint64_t(r) * count + i] == want[uint64_t(r) * count + i]);
                }
                // all-gather and broadcast from every root
                {
                    std::vector<std::vector<int64_t>> in(static_cast<size_t>(n)), work(static_cast<size_t>(n));
                    for (int r = 0; r < n; ++r) {
                        in[size_t(r)].assign(count, r * 1000 + 1);
                        work[size_t(r)].assign(count * uint64_t(n), -1);
                    }
                    std::vector<Schedule> s;
                    for (int r = 0; r < n; ++r)
                        s.push_back(ring_allgather(info_for(wire::kCollAllGather, pcclSum, count, r, n, chunk),
                                                   (const uint8_t *)in[size_t(r)].data(),
                                                   (uint8_t *)work[size_t(r)].data()));
                    EXPECT(simulate(s));
                    for (int r = 0; r < n; ++r)
                        for (int q = 0; q < n; ++q)
                            if (q != r)
                                for (uint64_t i = 0; i < count; ++i)
                                    EXPECT(work[size_t(r)][uint64_t(q) * count + i] == q * 1000 + 1);
                    for (int root = 0; root < n; ++root) {
                        std::vector<Schedule> b;
                        std::vector<std::vector<int64_t>> out(size_t(n), std::vector<int64_t>(count, -1));
                        for (int r = 0; r < n; ++r)
                            b.push_back(chain_broadcast(info_for(wire::kCollBroadcast, pcclSum, count, r, n, chunk), root,
                                                        (const uint8_t *)in[size_t(root)].data(),
                                                        (uint8_t *)out[size_t(r)].data()));
                        EXPECT(simulate(b));
                        for (int r = 0; r < n; ++r)
                            if (r != root) EXPECT(out[size_t(r)] == in[size_t(root)]);
                    }
                }
            }
        }
    }
    // A rank that disagrees on the count is caught by the header check.
    std::vector<int64_t> a(10, 1), b(11, 1), wa(10), wb(11);
    std::vector<Schedule> s;
    s.push_back(ring_allreduce(info_for(wire::kCollAllReduce, pcclSum, 10, 0, 2, 64), (const uint8_t *)a.data(), (uint8_t *)wa.data()));
    s.push_back(ring_allreduce(info_for(wire::kCollAllReduce, pcclSum, 11, 1, 2, 64), (const uint8_t *)b.data(), (uint8_t *)wb.data()));
    EXPECT(!simulate(s));
}

// Dealing (deal.hpp): the earliest ready frame first, dependents after their receive, a
// frame given back taken again; and every verdict on a header from the network.
static void test_dealing() {
    std::vector<int64_t> in(40, 1), work(40, 0);
    // Rank 0 of 2, all-reduce of 40 int64 in chunks of 8: 3 frames each way per half.
    Schedule ar = ring_allreduce(info_for(wire::kCollAllReduce, pcclSum, 40, 0, 2, 64),
                                 (const uint8_t *)in.data(), (uint8_t *)work.data());
    EXPECT(ar.sends.size() == 6 && ar.recvs.size() == 6);
    Dealer d(ar, 2);
    EXPECT(d.take(1) == 0 && d.take(1) == 1);  // the reduce-scatter's first frames: no dependency
    d.give_back(0);
    EXPECT(d.take(1) == 0 && d.take(1) == 2 && d.take(1) == -1 && !d.ready(1));
    d.landed(ar.sends[4].dep);  // the all-gather frame that waited for it
    EXPECT(d.ready(1) && d.take(1) == 4 && d.take(0) == -1);

    Arrivals a(ar, 2, 8);
    int32_t item = -1;
    pcclResult_t rc = pcclSuccess;
    std::string why;
    auto frame = [&](uint32_t step) {
        wire::FrameHeader h = ar.recvs[0].expect;
        h.step = step;
        h.length = ar.recvs[size_t(step)].len;
        return h;
    };
    EXPECT(a.unclaimed(1) == 6 && a.first_unclaimed(1) == 0);
    EXPECT(a.place(1, frame(4), &item, &rc, &why) == Arrivals::kPlace && item == 4);  // any order
    EXPECT(a.unclaimed(1) == 5 && a.first_unclaimed(1) == 0);
    EXPECT(a.place(1, frame(4), &item, &rc, &why) == Arrivals::kRefuse && rc == pcclProtocolError &&
           why.find("twice") != std::string::npos);
    wire::FrameHeader h = frame(0);
    h.step = 6;
    EXPECT(a.place(1, h, &item, &rc, &why) == Arrivals::kRefuse && rc == pcclProtocolError &&
           why.find("frames 0..5") != std::string::npos);
    h.step = 0xFFFFFFFFu;
    EXPECT(a.place(1, h, &item, &rc, &why) == Arrivals::kRefuse && rc == pcclProtocolError);
    h = frame(1);
    h.length += 8;  // a frame of another size: the chunking differs
    EXPECT(a.place(1, h, &item, &rc, &why) == Arrivals::kRefuse && rc == pcclMismatch);
    h = frame(1);
    h.count = 41;
    EXPECT(a.place(1, h, &item, &rc, &why) == Arrivals::kRefuse && rc == pcclMismatch &&
           why.find("41 elements") != std::string::npos);
    h.count = 40;
    h.step = 9;  // out of range and of another count: named as the mismatch it is
    h.count = 41;
    EXPECT(a.place(1, h, &item, &rc, &why) == Arrivals::kRefuse && rc == pcclMismatch);
    h = frame(1);
    h.seq = 1;  // the next collective: leave it for that op
    EXPECT(a.place(1, h, &item, &rc, &why) == Arrivals::kLater);
    h.coll = wire::kCollP2P;  // a message the peer sent after this op
    h.seq = 0;
    EXPECT(a.place(1, h, &item, &rc, &why) == Arrivals::kLater);
    EXPECT(a.unclaimed(1) == 5);
    // An earlier collective: the peers disagree (this op is #0, so build one at #3).
    OpInfo at3 = info_for(wire::kCollAllReduce, pcclSum, 40, 0, 2, 64);
    at3.seq = 3;
    Schedule ar3 = ring_allreduce(at3, (const uint8_t *)in.data(), (uint8_t *)work.data());
    Arrivals a3(ar3, 2, 4);
    h = frame(0);
    h.seq = 2;
    EXPECT(a3.place(1, h, &item, &rc, &why) == Arrivals::kRefuse && rc == pcclMismatch &&
           why.find("#2") != std::string::npos);
    h.coll = wire::kCollBroadcast;  // same op number, another collective
    h.seq = 3;
    EXPECT(a3.place(1, h, &item, &rc, &why) == Arrivals::kRefuse && rc == pcclMismatch &&
           why.find("broadcast") != std::string::npos);

    // Point-to-point: messages are numbered per peer; a batch may take several.
    OpInfo m5 = info_for(wire::kCollP2P, pcclSum, 20, 0, 2, 64);
    m5.op = wire::kNoOp;
    m5.seq = 5;
    m5.tag = 7;
    OpInfo m6 = m5;
    m6.seq = 6;
    Schedule batch = p2p_recv(m5, 1, (uint8_t *)work.data());
    append(batch, p2p_recv(m6, 1, (uint8_t *)work.data() + 160));
    Arrivals pa(batch, 2, 8);
    EXPECT(pa.unclaimed(1) == 6);
    h = batch.recvs[4].expect;  // message 6, step 1
    EXPECT(pa.place(1, h, &item, &rc, &why) == Arrivals::kPlace && item == 4);
    h.seq = 7;
    EXPECT(pa.place(1, h, &item, &rc, &why) == Arrivals::kLater);
    h.seq = 4;
    EXPECT(pa.place(1, h, &item, &rc, &why) == Arrivals::kRefuse && rc == pcclMismatch);
    h = batch.recvs[0].expect;
    h.tag = 8;
    EXPECT(pa.place(1, h, &item, &rc, &why) == Arrivals::kRefuse && rc == pcclMismatch &&
           why.find("tag") != std::string::npos);
    h = frame(0);  // a collective during a point-to-point op: later unless already run
    h.seq = 8;
    EXPECT(pa.place(1, h, &item, &rc, &why) == Arrivals::kLater);
    h.seq = 7;
    EXPECT(pa.place(1, h, &item, &rc, &why) == Arrivals::kRefuse && rc == pcclMismatch);
    EXPECT(pa.place(0, batch.recvs[0].expect, &item, &rc, &why) == Arrivals::kLater);  // none from rank 0

    // The quantized all-reduce's first phase: frames numbered past it are its second's.
    std::vector<float> f(100, 1.0f);
    quant::AllReducePlan plan(OpInfo{wire::kCollAllReduceInt8, pcclFloat32, pcclSum, 64, 0, 0, 100, 0, 2, 1 << 20},
                              pcclQuantInt8, 64);
    std::vector<uint8_t> w(plan.staging_bytes());
    Schedule one = plan.exchange(f.data(), w.data());
    EXPECT(one.continued && one.recvs.size() == 1);
    Arrivals qa(one, 2, 1);
    h = one.recvs[0].expect;
    h.step = 1;
    EXPECT(qa.place(1, h, &item, &rc, &why) == Arrivals::kLater);
    h.step = 0;
    EXPECT(qa.place(1, h, &item, &rc, &why) == Arrivals::kPlace && item == 0);
    Schedule two = plan.reduce_and_share(f.data(), w.data());
    EXPECT(!two.continued);
    Arrivals qb(two, 2, 1);
    h = two.recvs[0].expect;
    EXPECT(h.step == 1);
    h.step = 0;  // the first phase's frame again
    EXPECT(qb.place(1, h, &item, &rc, &why) == Arrivals::kRefuse);
}

// Block-wise codecs: layout, round half to even, clamping, int4 packing, the
// zero and non-finite blocks, the error bound, 16-bit inputs, hostile bytes.
static void test_quant_codec() {
    using namespace quant;
    EXPECT(message_bytes(0, pcclQuantInt8, 4) == 0);
    EXPECT(message_bytes(5, pcclQuantInt8, 2) == 3 * 4 + 5);
    EXPECT(message_bytes(5, pcclQuantInt4, 2) == 3 * 4 + 3);

    // absmax 127 gives scale 1: codes are the values rounded half to even.
    float x[8] = {127.0f, 0.5f, 1.5f, 2.5f, -0.5f, -1.5f, -2.5f, 126.5f};
    uint8_t m8[4 + 8];
    encode(x, pcclFloat32, 8, pcclQuantInt8, 8, m8);
    const int8_t want8[8] = {127, 0, 2, 2, 0, -2, -2, 126};
    EXPECT(memcmp(m8 + 4, want8, 8) == 0);
    float back[8];
    decode_f32(m8, 8, pcclQuantInt8, 8, back, false);
    for (int i = 0; i < 8; ++i) EXPECT(back[i] == float(want8[i]));

    // int4: absmax 7 gives scale 1; two codes per byte, low nibble first.
    float y[6] = {7.0f, 0.5f, 1.5f, -2.5f, -7.0f, 3.49f};
    uint8_t m4[4 + 3];
    encode(y, pcclFloat32, 6, pcclQuantInt4, 6, m4);
    EXPECT(m4[4] == 0x07 && m4[5] == 0xE2 && m4[6] == 0x39);
    float yb[6];
    decode_f32(m4, 6, pcclQuantInt4, 6, yb, false);
    const float want4[6] = {7, 0, 2, -2, -7, 3};
    for (int i = 0; i < 6; ++i) EXPECT(yb[i] == want4[i]);
    // Odd blocks: a block starts mid-byte; decode_f32 with add accumulates.
    float z[5] = {1.0f, -7.0f, 7.0f, 3.5f, 0.0f};
    uint8_t mz[4 * 3 + 3];
    encode(z, pcclFloat32, 5, pcclQuantInt4, 2, mz);
    float zb[5] = {1, 1, 1, 1, 1};
    decode_f32(mz, 5, pcclQuantInt4, 2, zb, true);
    EXPECT(zb[0] == 1.0f + 1.0f && zb[1] == 1.0f - 7.0f && zb[2] == 1.0f + 7.0f);
    EXPECT(zb[3] == 1.0f + 4.0f && zb[4] == 1.0f);  // 3.5 ties to even 4; absmax 0 -> scale 0

    // Zero block, and a non-finite block that poisons only itself.
    float w[8] = {0.0f, -0.0f, 1.0f, INFINITY, NAN, 3.0f, 2.0f, -2.0f};
    uint8_t mw[4 * 4 + 8];
    encode(w, pcclFloat32, 8, pcclQuantInt8, 2, mw);
    float wb[8];
    decode_f32(mw, 8, pcclQuantInt8, 2, wb, false);
    EXPECT(wb[0] == 0.0f && wb[1] == 0.0f);
    EXPECT(std::isnan(wb[2]) && std::isnan(wb[3]) && std::isnan(wb[4]) && std::isnan(wb[5]));
    EXPECT(wb[6] == 2.0f && wb[7] == -2.0f);

    // The largest finite float stays finite: FLT_MAX / 127 rounds up, and 127 times
    // that scale overflowed to infinity until block_scale stepped it down (a
    // native/fuzz/fuzz_quant.cpp finding).
    for (pcclQuantType_t q : {pcclQuantInt8, pcclQuantInt4}) {
        float big[3] = {FLT_MAX, -FLT_MAX, 1.0f};
        uint8_t mb[4 + 3];
        encode(big, pcclFloat32, 3, q, 3, mb);
        float bb[3];
        decode_f32(mb, 3, q, 3, bb, false);
        float scale = FLT_MAX / float(qmax(q));
        for (int i = 0; i < 2; ++i)
            EXPECT(std::isfinite(bb[i]) && std::fabs(double(big[i]) - bb[i]) <= scale * 0.5);
    }

    // Error bound on random data: |x - decoded| <= scale / 2 per block.
    std::mt19937_64 rng(7);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    for (pcclQuantType_t q : {pcclQuantInt8, pcclQuantInt4}) {
        for (uint32_t block : {1u, 3u, 64u, 1000u}) {
            const uint64_t n = 2049;
            std::vector<float> v(n), d(n);
            for (auto &e : v) e = normal(rng);
            std::vector<uint8_t> msg(message_bytes(n, q, block));
            encode(v.data(), pcclFloat32, n, q, block, msg.data());
            decode_f32(msg.data(), n, q, block, d.data(), false);
            for (uint64_t first = 0; first < n; first += block) {
                uint64_t end = std::min<uint64_t>(n, first + block);
                float amax = 0;
                for (uint64_t i = first; i < end; ++i) amax = std::max(amax, std::fabs(v[i]));
                float scale = amax / float(qmax(q));
                for (uint64_t i = first; i < end; ++i)
                    EXPECT(std::fabs(v[i] - d[i]) <= scale * 0.5f * (1 + 1e-5f));
            }
            // float16 / bfloat16 inputs encode like their float32 values.
            std::vector<uint16_t> h(n), b(n);
            std::vector<float> hf(n), bf(n);
            for (uint64_t i = 0; i < n; ++i) {
                h[i] = float_to_half(v[i]);
                hf[i] = half_to_float(h[i]);
                b[i] = float_to_bf16(v[i]);
                bf[i] = bf16_to_float(b[i]);
            }
            std::vector<uint8_t> m1(msg.size()), m2(msg.size());
            encode(h.data(), pcclFloat16, n, q, block, m1.data());
            encode(hf.data(), pcclFloat32, n, q, block, m2.data());
            EXPECT(m1 == m2);
            encode(b.data(), pcclBFloat16, n, q, block, m1.data());
            encode(bf.data(), pcclFloat32, n, q, block, m2.data());
            EXPECT(m1 == m2);
            // 16-bit outputs round the float32 decode once.
            std::vector<uint16_t> out(n);
            decode(msg.data(), n, q, block, out.data(), pcclBFloat16);
            for (uint64_t i = 0; i < n; ++i) EXPECT(out[i] == float_to_bf16(d[i]));
        }
    }

    // Bytes from a hostile peer (NaN/huge scales, code -128, any nibble) decode
    // without undefined behaviour (UBSan watches).
    std::vector<uint8_t> junk(message_bytes(300, pcclQuantInt8, 7));
    for (auto &c : junk) c = uint8_t(rng());
    junk[0] = junk[1] = junk[2] = junk[3] = 0xFF;  // NaN scale
    std::vector<float> out(300);
    std::vector<uint16_t> out16(300);
    decode_f32(junk.data(), 300, pcclQuantInt8, 7, out.data(), false);
    decode(junk.data(), 300, pcclQuantInt4, 7, out16.data(), pcclFloat16);
}

// The whole quantized all-reduce in memory: every rank's plan, phase 1
// simulated, the owners' reduction, phase 2 simulated, the decode. Checks bit
// parity across ranks and the error bound against a float64 reference.
static void test_quant_allreduce() {
    using namespace quant;
    std::mt19937_64 rng(11);
    std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
    for (int n = 1; n <= 5; ++n) {
        for (uint64_t count : {0ull, 1ull, 7ull, 1031ull}) {
            for (uint32_t block : {1u, 3u, 64u, 256u}) {
                for (pcclQuantType_t q : {pcclQuantInt8, pcclQuantInt4}) {
                    for (pcclRedOp_t op : {pcclSum, pcclAvg}) {
                        uint64_t chunk = (count + block) % 2 ? 8 : 1 << 20;
                        std::vector<std::vector<float>> in(static_cast<size_t>(n)), out(static_cast<size_t>(n));
                        std::vector<std::vector<uint8_t>> work(static_cast<size_t>(n));
                        std::vector<AllReducePlan> plans;
                        for (int r = 0; r < n; ++r) {
                            in[size_t(r)].resize(count);
                            for (auto &e : in[size_t(r)]) e = uni(rng) * float(r + 1);
                            out[size_t(r)].assign(count, -12345.0f);
                            OpInfo info{coll_of(q), pcclFloat32, uint8_t(op), uint16_t(block), 3,
                                        9, count, r, n, chunk};
                            plans.emplace_back(info, q, block);
                            work[size_t(r)].assign(plans.back().staging_bytes() + 1, 0xAB);
                        }
                        std::vector<Schedule> s;
                        for (int r = 0; r < n; ++r)
                            s.push_back(plans[size_t(r)].exchange(in[size_t(r)].data(), work[size_t(r)].data()));
                        EXPECT(simulate(s));
                        s.clear();
                        for (int r = 0; r < n; ++r)
                            s.push_back(plans[size_t(r)].reduce_and_share(in[size_t(r)].data(), work[size_t(r)].data()));
                        EXPECT(simulate(s));
                        for (int r = 0; r < n; ++r)
                            plans[size_t(r)].decode_result(work[size_t(r)].data(), out[size_t(r)].data());
                        for (int r = 1; r < n; ++r)  // bit parity
                            EXPECT(count == 0 || memcmp(out[0].data(), out[size_t(r)].data(), count * 4) == 0);
                        const double qm = qmax(q), div = op == pcclAvg ? n : 1;
                        for (uint64_t first = 0; first < count; first += block) {
                            uint64_t end = std::min<uint64_t>(count, first + block);
                            int owner = 0;
                            while (!(first >= plans[0].slice_begin(owner) &&
                                     first < plans[0].slice_begin(owner) + plans[0].slice_size(owner)))
                                ++owner;
                            double in_err = 0, out_amax = 0;
                            for (int r = 0; r < n; ++r) {
                                double amax = 0;
                                for (uint64_t i = first; i < end; ++i)
                                    amax = std::max(amax, std::fabs(double(in[size_t(r)][i])));
                                if (r != owner) in_err += amax / qm / 2;
                            }
                            for (uint64_t i = first; i < end; ++i)
                                out_amax = std::max(out_amax, std::fabs(double(out[0][i])));
                            double bound = in_err / div + out_amax / qm / 2 + 1e-5;
                            for (uint64_t i = first; i < end; ++i) {
                                double exact = 0;
                                for (int r = 0; r < n; ++r) exact += in[size_t(r)][i];
                                EXPECT(std::fabs(exact / div - out[0][i]) <= bound);
                            }
                        }
                    }
                }
            }
        }
    }
    // Peers that disagree on the quantization type or the block are caught by the headers.
    for (int which = 0; which < 2; ++which) {
        std::vector<float> a(100, 1.0f), b(100, 1.0f);
        std::vector<AllReducePlan> plans;
        for (int r = 0; r < 2; ++r) {
            pcclQuantType_t q = which == 0 && r == 1 ? pcclQuantInt4 : pcclQuantInt8;
            uint32_t block = which == 1 && r == 1 ? 32 : 64;
            plans.emplace_back(OpInfo{coll_of(q), pcclFloat32, pcclSum, uint16_t(block), 0, 0, 100, r, 2, 1 << 20},
                               q, block);
        }
        std::vector<uint8_t> w0(plans[0].staging_bytes()), w1(plans[1].staging_bytes());
        std::vector<Schedule> s{plans[0].exchange(a.data(), w0.data()), plans[1].exchange(b.data(), w1.data())};
        std::string why;
        EXPECT(wire::check_expected(s[1].sends[0].hdr, s[0].recvs[0].expect, &why) == pcclMismatch);
        EXPECT(why.find(which == 0 ? "all_reduce_int4" : "block 32") != std::string::npos);
        EXPECT(!simulate(s));
    }
}

// Two ends of one link keyed from the same exchange: what one seals the other opens, in
// order only; a peek takes no record number; a rewound number is the next one sealed.
static void test_sealed_records() {
    std::vector<uint8_t> secret(24, 7);
    uint8_t hello_c[wire::kHelloSize] = {1}, hello_a[wire::kHelloSize] = {2};
    uint8_t nonce_c[32] = {3}, nonce_a[32] = {4};
    seal::LinkSeal conn, acc, other;
    EXPECT(seal::derive(secret, true, hello_c, hello_a, nonce_c, nonce_a, &conn));
    EXPECT(seal::derive(secret, false, hello_c, hello_a, nonce_c, nonce_a, &acc));
    nonce_a[0] ^= 1;  // another link's exchange: other keys
    EXPECT(seal::derive(secret, false, hello_c, hello_a, nonce_c, nonce_a, &other));

    uint8_t msg[40], rec[3][40 + seal::kTagSize], out[40];
    for (int i = 0; i < 40; ++i) msg[i] = uint8_t(i);
    for (int r = 0; r < 3; ++r) {
        msg[0] = uint8_t(r);
        EXPECT(conn.out.seal(msg, sizeof(msg), rec[r]));
    }
    EXPECT(memcmp(rec[0] + 1, msg + 1, 39) != 0);                  // not in the clear
    EXPECT(!other.in.peek(rec[0], 40, out));                        // another link's keys
    EXPECT(!acc.in.peek(rec[1], 40, out));                          // out of order
    EXPECT(acc.in.peek(rec[0], 40, out) && out[0] == 0 && acc.in.next() == 0);
    EXPECT(acc.in.open(rec[0], 40, out) && out[0] == 0 && out[39] == 39);
    EXPECT(!acc.in.open(rec[0], 40, out));                          // replayed: fails...
    EXPECT(acc.in.next() == 2);                                     // ... and is spent
    uint8_t flipped[40 + seal::kTagSize];
    memcpy(flipped, rec[2], sizeof(flipped));
    flipped[40 + seal::kTagSize - 1] ^= 0x80;                       // a bit of the tag
    EXPECT(!acc.in.peek(flipped, 40, out));
    EXPECT(acc.in.peek(rec[2], 40, out) && out[0] == 2);

    // A streamed record (a payload) opened in place in uneven pieces.
    std::vector<uint8_t> payload(1000), wire_bytes(1000);
    for (size_t i = 0; i < payload.size(); ++i) payload[i] = uint8_t(i * 7);
    uint8_t tag[seal::kTagSize];
    EXPECT(acc.out.begin() && acc.out.update(payload.data(), wire_bytes.data(), 333) &&
           acc.out.update(payload.data() + 333, wire_bytes.data() + 333, 667) &&
           acc.out.finish_seal(tag));
    EXPECT(conn.in.begin() && conn.in.update(wire_bytes.data(), wire_bytes.data(), 17) &&
           conn.in.update(wire_bytes.data() + 17, wire_bytes.data() + 17, 983));
    EXPECT(conn.in.finish_open(tag) && wire_bytes == payload);

    // A sealed record that never left is taken back: the next one reuses its number.
    uint64_t before = conn.out.next();
    EXPECT(conn.out.seal(msg, sizeof(msg), rec[0]));
    conn.out.rewind(before);
    EXPECT(conn.out.seal(msg, sizeof(msg), rec[1]));
    EXPECT(memcmp(rec[0], rec[1], sizeof(rec[0])) == 0);
}

int main() {
    test_hello_roundtrip_and_rejects();
    test_frame_bounds();
    test_half_conversions();
    test_reduce_kernels();
    test_schedules();
    test_dealing();
    test_quant_codec();
    test_quant_allreduce();
    test_sealed_records();
    return report("native unit tests");
}
