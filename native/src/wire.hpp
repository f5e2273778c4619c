// The wire format: connection hello and frame headers. Pure encode/decode and
// validation over byte arrays; no socket is touched here, so every function can
// be unit-tested and fuzzed alone (its unit tests are in native/tests/test_native.cpp).
// All integers are little-endian on the wire. See docs/protocol.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "pccl.h"

namespace pccl {
namespace wire {

constexpr uint32_t kHelloMagic = 0x4C434350u;  // bytes 'P','C','C','L'
constexpr uint16_t kProtocolVersion = 1;
constexpr size_t kHelloSize = 32;

// kConnDataAuth: a data link whose hello is followed by the shared-secret exchange
// (auth.hpp); kConnDataSealed: the same exchange, after which every frame travels in
// records sealed with keys derived from it (seal.hpp). A rank takes only links of its own
// kind: kConnData without a secret, kConnDataSealed with one (kConnDataAuth with one and
// encryption turned off).
enum ConnKind : uint16_t { kConnData = 1, kConnDataAuth = 2, kConnDataSealed = 3 };

struct Hello {
    uint32_t magic = kHelloMagic;
    uint16_t version = kProtocolVersion;
    uint16_t kind = kConnData;
    uint64_t comm_id = 0;
    uint32_t rank = 0;
    uint32_t world_size = 0;
    // Bytes 24..31: four 16-bit fields. Builds before streams sent lane and lanes
    // as 32-bit fields; for the values they allowed (< 65536) the bytes are the same
    // with stream 0 and streams 0 (read as 1).
    uint16_t lane = 0;     // which of the sender's lanes (connections to the same peer) this is
    uint16_t stream = 0;   // which of the lane's streams to that peer this is
    uint16_t lanes = 1;    // how many lanes the sender opens to each peer (0 from old builds: 1)
    uint16_t streams = 1;  // how many streams per lane and peer (0 from old builds: 1)
};

void encode_hello(const Hello &h, uint8_t out[kHelloSize]);

// Decodes a hello and checks magic, version, kind, that rank < world_size,
// lane < lanes and stream < streams (a lanes or streams field of 0 is read as 1).
// Returns pcclSuccess or pcclProtocolError with the reason in *why.
pcclResult_t decode_hello(const uint8_t in[kHelloSize], Hello *out, std::string *why);

constexpr uint16_t kFrameMagic = 0xF7A3u;
constexpr size_t kFrameHeaderSize = 40;
// Upper bound on any frame payload: checked before a byte of payload is read.
constexpr uint64_t kMaxFramePayload = 1ull << 30;
// An ABORT frame carries a short text reason; longer is a protocol error.
constexpr uint64_t kMaxAbortPayload = 1024;

enum FrameType : uint8_t { kFrameData = 1, kFrameAbort = 2 };

enum Coll : uint8_t {
    kCollAllReduce = 1,
    kCollBroadcast = 2,
    kCollAllGather = 3,
    kCollReduceScatter = 4,
    kCollAllToAll = 5,
    kCollP2P = 6,
    kCollBarrier = 7,
    kCollAllReduceInt8 = 8,  // quantized all-reduces: `root` carries the block size
    kCollAllReduceInt4 = 9,
    kCollLast = 9
};

constexpr uint8_t kNoOp = 0xFF;  // `op` of collectives that do not reduce

struct FrameHeader {
    uint8_t type = kFrameData;
    uint8_t coll = 0;
    uint8_t dtype = 0;
    uint8_t op = kNoOp;
    uint16_t root = 0;    // broadcast: the root rank, so ranks naming different roots mismatch
    uint32_t tag = 0;
    // Index of this frame among the op's frames from the sender to the receiver, all
    // streams together: any stream may carry any frame, and the receiver places it by
    // this (deal.hpp). Builds before it counted per stream.
    uint32_t step = 0;
    uint64_t seq = 0;     // collective sequence number (p2p: per-peer message number)
    uint64_t count = 0;   // the op's element count as the sender sees it
    uint64_t length = 0;  // payload bytes that follow the header
};

void encode_frame(const FrameHeader &h, uint8_t out[kFrameHeaderSize]);

// Decodes a header and bounds-checks it (magic, type, coll, dtype, op, length
// against kMaxFramePayload / kMaxAbortPayload). pcclSuccess or pcclProtocolError.
pcclResult_t decode_frame(const uint8_t in[kFrameHeaderSize], FrameHeader *out, std::string *why);

// Compares a received data header with the one this rank expects. Returns
// pcclSuccess, or pcclMismatch with a sentence naming the first differing field.
pcclResult_t check_expected(const FrameHeader &got, const FrameHeader &want, std::string *why);

const char *coll_name(uint8_t coll);

// The result code a rank reports for an ABORT frame received from a peer: a lost
// peer is a fact about the whole group, so it stays pcclPeerLost on every rank;
// anything else (the origin's timeout, abort, mismatch...) is pcclRemoteError.
// The origin's code travels in the ABORT header's `count` field.
pcclResult_t abort_code(const FrameHeader &abort_header);

}  // namespace wire
}  // namespace pccl
