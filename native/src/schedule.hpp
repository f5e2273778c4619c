// Schedules: each collective compiled into ordered send and receive items per
// link. Pure functions over pointers and counts (no I/O), executed by engine.cpp.
//
// A send item may depend on one receive item: its bytes are ready only once that
// receive has landed (and been reduced). A receive item lands in `dst` and may
// then reduce it with `reduce_src` and finalise AVG. `step` numbers an op's frames
// from one rank to another (per peer and direction, from 0); any of the peer's
// streams may carry any of them, and the receiver places each by its step (deal.hpp).
#pragma once

#include <cstdint>
#include <vector>

#include "pccl.h"
#include "wire.hpp"

namespace pccl {

struct SendItem {
    int peer;
    const uint8_t *data;
    uint64_t len;      // bytes
    int32_t dep;       // index into Schedule::recvs, or -1
    wire::FrameHeader hdr;
};

struct RecvItem {
    int peer;
    uint8_t *dst;
    uint64_t len;      // bytes expected; any other length is a mismatch
    wire::FrameHeader expect;
    const uint8_t *reduce_src = nullptr;  // dst = dst op reduce_src after landing
    bool finalize_avg = false;            // then dst /= world size
};

struct Schedule {
    pcclDataType_t dtype = pcclFloat32;
    pcclRedOp_t op = pcclSum;
    int world_size = 1;
    std::vector<SendItem> sends;
    std::vector<RecvItem> recvs;
    // Collectives: a hang-up or ABORT from any peer matters. Point-to-point:
    // only the peers that appear in the items.
    bool watch_all = true;
    // The op's next schedule follows with frames numbered after these on each link (the
    // quantized all-reduce's first phase): a peer may already send them (deal.hpp).
    bool continued = false;
};

// What every frame of one op carries.
struct OpInfo {
    uint8_t coll;
    pcclDataType_t dtype;
    uint8_t op;        // pcclRedOp_t or wire::kNoOp
    uint16_t root;     // broadcast root, else 0
    uint32_t tag;
    uint64_t seq;
    uint64_t count;    // element count written into the headers
    int rank;
    int world_size;
    uint64_t chunk_bytes;
    // The ring order: position p of the ring holds rank ring[p] (world_size entries),
    // or nullptr for rank order. Ring collectives send to the next position and
    // receive from the previous one; what each rank ends with is the same either way.
    const int *ring = nullptr;
    int streams = 1;   // connections per peer the op's frames are dealt over (engine.cpp)
};

// The smallest chunk a slice is cut into to give every stream a share of it.
constexpr uint64_t kMinStripeBytes = 64 * 1024;

// Elements per chunk of a slice of n elements: chunk_bytes worth, or less when the op is
// striped over S > 1 streams, so that the slice has S chunks (each at least
// kMinStripeBytes) and every stream carries a share of it. Equal on every rank.
uint64_t chunk_elems_for(const OpInfo &info, uint64_t n);

// Frames a slice of n elements is cut into: at least one, so an empty slice still sends
// one empty frame and size mismatches are caught from its header.
uint64_t chunk_count(const OpInfo &info, uint64_t n);

// The rank at ring position p (taken modulo world size) and this rank's position.
int rank_at(const OpInfo &info, int p);
int ring_position(const OpInfo &info);

// Ring all-reduce of info.count elements: reduce-scatter then all-gather.
// Reads `input`, leaves the result in `work` (count elements).
Schedule ring_allreduce(const OpInfo &info, const uint8_t *input, uint8_t *work);

// Ring reduce-scatter: input holds world_size * info.count elements; rank r's
// result is left in work + r * count elements (work holds world_size * count).
Schedule ring_reduce_scatter(const OpInfo &info, const uint8_t *input, uint8_t *work);

// Ring all-gather of info.count elements per rank into work (world_size * count);
// the segment of this rank is not written (the caller copies its input).
Schedule ring_allgather(const OpInfo &info, const uint8_t *input, uint8_t *work);

// Chain broadcast from root along the ring; non-roots receive into work.
Schedule chain_broadcast(const OpInfo &info, int root, const uint8_t *buf, uint8_t *work);

// Pairwise all-to-all-v; counts and displacements in elements; received slices
// land in work at rdispls.
Schedule pairwise_alltoallv(const OpInfo &info, const uint8_t *sendbuf, const uint64_t *scounts,
                            const uint64_t *sdispls, uint8_t *work, const uint64_t *rcounts,
                            const uint64_t *rdispls);

// Point-to-point: one message of info.count elements to or from `peer`.
Schedule p2p_send(const OpInfo &info, int peer, const uint8_t *buf);
Schedule p2p_recv(const OpInfo &info, int peer, uint8_t *work);

// Appends the items of `part` to `into` (dependencies re-indexed), so several
// independent messages run in one engine pass.
void append(Schedule &into, const Schedule &part);

}  // namespace pccl
