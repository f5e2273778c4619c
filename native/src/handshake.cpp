#include "handshake.hpp"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "error.hpp"
#include "socket.hpp"
#include "wire.hpp"

namespace pccl {

namespace {

struct Pending {
    int fd;
    uint8_t buf[wire::kHelloSize];
    size_t got = 0;
    std::string from;
};

// This rank's hello for stream `stream` of one of its `nlanes` lanes, encoded.
void own_hello(const pcclComm *comm, int lane, int nlanes, int stream,
               uint8_t out[wire::kHelloSize]) {
    wire::Hello mine;
    mine.comm_id = comm->comm_id;
    mine.rank = uint32_t(comm->rank);
    mine.world_size = uint32_t(comm->world_size);
    mine.lane = uint16_t(lane);
    mine.lanes = uint16_t(nlanes);
    mine.stream = uint16_t(stream);
    mine.streams = uint16_t(comm->streams);
    wire::encode_hello(mine, out);
}

// "rank 2 (10.0.0.2:4000) lane 1 stream 3", naming lane and stream only when there are several.
std::string link_name(int peer, const std::string &where, int lane, int nlanes, int stream,
                      int nstreams) {
    std::string name = "rank " + std::to_string(peer) + " (" + where + ")";
    if (nlanes > 1) name += " lane " + std::to_string(lane);
    if (nstreams > 1) name += " stream " + std::to_string(stream);
    return name;
}

// Validates a peer's hello against this communicator; names the problem in *why.
bool acceptable(const pcclComm *comm, int nlanes, const wire::Hello &h, std::string *why) {
    if (h.comm_id != comm->comm_id) {
        *why = "hello for another communicator (stale or foreign group)";
        return false;
    }
    if (int(h.world_size) != comm->world_size) {
        *why = "hello with world size " + std::to_string(h.world_size) + ", this group has " +
               std::to_string(comm->world_size);
        return false;
    }
    if (int(h.lanes) != nlanes) {
        *why = "hello from a peer with " + std::to_string(h.lanes) + " lane(s), this rank has " +
               std::to_string(nlanes) + " (the peers connect with different lane counts)";
        return false;
    }
    if (int(h.streams) != comm->streams) {
        *why = "hello from a peer with " + std::to_string(h.streams) + " stream(s) per lane, " +
               "this rank has " + std::to_string(comm->streams) +
               " (the peers connect with different stream counts)";
        return false;
    }
    return true;
}

// Accepts the links from every higher rank on every lane. Connections that send
// garbage, a wrong version or a truncated hello are closed and reported on
// stderr; the loop keeps serving the others, so one bad client cannot block the
// group.
pcclResult_t accept_higher(pcclComm *const *lanes, int nlanes, int64_t deadline) {
    pcclComm *comm = lanes[0];
    const int S = comm->streams;
    int expected = (comm->world_size - 1 - comm->rank) * nlanes * S;
    std::vector<Pending> pending;
    while (expected > 0) {
        std::vector<pollfd> fds;
        fds.push_back({comm->listen_fd, POLLIN, 0});
        fds.push_back({comm->abort_fd, POLLIN, 0});
        for (auto &p : pending) fds.push_back({p.fd, POLLIN, 0});
        int64_t left = deadline - net::now_ms();
        if (left <= 0) {
            for (auto &p : pending) close(p.fd);
            return failf(pcclTimeout, "timed out waiting for %d connection(s) from higher ranks",
                         expected);
        }
        int n = poll(fds.data(), fds.size(), int(left));
        if (n < 0 && errno != EINTR) {
            int err = errno;
            for (auto &p : pending) close(p.fd);
            return fail(pcclSystemError, syscall_error("poll()", err, "while accepting peers"));
        }
        if (n <= 0) continue;
        if (fds[1].revents & POLLIN) {
            for (auto &p : pending) close(p.fd);
            return fail(pcclAborted, "aborted while accepting peers");
        }
        // Progress the pending handshakes first (their indexes shift when removed).
        for (size_t i = pending.size(); i-- > 0;) {
            if (!fds[2 + i].revents) continue;
            Pending &p = pending[i];
            ssize_t r = recv(p.fd, p.buf + p.got, sizeof(p.buf) - p.got, MSG_DONTWAIT);
            std::string why;
            if (r > 0) p.got += size_t(r);
            if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) {
                why = "connection closed before a full hello";
            } else if (p.got == sizeof(p.buf)) {
                wire::Hello h;
                if (wire::decode_hello(p.buf, &h, &why) == pcclSuccess &&
                    acceptable(comm, nlanes, h, &why)) {
                    int peer = int(h.rank), lane = int(h.lane), stream = int(h.stream);
                    pcclComm::Link &link = lanes[lane]->links[size_t(peer * S + stream)];
                    if (peer <= comm->rank || link.fd >= 0) {
                        why = "unexpected or duplicate hello from rank " + std::to_string(peer) +
                              " lane " + std::to_string(lane) + " stream " +
                              std::to_string(stream);
                    } else {
                        uint8_t out[wire::kHelloSize];
                        own_hello(comm, lane, nlanes, stream, out);
                        std::string name = link_name(peer, p.from, lane, nlanes, stream, S);
                        pcclResult_t rc = net::write_exact(p.fd, out, sizeof(out), deadline,
                                                           comm->abort_fd, name);
                        if (rc != pcclSuccess) {
                            for (auto &q : pending) close(q.fd);
                            return rc;
                        }
                        link.fd = p.fd;
                        link.name = name;
                        ++comm->links_up[size_t(peer)];
                        pending.erase(pending.begin() + long(i));
                        --expected;
                        continue;
                    }
                }
            } else {
                continue;  // hello still incomplete
            }
            fprintf(stderr, "pccl: rank %d rejected a connection from %s: %s\n", comm->rank,
                    p.from.c_str(), why.c_str());
            close(p.fd);
            pending.erase(pending.begin() + long(i));
        }
        if (fds[0].revents & POLLIN) {
            int fd = accept(comm->listen_fd, nullptr, nullptr);
            if (fd >= 0) {
                Pending p;
                p.fd = fd;
                p.from = net::peer_name(fd);
                if (net::configure(fd, p.from) != pcclSuccess) {
                    close(fd);
                } else {
                    pending.push_back(p);
                }
            }
        }
    }
    // Every rank is in: whatever is still half-way through a hello is not one of them.
    for (auto &p : pending) {
        fprintf(stderr, "pccl: rank %d closed an unfinished connection from %s\n", comm->rank,
                p.from.c_str());
        close(p.fd);
    }
    return pcclSuccess;
}

}  // namespace

