// A data link's frames as the engine moves them (engine.cpp): send some of an outgoing
// frame, peek at and take an incoming frame's header, receive some of its payload. A plain
// link moves the bytes as they are (link.cpp); a sealed one moves every header and payload
// as an AES-256-GCM record, sealed and opened in place (sealed_link.cpp, seal.hpp). One
// interface, two siblings, as gloo's transport/tcp/ and transport/tcp/tls/ have it, so
// neither the engine nor the any-source wait asks which kind a link is.
//
// Every call is non-blocking but abort_reason's: it does what the socket allows now and says
// what is left, and the engine polls. A link moves one outgoing and one incoming frame at a
// time. Failures are values (LinkError), which the engine words with the link's and the
// op's names.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "comm.hpp"
#include "wire.hpp"

namespace pccl {

struct LinkError {
    enum Kind : uint8_t {
        kNone,
        kClosed,     // the peer closed the connection in the middle of a frame
        kSyscall,    // `what` failed with errno `err`
        kProtocol,   // a malformed frame header: `why`
        kIntegrity,  // `what` failed its integrity check (a sealed link)
        kCrypto,     // libcrypto failed to `what`
    };
    Kind kind = kNone;
    const char *what = "";
    int err = 0;
    std::string why;
    explicit operator bool() const { return kind != kNone; }
};

class FrameLink {
public:
    // fd: the connected socket; bytes that move are added to the communicator's counts.
    FrameLink(int fd, std::atomic<uint64_t> &sent, std::atomic<uint64_t> &received)
        : fd_(fd), sent_(sent), received_(received) {}
    virtual ~FrameLink() = default;
    FrameLink(const FrameLink &) = delete;
    FrameLink &operator=(const FrameLink &) = delete;

    // Bytes a frame header takes on this link.
    virtual size_t header_size() const = 0;

    // --- the outgoing frame
    // Starts one: `h`, then h.length bytes at `data` (alive until it is done or given
    // back). `movable`: it may be given back before a byte of it left, so nothing beyond
    // what its first send needs is prepared until then.
    virtual LinkError begin_send(const wire::FrameHeader &h, const uint8_t *data, bool movable) = 0;
    // Sends what the socket takes: *done once all of the frame left, else the socket is
    // full (wait for POLLOUT).
    virtual LinkError send_some(bool *done) = 0;
    // Bytes of the outgoing frame that left (a sealed link's: of its records).
    uint64_t sent() const { return out_done_; }
    // Gives the frame up before a byte of it left (another stream takes it, or an ABORT is
    // sent in its place): a sealed link takes its record numbers back.
    virtual void give_back() {}

    // --- the incoming frame
    enum class Peeked {
        kNone,     // nothing there yet
        kPartial,  // part of a header (SO_RCVLOWAT: the rest is coming, or the peer closed)
        kClosed,   // the peer closed the stream
        kHeader,   // *h: the next header, decoded (a sealed one opened and verified)
    };
    // Looks at the next header without taking it (a sealed one keeps its record number).
    virtual LinkError peek_header(wire::FrameHeader *h, Peeked *state) = 0;
    // Takes the peeked header off the stream; its payload (`len` bytes, the header's
    // length) is read into `dst` by recv_some.
    virtual LinkError take_header(uint8_t *dst, uint64_t len) = 0;
    // Reads what has arrived of the payload: *done once all of it is there (a sealed one
    // opened and its tag verified, so only then is it used); else *due bytes are to come.
    virtual LinkError recv_some(bool *done, uint64_t *due) = 0;
    // After take_header of an ABORT frame: its reason (`len` bytes, bounded by
    // decode_frame), read by the deadline, or a placeholder saying why not.
    virtual std::string abort_reason(uint64_t len, int64_t deadline_ms, int abort_fd,
                                     const std::string &who) = 0;

protected:
    // One sendmsg of `iov` / one recv into `into`: what moved is added to *moved and
    // counted; *blocked when the socket took or had nothing (EAGAIN). EOF is kClosed.
    LinkError send_iov(const iovec *iov, int cnt, uint64_t *moved, bool *blocked);
    LinkError recv_into(uint8_t *into, size_t want, uint64_t *got, bool *blocked);
    // Peeks up to `size` bytes: *n of them (0: the peer closed; -1: none there yet).
    LinkError peek_raw(uint8_t *raw, size_t size, ssize_t *n);

    const int fd_;
    std::atomic<uint64_t> &sent_, &received_;
    uint64_t out_done_ = 0;
};

// The link's frames: sealed when the handshake gave it record keys (link.seal), else plain.
std::unique_ptr<FrameLink> open_link(pcclComm *comm, pcclComm::Link &link);

// The sealed sibling (sealed_link.cpp), keyed by `keys`, which outlive it.
std::unique_ptr<FrameLink> open_sealed_link(int fd, seal::LinkSeal &keys,
                                            std::atomic<uint64_t> &sent,
                                            std::atomic<uint64_t> &received);

}  // namespace pccl
