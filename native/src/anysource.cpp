#include "anysource.hpp"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <string>
#include <vector>

#include "error.hpp"
#include "seal.hpp"
#include "socket.hpp"
#include "wire.hpp"

namespace pccl {
namespace {

// Raises SO_RCVLOWAT to a whole frame header on the watched sockets and puts it
// back: poll() then wakes only when a header can be peeked whole, so a header
// split across TCP segments is not polled for in a loop.
class HeaderLowat {
public:
    HeaderLowat(std::vector<int> fds, size_t header_size) : fds_(std::move(fds)) {
        int header = int(header_size);
        for (int fd : fds_) setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &header, sizeof(header));
    }
    ~HeaderLowat() {
        int one = 1;
        for (int fd : fds_) setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &one, sizeof(one));
    }
    HeaderLowat(const HeaderLowat &) = delete;
    HeaderLowat &operator=(const HeaderLowat &) = delete;

private:
    std::vector<int> fds_;
};

enum class Head { kWait, kTake, kSkip };

// What the next frame on `link` means for a receive of `tag` from any source. A sealed
// header is opened without taking its record number (the receive opens it again).
Head classify(const pcclComm::Link &link, short revents, uint32_t tag) {
    uint8_t raw[seal::kHeaderSize], plain[wire::kFrameHeaderSize];
    const size_t size = link.seal ? seal::kHeaderSize : wire::kFrameHeaderSize;
    ssize_t n = recv(link.fd, raw, size, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0) return Head::kTake;  // closed: the receive reports the lost peer
    if (n < 0) return (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? Head::kWait : Head::kTake;
    if (size_t(n) < size)  // only at a closed or failed connection (SO_RCVLOWAT)
        return (revents & (POLLHUP | POLLERR | POLLRDHUP)) ? Head::kTake : Head::kWait;
    // A header that fails its check is the receive's to report, like a malformed one.
    if (link.seal && !link.seal->in.peek(raw, wire::kFrameHeaderSize, plain)) return Head::kTake;
    wire::FrameHeader h;
    std::string why;
    if (wire::decode_frame(link.seal ? plain : raw, &h, &why) != pcclSuccess)
        return Head::kTake;  // reported there
    if (h.type == wire::kFrameAbort) return Head::kTake;
    return (h.coll == wire::kCollP2P && h.tag == tag) ? Head::kTake : Head::kSkip;
}

}  // namespace

pcclResult_t wait_any_p2p(pcclComm *comm, uint32_t tag, int64_t deadline_ms, int *peer) {
    const size_t S = size_t(comm->streams), used = size_t(comm->stripe);
    // The stream each peer's next frame arrives on (engine.cpp's striping rule).
    std::vector<int> fds(size_t(comm->world_size), -1);
    std::vector<size_t> link_of(size_t(comm->world_size), 0);
    std::vector<int> watched;
    size_t header = wire::kFrameHeaderSize;
    for (int p = 0; p < comm->world_size; ++p) {
        if (p == comm->rank) continue;
        size_t li = size_t(p) * S + comm->items_received[size_t(p)] % used;
        link_of[size_t(p)] = li;
        fds[size_t(p)] = comm->links[li].fd;
        if (fds[size_t(p)] >= 0) watched.push_back(fds[size_t(p)]);
        if (comm->links[li].seal) header = seal::kHeaderSize;
    }
    HeaderLowat lowat(watched, header);
    std::vector<char> skipped(size_t(comm->world_size), 0);
    std::vector<pollfd> pfds;
    std::vector<int> who;
    for (;;) {
        if (comm->aborted.load()) return abort_error(comm);
        pfds.assign(1, {comm->abort_fd, POLLIN, 0});
        who.assign(1, -1);
        for (int p = 0; p < comm->world_size; ++p) {
            if (p == comm->rank || skipped[size_t(p)]) continue;
            if (fds[size_t(p)] < 0) {  // a link that never came up: the receive reports it
                *peer = p;
                return pcclSuccess;
            }
            pfds.push_back({fds[size_t(p)], short(POLLIN | POLLRDHUP), 0});
            who.push_back(p);
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
            switch (classify(comm->links[link_of[size_t(who[i])]], pfds[i].revents, tag)) {
                case Head::kTake: *peer = who[i]; return pcclSuccess;
                case Head::kSkip: skipped[size_t(who[i])] = 1; break;
                case Head::kWait: break;
            }
        }
    }
}

}  // namespace pccl
