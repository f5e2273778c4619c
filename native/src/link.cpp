// The plain link (link.hpp): frames as they are, header and payload in one sendmsg where
// the socket takes them.
#include "link.hpp"

#include <errno.h>
#include <sys/socket.h>

#include "socket.hpp"

namespace pccl {

LinkError FrameLink::send_iov(const iovec *iov, int cnt, uint64_t *moved, bool *blocked) {
    msghdr msg{};
    msg.msg_iov = const_cast<iovec *>(iov);
    msg.msg_iovlen = size_t(cnt);
    *blocked = false;
    for (;;) {
        ssize_t n = sendmsg(fd_, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n > 0) {
            *moved += uint64_t(n);
            sent_ += uint64_t(n);
            return {};
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            *blocked = true;
            return {};
        }
        return {LinkError::kSyscall, "send()", n < 0 ? errno : EPIPE, {}};
    }
}

LinkError FrameLink::recv_into(uint8_t *into, size_t want, uint64_t *got, bool *blocked) {
    *blocked = false;
    for (;;) {
        ssize_t n = recv(fd_, into, want, MSG_DONTWAIT);
        if (n > 0) {
            *got += uint64_t(n);
            received_ += uint64_t(n);
            return {};
        }
        if (n == 0) return {LinkError::kClosed, "", 0, {}};
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            *blocked = true;
            return {};
        }
        return {LinkError::kSyscall, "recv()", errno, {}};
    }
}

LinkError FrameLink::peek_raw(uint8_t *raw, size_t size, ssize_t *n) {
    for (;;) {
        *n = recv(fd_, raw, size, MSG_DONTWAIT | MSG_PEEK);
        if (*n >= 0) return {};
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return {};  // *n == -1: nothing there
        return {LinkError::kSyscall, "recv()", errno, {}};
    }
}

namespace {

class PlainLink final : public FrameLink {
public:
    using FrameLink::FrameLink;

    size_t header_size() const override { return wire::kFrameHeaderSize; }

    LinkError begin_send(const wire::FrameHeader &h, const uint8_t *data, bool) override {
        wire::encode_frame(h, out_hdr_);
        out_data_ = data;
        out_len_ = h.length;
        out_done_ = 0;
        return {};
    }

    LinkError send_some(bool *done) override {
        *done = false;
        const uint64_t total = wire::kFrameHeaderSize + out_len_;
        while (out_done_ < total) {
            iovec iov[2];
            int cnt = 0;
            if (out_done_ < wire::kFrameHeaderSize) {
                iov[cnt++] = {out_hdr_ + out_done_, size_t(wire::kFrameHeaderSize - out_done_)};
                if (out_len_) iov[cnt++] = {(void *)out_data_, size_t(out_len_)};
            } else {
                uint64_t off = out_done_ - wire::kFrameHeaderSize;
                iov[cnt++] = {(void *)(out_data_ + off), size_t(out_len_ - off)};
            }
            bool blocked = false;
            LinkError e = send_iov(iov, cnt, &out_done_, &blocked);
            if (e || blocked) return e;
        }
        *done = true;
        return {};
    }

    LinkError peek_header(wire::FrameHeader *h, Peeked *state) override {
        uint8_t raw[wire::kFrameHeaderSize];
        ssize_t n = 0;
        LinkError e = peek_raw(raw, sizeof(raw), &n);
        *state = n < 0 ? Peeked::kNone : n == 0 ? Peeked::kClosed
                 : size_t(n) < sizeof(raw) ? Peeked::kPartial : Peeked::kHeader;
        if (e || *state != Peeked::kHeader) return e;
        if (wire::decode_frame(raw, h, &e.why) != pcclSuccess) e.kind = LinkError::kProtocol;
        return e;
    }

    LinkError take_header(uint8_t *dst, uint64_t len) override {
        uint8_t raw[wire::kFrameHeaderSize];
        uint64_t got = 0;
        bool blocked = false;
        LinkError e = recv_into(raw, sizeof(raw), &got, &blocked);
        if (!e && got != sizeof(raw))  // not reached: it was peeked whole, nothing else reads here
            e = {LinkError::kSyscall, "recv() of a peeked frame header", EIO, {}};
        in_dst_ = dst;
        in_len_ = len;
        in_got_ = 0;
        return e;
    }

    LinkError recv_some(bool *done, uint64_t *due) override {
        *done = false;
        while (in_got_ < in_len_) {
            bool blocked = false;
            LinkError e = recv_into(in_dst_ + in_got_, size_t(in_len_ - in_got_), &in_got_, &blocked);
            if (e) return e;
            if (blocked) {
                *due = in_len_ - in_got_;
                return {};
            }
        }
        *done = true;
        return {};
    }

    std::string abort_reason(uint64_t len, int64_t deadline_ms, int abort_fd,
                             const std::string &who) override {
        std::string reason(size_t(len), '\0');
        if (len && net::read_exact(fd_, &reason[0], reason.size(), deadline_ms, abort_fd, who) != pcclSuccess)
            return "(reason unreadable)";
        return reason;
    }

private:
    uint8_t out_hdr_[wire::kFrameHeaderSize];
    const uint8_t *out_data_ = nullptr;
    uint64_t out_len_ = 0;
    uint8_t *in_dst_ = nullptr;
    uint64_t in_len_ = 0, in_got_ = 0;
};

}  // namespace

std::unique_ptr<FrameLink> open_link(pcclComm *comm, pcclComm::Link &link) {
    if (link.seal) return open_sealed_link(link.fd, *link.seal, comm->bytes_sent, comm->bytes_received);
    return std::make_unique<PlainLink>(link.fd, comm->bytes_sent, comm->bytes_received);
}

}  // namespace pccl
