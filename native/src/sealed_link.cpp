// The sealed link (link.hpp): every frame travels as AES-256-GCM records (seal.hpp,
// docs/protocol.md "Sealed frames"): the header sealed alone, then the payload as one
// record. What is sent is sealed into the link's buffer a piece at a time; what arrives is
// read straight into the receiver's memory and opened there in place.
#include <algorithm>
#include <cerrno>
#include <vector>

#include "link.hpp"
#include "seal.hpp"
#include "socket.hpp"

namespace pccl {

namespace {

// How much of a payload a sealed link seals before sending it: large enough that a send
// moves a lot per syscall, small enough that the sealed bytes are still in cache.
constexpr uint64_t kSealPiece = 256u << 10;
// See open_arrived.
constexpr uint64_t kOpenBatch = 16u << 10;

class SealedLink final : public FrameLink {
public:
    SealedLink(int fd, seal::LinkSeal &keys, std::atomic<uint64_t> &sent,
               std::atomic<uint64_t> &received)
        : FrameLink(fd, sent, received), keys_(keys) {}

    size_t header_size() const override { return seal::kHeaderSize; }

    LinkError begin_send(const wire::FrameHeader &h, const uint8_t *data, bool movable) override {
        out_data_ = data;
        out_len_ = h.length;
        out_done_ = 0;
        movable_ = movable;
        out_seq0_ = keys_.out.next();
        plain_done_ = 0;
        sealed_pos_ = 0;
        tag_out_ = false;
        uint8_t hdr[wire::kFrameHeaderSize];
        wire::encode_frame(h, hdr);
        // Room for two pieces: one being sent, one sealed while the socket is full.
        size_t want = seal::kHeaderSize + 2 * size_t(std::min<uint64_t>(out_len_, kSealPiece)) +
                      seal::kTagSize;
        if (keys_.buf.size() < want) keys_.buf.resize(want);
        if (!keys_.out.seal(hdr, sizeof(hdr), keys_.buf.data()))
            return {LinkError::kCrypto, "seal a frame header", 0, {}};
        sealed_len_ = seal::kHeaderSize;
        return seal_more();
    }

    LinkError send_some(bool *done) override {
        *done = false;
        for (;;) {
            if (sealed_pos_ == sealed_len_) {
                if (plain_done_ == out_len_ && (out_len_ == 0 || tag_out_)) break;
                sealed_pos_ = sealed_len_ = 0;
                LinkError e = seal_more();
                if (e) return e;
                continue;
            }
            iovec iov = {keys_.buf.data() + sealed_pos_, sealed_len_ - sealed_pos_};
            uint64_t moved = 0;
            bool blocked = false;
            LinkError e = send_iov(&iov, 1, &moved, &blocked);
            if (e) return e;
            if (blocked) {
                // Seal ahead while the peer drains the socket (time otherwise spent in
                // poll), once the frame stays here: a byte of it left, or it cannot move.
                if ((out_done_ > 0 || !movable_) && plain_done_ < out_len_ &&
                    sealed_len_ + kSealPiece + seal::kTagSize <= keys_.buf.size())
                    return seal_more();
                return {};
            }
            sealed_pos_ += size_t(moved);
            out_done_ += moved;
        }
        *done = true;
        return {};
    }

    void give_back() override { keys_.out.rewind(out_seq0_); }

    LinkError peek_header(wire::FrameHeader *h, Peeked *state) override {
        uint8_t raw[seal::kHeaderSize], plain[wire::kFrameHeaderSize];
        ssize_t n = 0;
        LinkError e = peek_raw(raw, sizeof(raw), &n);
        *state = n < 0 ? Peeked::kNone : n == 0 ? Peeked::kClosed
                 : size_t(n) < sizeof(raw) ? Peeked::kPartial : Peeked::kHeader;
        if (e || *state != Peeked::kHeader) return e;
        // Opened without taking its record number: take_header takes it.
        if (!keys_.in.peek(raw, sizeof(plain), plain)) return {LinkError::kIntegrity, "a frame header", 0, {}};
        if (wire::decode_frame(plain, h, &e.why) != pcclSuccess) e.kind = LinkError::kProtocol;
        return e;
    }

    LinkError take_header(uint8_t *dst, uint64_t len) override {
        uint8_t raw[seal::kHeaderSize], plain[wire::kFrameHeaderSize];
        uint64_t got = 0;
        bool blocked = false;
        LinkError e = recv_into(raw, sizeof(raw), &got, &blocked);
        if (e) return e;
        if (got != sizeof(raw))  // not reached: it was peeked whole, nothing else reads here
            return {LinkError::kSyscall, "recv() of a peeked frame header", EIO, {}};
        if (!keys_.in.open(raw, sizeof(plain), plain)) return {LinkError::kIntegrity, "a frame header", 0, {}};
        in_dst_ = dst;
        in_len_ = len;
        in_got_ = in_tag_got_ = in_opened_ = 0;
        if (len > 0 && !keys_.in.begin()) return {LinkError::kCrypto, "open a payload", 0, {}};
        return {};
    }

