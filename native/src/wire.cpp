#include "wire.hpp"

#include <cstdio>

namespace pccl {
namespace wire {

namespace {

void put16(uint8_t *p, uint16_t v) {
    p[0] = uint8_t(v);
    p[1] = uint8_t(v >> 8);
}
void put32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; ++i) p[i] = uint8_t(v >> (8 * i));
}
void put64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; ++i) p[i] = uint8_t(v >> (8 * i));
}
uint16_t get16(const uint8_t *p) { return uint16_t(p[0] | (p[1] << 8)); }
uint32_t get32(const uint8_t *p) {
    uint32_t v = 0;
    for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
    return v;
}
uint64_t get64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
    return v;
}

std::string fmt(const char *f, unsigned long long a, unsigned long long b) {
    char buf[256];
    snprintf(buf, sizeof(buf), f, a, b);
    return buf;
}

const char *op_name(uint8_t op) {
    switch (op) {
        case pcclSum: return "sum";
        case pcclAvg: return "avg";
        case pcclMin: return "min";
        case pcclMax: return "max";
        case pcclProd: return "product";
        case kNoOp: return "none";
        default: return "?";
    }
}

const char *dtype_name(uint8_t t) {
    static const char *names[] = {"float32", "float64", "float16", "bfloat16",
                                  "int8",    "uint8",   "int32",   "int64"};
    return t < pcclNumTypes ? names[t] : "?";
}

}  // namespace

const char *coll_name(uint8_t coll) {
    switch (coll) {
        case kCollAllReduce: return "all_reduce";
        case kCollBroadcast: return "broadcast";
        case kCollAllGather: return "all_gather";
        case kCollReduceScatter: return "reduce_scatter";
        case kCollAllToAll: return "all_to_all";
        case kCollP2P: return "send/recv";
        case kCollBarrier: return "barrier";
        case kCollAllReduceInt8: return "all_reduce_int8";
        case kCollAllReduceInt4: return "all_reduce_int4";
        default: return "unknown";
    }
}

pcclResult_t abort_code(const FrameHeader &h) {
    return h.count == uint64_t(pcclPeerLost) ? pcclPeerLost : pcclRemoteError;
}

void encode_hello(const Hello &h, uint8_t out[kHelloSize]) {
    put32(out + 0, h.magic);
    put16(out + 4, h.version);
    put16(out + 6, h.kind);
    put64(out + 8, h.comm_id);
    put32(out + 16, h.rank);
    put32(out + 20, h.world_size);
    put16(out + 24, h.lane);
    put16(out + 26, h.stream);
    put16(out + 28, h.lanes);
    put16(out + 30, h.streams);
}

pcclResult_t decode_hello(const uint8_t in[kHelloSize], Hello *out, std::string *why) {
    Hello h;
    h.magic = get32(in + 0);
    h.version = get16(in + 4);
    h.kind = get16(in + 6);
    h.comm_id = get64(in + 8);
    h.rank = get32(in + 16);
    h.world_size = get32(in + 20);
    h.lane = get16(in + 24);
    h.stream = get16(in + 26);
    h.lanes = get16(in + 28);
    h.streams = get16(in + 30);
    if (h.lanes == 0) h.lanes = 1;      // builds before lanes sent 0 here
    if (h.streams == 0) h.streams = 1;  // builds before streams sent 0 here
    if (h.magic != kHelloMagic) {
        *why = fmt("bad hello magic 0x%08llx (expected 0x%08llx)", h.magic, kHelloMagic);
        return pcclProtocolError;
    }
    if (h.version != kProtocolVersion) {
        *why = fmt("protocol version %llu, this build speaks %llu", h.version, kProtocolVersion);
        return pcclProtocolError;
    }
    if (h.kind != kConnData && h.kind != kConnDataAuth && h.kind != kConnDataSealed) {
        *why = fmt("unknown connection kind %llu", h.kind, 0);
        return pcclProtocolError;
    }
    if (h.world_size == 0 || h.rank >= h.world_size) {
        *why = fmt("hello names rank %llu of world size %llu", h.rank, h.world_size);
        return pcclProtocolError;
    }
    if (h.lane >= h.lanes) {
        *why = fmt("hello names lane %llu of %llu lanes", h.lane, h.lanes);
        return pcclProtocolError;
    }
    if (h.stream >= h.streams) {
        *why = fmt("hello names stream %llu of %llu streams", h.stream, h.streams);
        return pcclProtocolError;
    }
    *out = h;
    return pcclSuccess;
}

