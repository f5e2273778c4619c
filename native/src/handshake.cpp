#include "handshake.hpp"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "auth.hpp"
#include "deal.hpp"
#include "error.hpp"
#include "seal.hpp"
#include "socket.hpp"
#include "wire.hpp"

namespace pccl {

namespace {

struct Pending {
    int fd;
    uint8_t buf[wire::kHelloSize + auth::kNonceSize];  // hello, then the connector's nonce
    size_t got = 0;
    size_t need = wire::kHelloSize;  // grows by the nonce once an authenticating hello is in
    wire::Hello hello;
    std::string from;
    bool checked = false;  // hello_in passed
    bool early = false;    // for a later range of lanes (hello_in)
};

// What both ends of one authenticated link said, kept until the connector's proof is
// checked (auth.hpp). Indexed by link_index().
struct LinkAuth {
    uint8_t hello_c[wire::kHelloSize];
    uint8_t hello_a[wire::kHelloSize];
    uint8_t nonce_c[auth::kNonceSize];
    uint8_t nonce_a[auth::kNonceSize];
};

size_t link_index(const pcclComm *comm, int lane, int peer, int stream) {
    return (size_t(lane) * size_t(comm->world_size) + size_t(peer)) * size_t(comm->streams) +
           size_t(stream);
}

// Keys an authenticated link's records from its exchange (seal.hpp).
bool seal_link(const pcclComm *comm, bool connector, const LinkAuth &a, pcclComm::Link *link) {
    link->seal.reset(new seal::LinkSeal);
    return seal::derive(comm->secret, connector, a.hello_c, a.hello_a, a.nonce_c, a.nonce_a,
                        link->seal.get());
}

const char kSecretHint[] = "PCCL_SECRET or PCCL_SECRET_FILE, the same on every peer";

// The connection kind this rank opens and accepts (wire.hpp).
uint16_t own_kind(const pcclComm *comm) {
    if (comm->secret.empty()) return wire::kConnData;
    return comm->encrypt ? wire::kConnDataSealed : wire::kConnDataAuth;
}

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
    mine.kind = own_kind(comm);
    wire::encode_hello(mine, out);
}

// Why a link of kind `theirs` cannot join this rank's links, as the acceptor (`accepting`)
// or the connector of that link says it; empty when the kinds agree. Both ends of a
// refused link name the setting that differs.
std::string kind_mismatch(const pcclComm *comm, uint16_t theirs, bool accepting) {
    const uint16_t mine = own_kind(comm);
    if (mine == theirs) return "";
    if (mine == wire::kConnData)
        return accepting ? "it wants to authenticate, and this rank has no shared secret"
                         : std::string("the peer requires a shared secret and this rank has "
                                       "none (") + kSecretHint + ")";
    if (theirs == wire::kConnData)
        return accepting ? std::string("it did not authenticate, and this rank requires the "
                                       "shared secret (") + kSecretHint + ")"
                         : std::string("the peer has no shared secret and this rank has one (") +
                               kSecretHint + ")";
    const char *which = accepting ? "it" : "the peer";
    if (mine == wire::kConnDataSealed)
        return std::string(which) + " does not encrypt its links (PCCL_ENCRYPT=0 there), and "
               "this rank requires encrypted links (set PCCL_ENCRYPT alike on every peer)";
    return std::string(which) + " encrypts its links, and this rank does not (PCCL_ENCRYPT=0 "
           "here; set PCCL_ENCRYPT alike on every peer)";
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

// The lanes one connect brings up: lanes[first .. first+count) of a group of `nlanes`
// (pcclCommConnectLaneRange); lanes[0] owns the listener, the abort eventfd and the id.
struct Range {
    pcclComm *const *lanes;
    int first;
    int count;
    int nlanes;
    bool has(int lane) const { return lane >= first && lane < first + count; }
};

// How many connections of lanes after `r` higher ranks can open to this rank: what the
// early stash may hold, so a peer with the group's id cannot make it grow without bound.
size_t later_links(const pcclComm *comm, const Range &r) {
    return size_t(comm->world_size - 1 - comm->rank) * size_t(r.nlanes - r.first - r.count) *
           size_t(comm->streams);
}

// Checks a complete hello from a connecting peer: decodes it, checks it belongs to this
// group and names a free link of this range, or one of a later range (p->early: it waits
// in comm->early for that range's connect), and that it authenticates exactly when this
// rank does. On success sets p->hello and, for an authenticating hello, p->need to take
// the nonce. A peer on the wrong side of the secret gets this rank's hello before the
// close, so its own error can say which side lacks the secret rather than "connection
// closed".
bool hello_in(const pcclComm *comm, const Range &r, Pending *p, std::string *why) {
    wire::Hello &h = p->hello;
    if (wire::decode_hello(p->buf, &h, why) != pcclSuccess || !acceptable(comm, r.nlanes, h, why))
        return false;
    *why = kind_mismatch(comm, h.kind, true);
    if (!why->empty()) {
        uint8_t out[wire::kHelloSize];
        own_hello(comm, int(h.lane), r.nlanes, int(h.stream), out);
        (void)!send(p->fd, out, sizeof(out), MSG_DONTWAIT | MSG_NOSIGNAL);  // best effort
        return false;
    }
    int peer = int(h.rank), lane = int(h.lane), S = comm->streams;
    bool unexpected = peer <= comm->rank || lane < r.first;
    if (!unexpected && r.has(lane))
        unexpected = r.lanes[lane]->links[size_t(peer * S + int(h.stream))].fd >= 0;
    if (unexpected) {
        *why = "unexpected or duplicate hello from rank " + std::to_string(peer) + " lane " +
               std::to_string(h.lane) + " stream " + std::to_string(h.stream);
        return false;
    }
    p->early = !r.has(lane);
    if (!comm->secret.empty()) p->need = wire::kHelloSize + auth::kNonceSize;
    return true;
}

// Keeps a connection for a later range in comm->early (bounded by later_links); false
// when there is no room (the caller closes it).
bool stash(pcclComm *comm, const Range &r, const Pending &p) {
    if (comm->early.size() >= later_links(comm, r)) return false;
    pcclComm::Early e;
    e.fd = p.fd;
    e.bytes.assign(p.buf, p.buf + p.got);
    e.from = p.from;
    comm->early.push_back(std::move(e));
    return true;
}

// Accepts the links from every higher rank on every lane of the range. Connections that
// send garbage, a wrong version or a truncated hello are closed and reported on
// stderr; the loop keeps serving the others, so one bad client cannot block the
// group. Connections a peer opened for a later range wait in comm->early, and those
// stashed by an earlier range's connect are taken from there first. With a secret, each
// accepted link's exchange is kept in auths for check_connectors.
pcclResult_t accept_higher(const Range &r, int64_t deadline, std::vector<LinkAuth> &auths) {
    pcclComm *comm = r.lanes[0];
    pcclComm *acct = r.lanes[r.first];  // counts the range's links (pcclCommGetUnreachedRanks)
    const int S = comm->streams;
    const bool authed = !comm->secret.empty();
    const bool sealed = own_kind(comm) == wire::kConnDataSealed;
    int expected = (comm->world_size - 1 - comm->rank) * r.count * S;
    std::vector<Pending> pending;
    std::vector<pcclComm::Early> waiting;
    waiting.swap(comm->early);
    for (auto &e : waiting) {
        Pending p;
        p.fd = e.fd;
        p.from = e.from;
        p.got = std::min(e.bytes.size(), sizeof(p.buf));
        std::memcpy(p.buf, e.bytes.data(), p.got);
        pending.push_back(p);
    }
    auto close_all = [&pending]() {
        for (auto &p : pending) close(p.fd);
    };
    // Moves pending[i] on with what it has read: rejected, stashed, still short, or its
    // link up. Returns a failure of the whole connect; else pcclSuccess.
    auto progress = [&](size_t i) -> pcclResult_t {
        Pending &p = pending[i];
        std::string why;
        if (p.got < p.need) return pcclSuccess;  // hello (or nonce) still incomplete
        if (!p.checked) {
            if (!hello_in(comm, r, &p, &why)) {
                fprintf(stderr, "pccl: rank %d rejected a connection from %s: %s\n", comm->rank,
                        p.from.c_str(), why.c_str());
                close(p.fd);
                pending.erase(pending.begin() + long(i));
                return pcclSuccess;
            }
            p.checked = true;
            if (p.got < p.need) return pcclSuccess;  // an authenticating hello: its nonce follows
        }
        if (p.early) {
            if (!stash(comm, r, p)) {
                fprintf(stderr, "pccl: rank %d closed a surplus early connection from %s\n",
                        comm->rank, p.from.c_str());
                close(p.fd);
            }
            pending.erase(pending.begin() + long(i));
            return pcclSuccess;
        }
        const wire::Hello &h = p.hello;
        int peer = int(h.rank), lane = int(h.lane), stream = int(h.stream);
        pcclComm::Link &link = r.lanes[lane]->links[size_t(peer * S + stream)];
        uint8_t out[wire::kHelloSize + auth::kNonceSize + auth::kMacSize];
        size_t len = wire::kHelloSize;
        own_hello(comm, lane, r.nlanes, stream, out);
        if (authed) {
            LinkAuth &a = auths[link_index(comm, lane, peer, stream)];
            std::memcpy(a.hello_c, p.buf, wire::kHelloSize);
            std::memcpy(a.nonce_c, p.buf + wire::kHelloSize, auth::kNonceSize);
            std::memcpy(a.hello_a, out, wire::kHelloSize);
            if (!auth::new_nonce(a.nonce_a) ||
                !auth::proof(comm->secret, auth::kAccept, a.hello_c, a.hello_a, a.nonce_c,
                             a.nonce_a, out + wire::kHelloSize + auth::kNonceSize))
                return fail(pcclSystemError, "libcrypto failed to draw a nonce or an HMAC");
            std::memcpy(out + wire::kHelloSize, a.nonce_a, auth::kNonceSize);
            len = sizeof(out);
            if (sealed && !seal_link(comm, false, a, &link))
                return fail(pcclSystemError, "libcrypto failed to derive a link's keys");
        }
        std::string name = link_name(peer, p.from, lane, r.nlanes, stream, S);
        pcclResult_t rc = net::write_exact(p.fd, out, len, deadline, comm->abort_fd, name);
        if (rc != pcclSuccess) return rc;
        link.fd = p.fd;
        link.name = name;
        ++acct->links_up[size_t(peer)];
        pending.erase(pending.begin() + long(i));
        --expected;
        return pcclSuccess;
    };
    // Stashed connections may be complete already: no poll would report them.
    for (size_t i = pending.size(); i-- > 0;) {
        pcclResult_t rc = progress(i);
        if (rc != pcclSuccess) {
            close_all();
            return rc;
        }
    }
    while (expected > 0) {
        std::vector<pollfd> fds;
        fds.push_back({comm->listen_fd, POLLIN, 0});
        fds.push_back({comm->abort_fd, POLLIN, 0});
        for (auto &p : pending) fds.push_back({p.fd, POLLIN, 0});
        int64_t left = deadline - net::now_ms();
        if (left <= 0) {
            close_all();
            return failf(pcclTimeout, "Timed out waiting for %d connection(s) from higher ranks",
                         expected);
        }
        int n = poll(fds.data(), fds.size(), int(left));
        if (n < 0 && errno != EINTR) {
            int err = errno;
            close_all();
            return fail(pcclSystemError, syscall_error("poll()", err, "while accepting peers"));
        }
        if (n <= 0) continue;
        if (fds[1].revents & POLLIN) {
            close_all();
            return fail(pcclAborted, "aborted while accepting peers");
        }
        // Progress the pending handshakes first (their indexes shift when removed).
        for (size_t i = pending.size(); i-- > 0;) {
            if (!fds[2 + i].revents) continue;
            Pending &p = pending[i];
            ssize_t got = recv(p.fd, p.buf + p.got, p.need - p.got, MSG_DONTWAIT);
            if (got > 0) p.got += size_t(got);
            if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) {
                fprintf(stderr, "pccl: rank %d rejected a connection from %s: %s\n", comm->rank,
                        p.from.c_str(), "connection closed before a full hello");
                close(p.fd);
                pending.erase(pending.begin() + long(i));
                continue;
            }
            pcclResult_t rc = progress(i);
            if (rc != pcclSuccess) {
                close_all();
                return rc;
            }
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
    // Every rank is in for this range. A connection still half-way through its hello may
    // be a peer's next range (it got there first): kept for it while there is room.
    for (auto &p : pending) {
        if (r.first + r.count < r.nlanes && stash(comm, r, p)) continue;
        fprintf(stderr, "pccl: rank %d closed an unfinished connection from %s\n", comm->rank,
                p.from.c_str());
        close(p.fd);
    }
    return pcclSuccess;
}

// The connector's side of an authenticated link, after the acceptor's hello (`hello_a`,
// already read): reads the acceptor's nonce and proof, checks the proof, answers with
// this rank's. A wrong proof means the two secrets differ (or a stranger answered).
pcclResult_t prove_to_acceptor(const pcclComm *comm, pcclComm::Link &link,
                               const uint8_t hello_a[wire::kHelloSize], LinkAuth &a,
                               int64_t deadline) {
    uint8_t in[auth::kNonceSize + auth::kMacSize];
    pcclResult_t rc = net::read_exact(link.fd, in, sizeof(in), deadline, comm->abort_fd, link.name);
    if (rc != pcclSuccess) return rc;
    std::memcpy(a.hello_a, hello_a, wire::kHelloSize);
    std::memcpy(a.nonce_a, in, auth::kNonceSize);
    uint8_t want[auth::kMacSize], mine[auth::kMacSize];
    if (!auth::proof(comm->secret, auth::kAccept, a.hello_c, a.hello_a, a.nonce_c, a.nonce_a,
                     want) ||
        !auth::proof(comm->secret, auth::kConnect, a.hello_c, a.hello_a, a.nonce_c, a.nonce_a,
                     mine))
        return fail(pcclSystemError, "libcrypto failed to compute an HMAC");
    if (!auth::same_proof(want, in + auth::kNonceSize))
        return fail(pcclAuthError, link.name + ": its proof does not match this rank's "
                                               "shared secret (the secrets differ, or a "
                                               "stranger answered)");
    if (own_kind(comm) == wire::kConnDataSealed && !seal_link(comm, true, a, &link))
        return fail(pcclSystemError, "libcrypto failed to derive a link's keys");
    return net::write_exact(link.fd, mine, sizeof(mine), deadline, comm->abort_fd, link.name);
}

// The acceptor's last step: every link accepted from a higher rank must now prove the
// secret over this rank's nonce. Read after this rank's own proofs went out, so no two
// ranks wait on each other. A stranger that got this far (it knew the communicator id)
// fails the connect here, named on stderr and in the error.
pcclResult_t check_connectors(const Range &r, const std::vector<LinkAuth> &auths,
                              int64_t deadline) {
    pcclComm *comm = r.lanes[0];
    const int S = comm->streams;
    for (int peer = comm->rank + 1; peer < comm->world_size; ++peer) {
        for (int lane = r.first; lane < r.first + r.count; ++lane) {
            for (int stream = 0; stream < S; ++stream) {
                const pcclComm::Link &link = r.lanes[lane]->links[size_t(peer * S + stream)];
                const LinkAuth &a = auths[link_index(comm, lane, peer, stream)];
                uint8_t got[auth::kMacSize], want[auth::kMacSize];
                pcclResult_t rc = net::read_exact(link.fd, got, sizeof(got), deadline,
                                                  comm->abort_fd, link.name);
                if (rc == pcclPeerLost)
                    rc = fail(pcclAuthError, link.name + ": closed the connection instead of "
                                                         "proving the shared secret (it "
                                                         "rejected this rank's proof: the "
                                                         "secrets differ?)");
                if (rc == pcclSuccess &&
                    !auth::proof(comm->secret, auth::kConnect, a.hello_c, a.hello_a, a.nonce_c,
                                 a.nonce_a, want))
                    rc = fail(pcclSystemError, "libcrypto failed to compute an HMAC");
                if (rc == pcclSuccess && !auth::same_proof(got, want))
                    rc = fail(pcclAuthError,
                              link.name + ": its proof does not match this rank's shared "
                                          "secret (the secrets differ, or a stranger)");
                if (rc != pcclSuccess) {
                    if (rc == pcclAuthError)
                        fprintf(stderr, "pccl: rank %d refused %s\n", comm->rank,
                                thread_error());
                    return rc;
                }
            }
        }
    }
    return pcclSuccess;
}

}  // namespace

pcclResult_t connect_all(pcclComm *const *lanes, int first, int count, int nlanes,
                         const char *const *addrs, int timeout_ms) {
    const Range r{lanes, first, count, nlanes};
    pcclComm *comm = lanes[0];
    pcclComm *acct = lanes[first];  // counts the range's links (pcclCommGetUnreachedRanks)
    const int S = comm->streams;
    int64_t deadline = net::now_ms() + timeout_ms;
    const bool authed = !comm->secret.empty();
    std::vector<LinkAuth> auths(authed ? size_t(nlanes) * size_t(comm->world_size) * size_t(S)
                                       : 0);
    for (int lane = first; lane < first + count; ++lane)
        lanes[lane]->links.resize(size_t(comm->world_size) * size_t(S));
    acct->links_up.assign(size_t(comm->world_size), 0);
    acct->links_per_peer = count * S;

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
        for (int lane = first; lane < first + count; ++lane) {
            for (int stream = 0; stream < S; ++stream) {
                pcclComm::Link &link = lanes[lane]->links[size_t(peer * S + stream)];
                link.name = link_name(peer, addrs[peer], lane, nlanes, stream, S);
                rc = net::connect_start(addr, link.name, &link.fd);
                if (rc != pcclSuccess) return rc;
            }
        }
    }
    for (int peer = 0; peer < comm->rank; ++peer) {
        for (int lane = first; lane < first + count; ++lane) {
            for (int stream = 0; stream < S; ++stream) {
                pcclComm::Link &link = lanes[lane]->links[size_t(peer * S + stream)];
                pcclResult_t rc = net::connect_finish(link.fd, deadline, comm->abort_fd, link.name);
                if (rc != pcclSuccess) return rc;
                uint8_t out[wire::kHelloSize + auth::kNonceSize];
                size_t len = wire::kHelloSize;
                own_hello(comm, lane, nlanes, stream, out);
                if (authed) {
                    LinkAuth &a = auths[link_index(comm, lane, peer, stream)];
                    if (!auth::new_nonce(a.nonce_c))
                        return fail(pcclSystemError, "libcrypto failed to draw a nonce");
                    std::memcpy(a.hello_c, out, wire::kHelloSize);
                    std::memcpy(out + wire::kHelloSize, a.nonce_c, auth::kNonceSize);
                    len = sizeof(out);
                }
                rc = net::write_exact(link.fd, out, len, deadline, comm->abort_fd, link.name);
                if (rc != pcclSuccess) return rc;
                ++acct->links_up[size_t(peer)];
            }
        }
    }
    pcclResult_t rc = accept_higher(r, deadline, auths);
    if (rc != pcclSuccess) return rc;
    for (int peer = 0; peer < comm->rank; ++peer) {
        for (int lane = first; lane < first + count; ++lane) {
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
                std::string mismatch = kind_mismatch(comm, h.kind, false);
                if (!mismatch.empty()) return fail(pcclAuthError, link.name + ": " + mismatch);
                if (int(h.rank) != peer || int(h.lane) != lane || int(h.stream) != stream)
                    return failf(pcclProtocolError, "%s answered as rank %u lane %u stream %u",
                                 link.name.c_str(), h.rank, unsigned(h.lane), unsigned(h.stream));
                if (authed) {
                    LinkAuth &a = auths[link_index(comm, lane, peer, stream)];
                    rc = prove_to_acceptor(comm, link, in, a, deadline);
                    if (rc != pcclSuccess) return rc;
                }
            }
        }
    }
    if (authed) {
        rc = check_connectors(r, auths, deadline);
        if (rc != pcclSuccess) return rc;
    }
    for (int lane = first; lane < first + count; ++lane) {
        for (auto &link : lanes[lane]->links) {
            if (link.fd < 0) continue;
            net::set_link_timeout(link.fd, comm->link_timeout_ms);
            // Striped: a stream has room for another frame only when little of what it
            // holds is unsent, so frames go to the streams that move (deal.hpp).
            if (comm->streams > 1) net::set_notsent_lowat(link.fd, kStreamRoomBytes);
        }
        lanes[lane]->connected = true;
    }
    return pcclSuccess;
}

}  // namespace pccl