    LinkError recv_some(bool *done, uint64_t *due) override {
        *done = false;
        bool blocked = false;
        while (in_got_ < in_len_) {
            LinkError e = recv_into(in_dst_ + in_got_, size_t(in_len_ - in_got_), &in_got_, &blocked);
            if (e) return e;
            if (blocked) {
                *due = in_len_ - in_got_ + seal::kTagSize;
                return {};
            }
            if (!open_arrived()) return {LinkError::kCrypto, "open a payload", 0, {}};
        }
        if (!open_arrived()) return {LinkError::kCrypto, "open a payload", 0, {}};
        if (in_len_ > 0) {
            while (in_tag_got_ < seal::kTagSize) {
                LinkError e = recv_into(in_tag_ + in_tag_got_, seal::kTagSize - size_t(in_tag_got_),
                                        &in_tag_got_, &blocked);
                if (e) return e;
                if (blocked) {
                    *due = seal::kTagSize - in_tag_got_;
                    return {};
                }
            }
            if (!keys_.in.finish_open(in_tag_)) return {LinkError::kIntegrity, "a frame's payload", 0, {}};
        }
        *done = true;
        return {};
    }

    std::string abort_reason(uint64_t len, int64_t deadline_ms, int abort_fd,
                             const std::string &who) override {
        std::string reason(size_t(len), '\0');
        if (!len) return reason;
        std::vector<uint8_t> raw(size_t(seal::payload_size(len)));
        if (net::read_exact(fd_, raw.data(), raw.size(), deadline_ms, abort_fd, who) != pcclSuccess)
            return "(reason unreadable)";
        if (!keys_.in.open(raw.data(), reason.size(), (uint8_t *)&reason[0]))
            return "(reason failed its integrity check)";
        return reason;
    }

private:
    // Appends the next piece of the frame's payload record (and, after its last byte, the
    // record's tag) to what the link's buffer holds from sealed_len_ on.
    LinkError seal_more() {
        if (plain_done_ == out_len_) {
            if (out_len_ > 0 && !tag_out_) {
                if (!keys_.out.finish_seal(keys_.buf.data() + sealed_len_))
                    return {LinkError::kCrypto, "seal a payload", 0, {}};
                sealed_len_ += seal::kTagSize;
                tag_out_ = true;
            }
            return {};
        }
        if (plain_done_ == 0 && !keys_.out.begin()) return {LinkError::kCrypto, "seal a payload", 0, {}};
        size_t n = size_t(std::min<uint64_t>(out_len_ - plain_done_, kSealPiece));
        if (!keys_.out.update(out_data_ + plain_done_, keys_.buf.data() + sealed_len_, n))
            return {LinkError::kCrypto, "seal a payload", 0, {}};
        sealed_len_ += n;
        plain_done_ += n;
        if (plain_done_ == out_len_) return seal_more();  // the tag fits: buf has room
        return {};
    }

    // Opens (in place) what has arrived of the payload while it is still in cache, in
    // whole AES blocks of at least kOpenBatch bytes until the last: OpenSSL's GCM runs at
    // two thirds of its speed on pieces that split blocks. False if libcrypto failed.
    bool open_arrived() {
        uint64_t end = in_got_ == in_len_ ? in_len_ : in_got_ & ~uint64_t(15);
        if (end == in_opened_ || (end < in_len_ && end - in_opened_ < kOpenBatch)) return true;
        bool ok = keys_.in.update(in_dst_ + in_opened_, in_dst_ + in_opened_, size_t(end - in_opened_));
        in_opened_ = end;
        return ok;
    }

    seal::LinkSeal &keys_;
    // The outgoing frame: sealed_pos_ .. sealed_len_ of keys_.buf is still to send, and
    // plain_done_ payload bytes have been sealed. out_seq0_: its first record's number.
    const uint8_t *out_data_ = nullptr;
    uint64_t out_len_ = 0, plain_done_ = 0, out_seq0_ = 0;
    size_t sealed_pos_ = 0, sealed_len_ = 0;
    bool tag_out_ = false;  // the payload record's tag is in the buffer
    bool movable_ = false;
    // The incoming frame: in_got_ payload bytes arrived, in_opened_ of them opened in place.
    uint8_t *in_dst_ = nullptr;
    uint64_t in_len_ = 0, in_got_ = 0, in_opened_ = 0, in_tag_got_ = 0;
    uint8_t in_tag_[seal::kTagSize];
};

}  // namespace

std::unique_ptr<FrameLink> open_sealed_link(int fd, seal::LinkSeal &keys, std::atomic<uint64_t> &sent,
                                            std::atomic<uint64_t> &received) {
    return std::make_unique<SealedLink>(fd, keys, sent, received);
}

}  // namespace pccl