void encode_frame(const FrameHeader &h, uint8_t out[kFrameHeaderSize]) {
    put16(out + 0, kFrameMagic);
    out[2] = h.type;
    out[3] = h.coll;
    out[4] = h.dtype;
    out[5] = h.op;
    put16(out + 6, h.root);
    put32(out + 8, h.tag);
    put32(out + 12, h.step);
    put64(out + 16, h.seq);
    put64(out + 24, h.count);
    put64(out + 32, h.length);
}

pcclResult_t decode_frame(const uint8_t in[kFrameHeaderSize], FrameHeader *out, std::string *why) {
    uint16_t magic = get16(in);
    if (magic != kFrameMagic) {
        *why = fmt("bad frame magic 0x%04llx (expected 0x%04llx): stream out of sync", magic,
                   kFrameMagic);
        return pcclProtocolError;
    }
    FrameHeader h;
    h.type = in[2];
    h.coll = in[3];
    h.dtype = in[4];
    h.op = in[5];
    h.root = get16(in + 6);
    h.tag = get32(in + 8);
    h.step = get32(in + 12);
    h.seq = get64(in + 16);
    h.count = get64(in + 24);
    h.length = get64(in + 32);
    if (h.type == kFrameAbort) {
        if (h.length > kMaxAbortPayload) {
            *why = fmt("abort frame of %llu bytes exceeds the %llu-byte bound", h.length,
                       kMaxAbortPayload);
            return pcclProtocolError;
        }
        *out = h;
        return pcclSuccess;
    }
    if (h.type != kFrameData) {
        *why = fmt("unknown frame type %llu", h.type, 0);
        return pcclProtocolError;
    }
    if (h.coll < kCollAllReduce || h.coll > kCollLast) {
        *why = fmt("unknown collective %llu", h.coll, 0);
        return pcclProtocolError;
    }
    if (h.dtype >= pcclNumTypes) {
        *why = fmt("unknown dtype %llu", h.dtype, 0);
        return pcclProtocolError;
    }
    if (h.op >= pcclNumOps && h.op != kNoOp) {
        *why = fmt("unknown reduce op %llu", h.op, 0);
        return pcclProtocolError;
    }
    if (h.length > kMaxFramePayload) {
        *why = fmt("frame payload of %llu bytes exceeds the %llu-byte bound", h.length,
                   kMaxFramePayload);
        return pcclProtocolError;
    }
    *out = h;
    return pcclSuccess;
}

pcclResult_t check_expected(const FrameHeader &got, const FrameHeader &want, std::string *why) {
    char buf[512];
    if (got.coll != want.coll) {
        snprintf(buf, sizeof(buf), "peer called %s while this rank called %s",
                 coll_name(got.coll), coll_name(want.coll));
    } else if (got.seq != want.seq) {
        snprintf(buf, sizeof(buf), "peer is at %s #%llu while this rank is at #%llu",
                 coll_name(got.coll), (unsigned long long)got.seq,
                 (unsigned long long)want.seq);
    } else if (got.tag != want.tag) {
        snprintf(buf, sizeof(buf), "%s tag %u on the peer, %u on this rank", coll_name(got.coll),
                 got.tag, want.tag);
    } else if (got.dtype != want.dtype) {
        snprintf(buf, sizeof(buf), "%s of %s on the peer, %s on this rank", coll_name(got.coll),
                 dtype_name(got.dtype), dtype_name(want.dtype));
    } else if (got.op != want.op) {
        snprintf(buf, sizeof(buf), "%s with op %s on the peer, %s on this rank",
                 coll_name(got.coll), op_name(got.op), op_name(want.op));
    } else if (got.root != want.root) {
        bool quantized = got.coll == kCollAllReduceInt8 || got.coll == kCollAllReduceInt4;
        snprintf(buf, sizeof(buf), quantized ? "%s with block %u on the peer, %u on this rank"
                                             : "%s from root %u on the peer, root %u on this rank",
                 coll_name(got.coll), got.root, want.root);
    } else if (got.count != want.count) {
        snprintf(buf, sizeof(buf), "%s of %llu elements on the peer, %llu on this rank",
                 coll_name(got.coll), (unsigned long long)got.count,
                 (unsigned long long)want.count);
    } else if (got.step != want.step || got.length != want.length) {
        snprintf(buf, sizeof(buf),
                 "%s frame %u of %llu bytes from the peer, expected frame %u of %llu bytes "
                 "(different chunk_bytes settings?)",
                 coll_name(got.coll), got.step, (unsigned long long)got.length, want.step,
                 (unsigned long long)want.length);
    } else {
        return pcclSuccess;
    }
    *why = buf;
    return pcclMismatch;
}

}  // namespace wire
}  // namespace pccl
