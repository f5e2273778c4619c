#include "anysource.hpp"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <string>
#include <vector>

#include "error.hpp"
#include "link.hpp"
#include "socket.hpp"
#include "wire.hpp"

namespace pccl {
namespace {

enum class Head {
    kWait,  // no whole header there yet
    kTake,  // the peer's next message, with this tag (or something the receive reports)
    kSkip,  // the peer's next message, with another tag: not this peer
    kDone,  // a later op's frame: nothing of the peer's next message comes on this stream
};

// What the next frame on `link` means for a receive of `tag` from any source, when the
// peer's next message is number `next` (p2p_received). A sealed header is opened without
// taking its record number (the receive opens it again).
Head classify(FrameLink &link, short revents, uint32_t tag, uint64_t next) {
    wire::FrameHeader h;
    FrameLink::Peeked state;
    // A failed read, or a header that fails its check or is malformed, is the receive's to
    // report, like a closed connection.
    if (link.peek_header(&h, &state)) return Head::kTake;
    switch (state) {
        case FrameLink::Peeked::kNone: return Head::kWait;
        case FrameLink::Peeked::kClosed: return Head::kTake;
        case FrameLink::Peeked::kPartial:  // only at a closed or failed connection (SO_RCVLOWAT)
            return (revents & (POLLHUP | POLLERR | POLLRDHUP)) ? Head::kTake : Head::kWait;
        case FrameLink::Peeked::kHeader: break;
    }
    if (h.type == wire::kFrameAbort) return Head::kTake;
    if (h.coll != wire::kCollP2P || h.seq > next) return Head::kDone;
    if (h.seq < next) return Head::kTake;  // stale: the receive reports the mismatch
    return h.tag == tag ? Head::kTake : Head::kSkip;
}

}  // namespace

pcclResult_t wait_any_p2p(pcclComm *comm, uint32_t tag, int64_t deadline_ms, int *peer) {
    // A peer's next message may come on any of its streams (the sender picks its stripe).
    const size_t stride = size_t(comm->streams), S = size_t(comm->streams);
    std::vector<std::unique_ptr<FrameLink>> io(comm->links.size());
    for (int p = 0; p < comm->world_size; ++p) {
        if (p == comm->rank) continue;
        for (size_t k = 0; k < S; ++k) {
            const size_t li = size_t(p) * stride + k;
            io[li] = open_link(comm, comm->links[li]);
            // poll() wakes only once a header can be peeked whole.
            set_rcvlowat(comm->links[li], int(io[li]->header_size()));
        }
    }
    std::vector<char> skipped(size_t(comm->world_size), 0);
    std::vector<char> done(comm->links.size(), 0);  // per stream: kDone seen
    std::vector<pollfd> pfds;
    std::vector<size_t> who;
    for (;;) {
        if (comm->aborted.load()) return abort_error(comm);
        pfds.assign(1, {comm->abort_fd, POLLIN, 0});
        who.assign(1, 0);
        for (int p = 0; p < comm->world_size; ++p) {
            if (p == comm->rank || skipped[size_t(p)]) continue;
            for (size_t k = 0; k < S; ++k) {
                const size_t li = size_t(p) * stride + k;
                if (done[li]) continue;
                if (comm->links[li].fd < 0) {  // a link that never came up: the receive reports it
                    *peer = p;
                    return pcclSuccess;
                }
                pfds.push_back({comm->links[li].fd, short(POLLIN | POLLRDHUP), 0});
                who.push_back(li);
            }
        }
        int64_t left = deadline_ms - net::now_ms();
        if (left <= 0) {
            pcclResult_t rc = fail(pcclTimeout, "Timed out waiting " + std::to_string(comm->op_timeout_ms) +
                                                    "ms for recv from any source (tag " +
                                                    std::to_string(tag) + ")");
            return fail_comm(comm, rc, nullptr);
        }
        int n = poll(pfds.data(), pfds.size(), int(left > 1000000 ? 1000000 : left));
        if (n < 0) {
            if (errno == EINTR) continue;
            pcclResult_t rc = fail(pcclSystemError, syscall_error("poll", errno, "recv from any source"));
            return fail_comm(comm, rc, nullptr);
        }
        if (pfds[0].revents) continue;  // the abort eventfd: checked at the top
        for (size_t i = 1; i < pfds.size(); ++i) {
            if (!pfds[i].revents) continue;
            const size_t li = who[i];
            const int p = int(li / stride);
            if (skipped[size_t(p)]) continue;
            switch (classify(*io[li], pfds[i].revents, tag, comm->p2p_received[size_t(p)])) {
                case Head::kTake: *peer = p; return pcclSuccess;
                case Head::kSkip: skipped[size_t(p)] = 1; break;
                case Head::kDone: {
                    // Every stream of the peer shows a later op: its next message is not one.
                    done[li] = 1;
                    bool all = true;
                    for (size_t k = 0; k < S; ++k) all = all && done[size_t(p) * stride + k];
                    if (all) skipped[size_t(p)] = 1;
                    break;
                }
                case Head::kWait: break;
            }
        }
    }
}

}  // namespace pccl
