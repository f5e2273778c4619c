// libFuzzer target for the wire codec (native/src/wire.cpp): the 32-byte hello and
// the 40-byte frame header are the first bytes a remote peer controls, so their
// decoders must accept exactly what docs/protocol.md allows and nothing else.
//
// Each input is cut into fixed parts (zero-padded when short, so every input
// reaches every check):
//   [0, 32)    a received hello         -> decode_hello
//   [32, 72)   a received frame header  -> decode_frame, abort_code, coll_name
//   [72, 112)  raw header fields of what this rank expects, and
//   [112, 114) a mask choosing which of them copy the received header's instead
//                                       -> check_expected
// Properties, any violation aborts (libFuzzer then saves the input):
//   - decode_hello / decode_frame accept a buffer exactly when the rules of
//     docs/protocol.md, restated below from the bytes independently of wire.cpp,
//     hold; an accepted buffer decodes to the fields at the documented offsets and
//     encodes back to the same bytes (a hello's lanes/streams of 0 read as 1);
//     a rejection comes with a reason;
//   - abort_code is pcclPeerLost exactly for a count of pcclPeerLost;
//   - check_expected succeeds exactly when the nine compared fields are equal,
//     and otherwise names the first that differs.
// The decoders read from heap copies of exactly 32 and 40 bytes, so AddressSanitizer
// reports a read past the header; UBSan watches the shifts and conversions.
// Built and run by benchmarks/fuzz_wire.py (in the suite, bounded, by
// tests/native/test_fuzz_wire.py); see docs/protocol.md#fuzzing.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "wire.hpp"
#include "check.hpp"

using namespace pccl;