pcclResult_t connect_all(pcclComm *const *lanes, int nlanes, const char *const *addrs,
                         int timeout_ms) {
    pcclComm *comm = lanes[0];
    const int S = comm->streams;
    int64_t deadline = net::now_ms() + timeout_ms;
    for (int lane = 0; lane < nlanes; ++lane)
        lanes[lane]->links.resize(size_t(comm->world_size) * size_t(S));
    comm->links_up.assign(size_t(comm->world_size), 0);
    comm->links_per_peer = nlanes * S;

    // Lower ranks: start connecting every stream of every lane at once (one round
    // trip for all of them on a long link), then send each its hello as it comes
    // up; the replies are read after we have accepted the higher ranks, so no
    // rank waits on another in a cycle. A failure leaves the fds in their links
    // (the caller destroys the lanes).
    for (int peer = 0; peer < comm->rank; ++peer) {
        if (!addrs[peer]) return failf(pcclInvalidArgument, "no address for rank %d", peer);
        net::Addr addr;
        pcclResult_t rc = net::parse_addr(addrs[peer], &addr);
        if (rc != pcclSuccess) return rc;
        for (int lane = 0; lane < nlanes; ++lane) {
            for (int stream = 0; stream < S; ++stream) {
                pcclComm::Link &link = lanes[lane]->links[size_t(peer * S + stream)];
                link.name = link_name(peer, addrs[peer], lane, nlanes, stream, S);
                rc = net::connect_start(addr, link.name, &link.fd);
                if (rc != pcclSuccess) return rc;
            }
        }
    }
    for (int peer = 0; peer < comm->rank; ++peer) {
        for (int lane = 0; lane < nlanes; ++lane) {
            for (int stream = 0; stream < S; ++stream) {
                pcclComm::Link &link = lanes[lane]->links[size_t(peer * S + stream)];
                pcclResult_t rc = net::connect_finish(link.fd, deadline, comm->abort_fd, link.name);
                if (rc != pcclSuccess) return rc;
                uint8_t out[wire::kHelloSize];
                own_hello(comm, lane, nlanes, stream, out);
                rc = net::write_exact(link.fd, out, sizeof(out), deadline, comm->abort_fd,
                                      link.name);
                if (rc != pcclSuccess) return rc;
                ++comm->links_up[size_t(peer)];
            }
        }
    }
    pcclResult_t rc = accept_higher(lanes, nlanes, deadline);
    if (rc != pcclSuccess) return rc;
    for (int peer = 0; peer < comm->rank; ++peer) {
        for (int lane = 0; lane < nlanes; ++lane) {
            for (int stream = 0; stream < S; ++stream) {
                auto &link = lanes[lane]->links[size_t(peer * S + stream)];
                uint8_t in[wire::kHelloSize];
                rc = net::read_exact(link.fd, in, sizeof(in), deadline, comm->abort_fd, link.name);
                if (rc != pcclSuccess) return rc;
                wire::Hello h;
                std::string why;
                if (wire::decode_hello(in, &h, &why) != pcclSuccess ||
                    !acceptable(comm, nlanes, h, &why))
                    return fail(pcclProtocolError, link.name + ": " + why);
                if (int(h.rank) != peer || int(h.lane) != lane || int(h.stream) != stream)
                    return failf(pcclProtocolError, "%s answered as rank %u lane %u stream %u",
                                 link.name.c_str(), h.rank, unsigned(h.lane), unsigned(h.stream));
            }
        }
    }
    for (int lane = 0; lane < nlanes; ++lane) {
        for (auto &link : lanes[lane]->links)
            if (link.fd >= 0) net::set_link_timeout(link.fd, comm->link_timeout_ms);
        lanes[lane]->connected = true;
    }
    return pcclSuccess;
}

}  // namespace pccl
