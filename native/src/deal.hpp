// Dealing one op's frames over a peer's streams (docs/protocol.md, "Links"), the shape of
// GridFTP's MODE E: any stream carries any frame, and every frame names its place. No I/O:
// the engine asks which frame a stream with room takes next (Dealer) and which receive item
// a header that arrived on any stream is (Arrivals); both are unit-tested alone
// (native/tests/test_native.cpp).
//
// What makes this safe without a per-stream order agreed by both ends:
// - a frame's header names its op (coll, seq) and its `step`, its index among the op's
//   frames from that peer to this rank, which the schedule numbers (schedule.cpp);
// - every stream is a FIFO and a sender hands every frame of an op to its sockets before
//   it starts the next op, so on every stream all of op N's frames come before op N+1's:
//   once a stream's next header belongs to a later op, that stream holds nothing more of
//   this one;
// - within one engine pass a peer's frames are dealt earliest ready first, so the messages
//   of a point-to-point batch (no dependencies) reach every stream in message order too.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pccl.h"
#include "schedule.hpp"
#include "wire.hpp"

namespace pccl {

// What "room" on a striped stream means: TCP_NOTSENT_LOWAT, set on every stream when a
// peer has several (handshake.cpp). A send then stops, and poll() reports the stream not
// writable, once it holds this much data the kernel has not sent yet; what is in flight
// (sent, not yet acknowledged: the congestion window) is not limited. 256 KiB keeps the
// kernel fed for ~8 ms per stream at 250 Mbit/s (poll() reports room again at half of it,
// so the engine has ~4 ms to refill it) and lets a stream that stalls hold little of an
// op: what it has in flight, at most this much unsent, and the one frame it is sending
// (at most chunk_bytes, 1 MiB by default). Without it a stream's socket takes up to its
// send buffer (4 MiB by default) before it refuses, several frames the others then wait
// for.
constexpr int kStreamRoomBytes = 256 << 10;

// The sending side: per peer, the send items whose dependency has landed and that no stream
// has taken yet, earliest (lowest index: step order, message order) first.
class Dealer {
public:
    Dealer(const Schedule &s, int world_size);

    bool ready(int peer) const { return !heap_[size_t(peer)].empty(); }
    // The earliest ready item for `peer`, now taken; -1 if none.
    int32_t take(int peer);
    // A taken item none of whose bytes left: any stream may take it again.
    void give_back(int32_t item);
    // Receive item `recv` has landed (and been reduced): the sends that waited for it are ready.
    void landed(int32_t recv);

private:
    void push(int32_t item);

    const Schedule &s_;
    std::vector<std::vector<int32_t>> heap_;  // per peer: a min-heap of send item indexes
    std::vector<int32_t> first_;              // per receive: its dependents in waiting_,
    std::vector<int32_t> waiting_;            // first_[r] .. first_[r + 1]
};

// The receiving side: which receive item of this op a frame header from a peer is. Every
// field that came off the network is checked before anything is taken from it.
class Arrivals {
public:
    // next_coll_seq: the sequence number this rank's next collective gets (pcclComm's
    // coll_seq): a collective frame below it, met during a point-to-point op, is stale.
    Arrivals(const Schedule &s, int world_size, uint64_t next_coll_seq);

    enum Verdict {
        kPlace,   // *item: the receive item it is, now claimed (its payload follows)
        kLater,   // a later op's frame: leave it queued; its stream holds nothing more of this op
        kRefuse,  // *rc (pcclMismatch or pcclProtocolError) and *why say what is wrong
    };
    // h: a decoded DATA header (wire::decode_frame) that arrived from `peer`.
    Verdict place(int peer, const wire::FrameHeader &h, int32_t *item, pcclResult_t *rc,
                  std::string *why);

    // Frames this op expects from `peer` whose header no stream delivered yet.
    size_t unclaimed(int peer) const { return unclaimed_[size_t(peer)]; }
    // The first of them (for error messages), or -1.
    int32_t first_unclaimed(int peer) const;

private:
    // One message of the op from one peer: a collective's frames from it, or one
    // point-to-point message (a batch may hold several from the same peer).
    struct Message {
        uint8_t coll;
        uint64_t seq;
        uint32_t first_step;
        std::vector<int32_t> items;  // by step - first_step; -1: no such step
    };

    const Schedule &s_;
    uint64_t next_coll_seq_;
    std::vector<std::vector<Message>> from_;  // per peer
    std::vector<char> claimed_;               // per receive item
    std::vector<size_t> unclaimed_;           // per peer
};

}  // namespace pccl