namespace {

constexpr size_t kWantOffset = wire::kHelloSize + wire::kFrameHeaderSize;  // 72
constexpr size_t kMaskOffset = kWantOffset + wire::kFrameHeaderSize;       // 112
constexpr size_t kInputSize = kMaskOffset + 2;

// Little-endian reads, written again here so the checks do not share wire.cpp's code.
uint64_t le(const uint8_t *p, int bytes) {
    uint64_t v = 0;
    for (int i = bytes - 1; i >= 0; --i) v = v << 8 | p[i];
    return v;
}

// An exact-size heap copy: the decoder reading byte n trips AddressSanitizer.
std::unique_ptr<uint8_t[]> exact_copy(const uint8_t *p, size_t n) {
    std::unique_ptr<uint8_t[]> c(new uint8_t[n]);
    memcpy(c.get(), p, n);
    return c;
}

void fuzz_hello(const uint8_t *raw) {
    auto in = exact_copy(raw, wire::kHelloSize);
    wire::Hello h;
    std::string why;
    pcclResult_t rc = wire::decode_hello(in.get(), &h, &why);
    const uint64_t rank = le(raw + 16, 4), world = le(raw + 20, 4);
    const uint64_t lane = le(raw + 24, 2), stream = le(raw + 26, 2);
    const uint64_t lanes = le(raw + 28, 2) ? le(raw + 28, 2) : 1;
    const uint64_t streams = le(raw + 30, 2) ? le(raw + 30, 2) : 1;
    // 1: data link, 2: with authentication, 3: authenticated and encrypted
    const uint64_t kind = le(raw + 6, 2);
    const bool valid = le(raw, 4) == 0x4C434350u && le(raw + 4, 2) == 1 &&
                       (kind >= 1 && kind <= 3) && world > 0 && rank < world && lane < lanes &&
                       stream < streams;
    CHECK(rc == (valid ? pcclSuccess : pcclProtocolError));
    if (rc != pcclSuccess) {
        CHECK(!why.empty());
        return;
    }
    CHECK(h.magic == 0x4C434350u && h.version == 1 && h.kind == kind);
    CHECK(h.comm_id == le(raw + 8, 8) && h.rank == rank && h.world_size == world);
    CHECK(h.lane == lane && h.stream == stream && h.lanes == lanes && h.streams == streams);
    uint8_t again[wire::kHelloSize];
    wire::encode_hello(h, again);
    CHECK(memcmp(again, raw, 28) == 0);  // the 0 -> 1 reading of lanes/streams aside
    CHECK(le(again + 28, 2) == lanes && le(again + 30, 2) == streams);
    wire::Hello h2;
    CHECK(wire::decode_hello(again, &h2, &why) == pcclSuccess);
    CHECK(h2.kind == h.kind && h2.comm_id == h.comm_id && h2.rank == h.rank &&
          h2.world_size == h.world_size && h2.lane == h.lane && h2.stream == h.stream &&
          h2.lanes == h.lanes && h2.streams == h.streams);
}

// The header at raw's documented offsets, whether or not decode_frame would accept it.
wire::FrameHeader fields(const uint8_t *raw) {
    wire::FrameHeader h;
    h.type = raw[2];
    h.coll = raw[3];
    h.dtype = raw[4];
    h.op = raw[5];
    h.root = uint16_t(le(raw + 6, 2));
    h.tag = uint32_t(le(raw + 8, 4));
    h.step = uint32_t(le(raw + 12, 4));
    h.seq = le(raw + 16, 8);
    h.count = le(raw + 24, 8);
    h.length = le(raw + 32, 8);
    return h;
}

bool same(const wire::FrameHeader &a, const wire::FrameHeader &b) {
    return a.type == b.type && a.coll == b.coll && a.dtype == b.dtype && a.op == b.op &&
           a.root == b.root && a.tag == b.tag && a.step == b.step && a.seq == b.seq &&
           a.count == b.count && a.length == b.length;
}

// Returns the decoded header, or the raw fields when decode_frame rejected them.
wire::FrameHeader fuzz_frame(const uint8_t *raw) {
    auto in = exact_copy(raw, wire::kFrameHeaderSize);
    const wire::FrameHeader f = fields(raw);
    wire::FrameHeader h;
    std::string why;
    pcclResult_t rc = wire::decode_frame(in.get(), &h, &why);
    bool valid = le(raw, 2) == 0xF7A3u;
    if (f.type == wire::kFrameAbort)
        valid = valid && f.length <= 1024;
    else
        valid = valid && f.type == wire::kFrameData && f.coll >= 1 && f.coll <= 9 &&
                f.dtype < pcclNumTypes && (f.op < pcclNumOps || f.op == 0xFF) &&
                f.length <= (1ull << 30);
    CHECK(rc == (valid ? pcclSuccess : pcclProtocolError));

    // abort_code and coll_name take any value: abort_code reads an ABORT header's
    // count, which the decoder does not bound.
    CHECK(wire::abort_code(f) ==
          (f.count == uint64_t(pcclPeerLost) ? pcclPeerLost : pcclRemoteError));
    const char *name = wire::coll_name(f.coll);
    CHECK(name != nullptr && (strcmp(name, "unknown") == 0) == (f.coll < 1 || f.coll > 9));

    if (rc != pcclSuccess) {
        CHECK(!why.empty());
        return f;
    }
    CHECK(same(h, f));
    uint8_t again[wire::kFrameHeaderSize];
    wire::encode_frame(h, again);
    CHECK(memcmp(again, raw, sizeof(again)) == 0);
    wire::FrameHeader h2;
    CHECK(wire::decode_frame(again, &h2, &why) == pcclSuccess && same(h, h2));
    return h;
}

// check_expected(got, want) where each compared field of `want` is either got's own
// (mask bit set) or an arbitrary value, so equal and unequal fields both occur often.
void fuzz_expected(const wire::FrameHeader &got, const uint8_t *want_raw, uint64_t mask) {
    wire::FrameHeader want = fields(want_raw);
    if (mask & 1) want.coll = got.coll;
    if (mask & 2) want.seq = got.seq;
    if (mask & 4) want.tag = got.tag;
    if (mask & 8) want.dtype = got.dtype;
    if (mask & 16) want.op = got.op;
    if (mask & 32) want.root = got.root;
    if (mask & 64) want.count = got.count;
    if (mask & 128) want.step = got.step;
    if (mask & 256) want.length = got.length;

    std::string why;
    CHECK(wire::check_expected(got, got, &why) == pcclSuccess);
    pcclResult_t rc = wire::check_expected(got, want, &why);
    // The compared fields in the order check_expected reports them, each with a word
    // its sentence must contain (dtype's sentence names the two types, no fixed word).
    const struct {
        bool differs;
        const char *word;
    } order[] = {
        {got.coll != want.coll, "called"},
        {got.seq != want.seq, "is at"},
        {got.tag != want.tag, "tag"},
        {got.dtype != want.dtype, ""},
        {got.op != want.op, "op"},
        {got.root != want.root,
         got.coll == wire::kCollAllReduceInt8 || got.coll == wire::kCollAllReduceInt4 ? "block"
                                                                                      : "root"},
        {got.count != want.count, "elements"},
        {got.step != want.step || got.length != want.length, "frame"},
    };
    for (const auto &field : order) {
        if (!field.differs) continue;
        CHECK(rc == pcclMismatch && !why.empty());
        CHECK(why.find(field.word) != std::string::npos);
        return;
    }
    CHECK(rc == pcclSuccess);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    uint8_t in[kInputSize] = {};
    memcpy(in, data, size < kInputSize ? size : kInputSize);
    fuzz_hello(in);
    const wire::FrameHeader got = fuzz_frame(in + wire::kHelloSize);
    fuzz_expected(got, in + kWantOffset, le(in + kMaskOffset, 2));
    return 0;
}
