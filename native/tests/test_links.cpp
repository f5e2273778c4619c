// Unit tests of the two FrameLink siblings (native/src/link.hpp) over a socketpair, plain
// and sealed alike: what one end's link sends the other's receives, frame by frame; a
// peeked header stays in the socket until taken; a frame given back before a byte of it
// left (the socket was full) frees what it took, so the next frame arrives whole and, on
// a sealed link, opens; half a header, a closed peer, garbage and an ABORT's reason read as
// such. Built and run by tests/native/test_native.py (with ASan/UBSan).
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../src/link.hpp"
#include "../src/seal.hpp"
#include "../src/socket.hpp"
#include "expect.hpp"

using namespace pccl;

namespace {

struct Ends {
    int a = -1, b = -1;  // a sends, b receives
    Ends() {
        int fds[2];
        EXPECT(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, fds) == 0);
        a = fds[0];
        b = fds[1];
    }
    ~Ends() {
        if (a >= 0) close(a);
        if (b >= 0) close(b);
    }
};

// A link pair over `e`, plain or sealed (keys derived from one exchange, as handshake.cpp
// does for the two ends of a link).
struct Links {
    pcclComm comm;  // owns the byte counts
    seal::LinkSeal keys_a, keys_b;
    std::unique_ptr<FrameLink> tx, rx;
    Links(const Ends &e, bool sealed) {
        if (!sealed) {
            pcclComm::Link la, lb;
            la.fd = e.a;
            lb.fd = e.b;
            tx = open_link(&comm, la);
            rx = open_link(&comm, lb);
            return;
        }
        std::vector<uint8_t> secret(24, 9);
        uint8_t hello_c[wire::kHelloSize] = {1}, hello_a[wire::kHelloSize] = {2};
        uint8_t nonce_c[32] = {3}, nonce_a[32] = {4};
        EXPECT(seal::derive(secret, true, hello_c, hello_a, nonce_c, nonce_a, &keys_a));
        EXPECT(seal::derive(secret, false, hello_c, hello_a, nonce_c, nonce_a, &keys_b));
        tx = open_sealed_link(e.a, keys_a, comm.bytes_sent, comm.bytes_received);
        // The receiving end opens what the connector sealed: its `in` is keys_a's `out`.
        rx = open_sealed_link(e.b, keys_b, comm.bytes_sent, comm.bytes_received);
    }
};

wire::FrameHeader header(uint32_t step, uint64_t len) {
    wire::FrameHeader h;
    h.coll = wire::kCollP2P;
    h.dtype = pcclUInt8;
    h.seq = 3;
    h.step = step;
    h.count = len;
    h.length = len;
    return h;
}

// Sends one whole frame (the socket has room for it).
void send_frame(FrameLink &tx, const wire::FrameHeader &h, const uint8_t *data) {
    bool done = false;
    EXPECT(!tx.begin_send(h, data, true));
    EXPECT(!tx.send_some(&done) && done);
}

// Receives the next frame, which must be `want` with payload `data`.
void expect_frame(FrameLink &rx, const wire::FrameHeader &want, const uint8_t *data) {
    wire::FrameHeader h, again;
    FrameLink::Peeked state;
    EXPECT(!rx.peek_header(&h, &state) && state == FrameLink::Peeked::kHeader);
    EXPECT(!rx.peek_header(&again, &state) && state == FrameLink::Peeked::kHeader);  // still there
    EXPECT(h.step == want.step && h.length == want.length && again.step == want.step);
    std::vector<uint8_t> got(size_t(h.length) + 1, 0xEE);
    EXPECT(!rx.take_header(got.data(), h.length));
    bool done = false;
    uint64_t due = 0;
    EXPECT(!rx.recv_some(&done, &due) && done);
    EXPECT(h.length == 0 || memcmp(got.data(), data, size_t(h.length)) == 0);
    EXPECT(got[size_t(h.length)] == 0xEE);  // nothing written past it
}

void test_frames_pass(bool sealed) {
    Ends e;
    Links l(e, sealed);
    std::vector<uint8_t> data(60000);
    for (size_t i = 0; i < data.size(); ++i) data[i] = uint8_t(i * 13 + 1);
    const uint64_t sizes[] = {0, 1, 1000, 60000};
    for (uint32_t i = 0; i < 4; ++i) send_frame(*l.tx, header(i, sizes[i]), data.data());
    for (uint32_t i = 0; i < 4; ++i) expect_frame(*l.rx, header(i, sizes[i]), data.data());
    wire::FrameHeader h;
    FrameLink::Peeked state;
    EXPECT(!l.rx->peek_header(&h, &state) && state == FrameLink::Peeked::kNone);
    EXPECT(l.comm.bytes_sent.load() == l.comm.bytes_received.load() && l.comm.bytes_sent.load() > 61001);
}

// Fills the socket with header-only frames until one does not fit, gives it back, drains
// the socket and sends one more frame: it arrives whole (sealed: its records are numbered
// where the peer expects them, so it opens).
void test_a_frame_given_back(bool sealed) {
    Ends e;
    Links l(e, sealed);
    uint32_t sent = 0;
    for (;; ++sent) {
        bool done = false;
        EXPECT(!l.tx->begin_send(header(sent, 0), nullptr, true));
        EXPECT(!l.tx->send_some(&done));
        if (!done) break;
        if (sent > 1000000) break;  // not reached: the socket fills
    }
    EXPECT(l.tx->sent() == 0 && sent > 10);
    l.tx->give_back();
    for (uint32_t i = 0; i < sent; ++i) expect_frame(*l.rx, header(i, 0), nullptr);
    std::vector<uint8_t> data(1000, 0x5A);
    send_frame(*l.tx, header(7777, data.size()), data.data());
    expect_frame(*l.rx, header(7777, data.size()), data.data());
}

void test_broken_input(bool sealed) {
    const size_t hs = sealed ? seal::kHeaderSize : wire::kFrameHeaderSize;
    wire::FrameHeader h;
    FrameLink::Peeked state;
    {
        // Half a header, then the peer closes: partial, and the whole stream ends there.
        Ends e;
        Links l(e, sealed);
        uint8_t part[10] = {};
        EXPECT(write(e.a, part, sizeof(part)) == 10);
        EXPECT(!l.rx->peek_header(&h, &state) && state == FrameLink::Peeked::kPartial);
        close(e.a);
        e.a = -1;
        EXPECT(!l.rx->peek_header(&h, &state) && state == FrameLink::Peeked::kPartial);
        uint8_t sink[10];
        EXPECT(read(e.b, sink, sizeof(sink)) == 10);
        EXPECT(!l.rx->peek_header(&h, &state) && state == FrameLink::Peeked::kClosed);
    }
    {
        // A closed peer in the middle of a payload.
        Ends e;
        Links l(e, sealed);
        std::vector<uint8_t> data(5000, 1);
        send_frame(*l.tx, header(0, data.size()), data.data());
        EXPECT(!l.rx->peek_header(&h, &state) && state == FrameLink::Peeked::kHeader);
        std::vector<uint8_t> got(data.size());
        EXPECT(!l.rx->take_header(got.data(), h.length));
        std::vector<uint8_t> sink(3000);
        EXPECT(read(e.b, sink.data(), sink.size()) == 3000);  // lose part of it on the way
        close(e.a);
        e.a = -1;
        bool done = false;
        uint64_t due = 0;
        LinkError err = l.rx->recv_some(&done, &due);
        EXPECT(!done && (sealed ? err.kind == LinkError::kIntegrity || err.kind == LinkError::kClosed
                                : err.kind == LinkError::kClosed));
    }
    {
        // Garbage where a header belongs: a malformed one (plain), one that fails its tag (sealed).
        Ends e;
        Links l(e, sealed);
        std::vector<uint8_t> junk(hs, 0x41);
        EXPECT(write(e.a, junk.data(), junk.size()) == ssize_t(junk.size()));
        LinkError err = l.rx->peek_header(&h, &state);
        EXPECT(sealed ? err.kind == LinkError::kIntegrity : (err.kind == LinkError::kProtocol && !err.why.empty()));
    }
    {
        // An ABORT frame's reason.
        Ends e;
        Links l(e, sealed);
        std::string reason = "rank 1 failed: peer lost";
        wire::FrameHeader abort_hdr;
        abort_hdr.type = wire::kFrameAbort;
        abort_hdr.length = reason.size();
        send_frame(*l.tx, abort_hdr, (const uint8_t *)reason.data());
        EXPECT(!l.rx->peek_header(&h, &state) && state == FrameLink::Peeked::kHeader);
        EXPECT(h.type == wire::kFrameAbort && h.length == reason.size());
        EXPECT(!l.rx->take_header(nullptr, 0));
        EXPECT(l.rx->abort_reason(h.length, net::now_ms() + 5000, -1, "the peer") == reason);
    }
}

}  // namespace

int main() {
    for (bool sealed : {false, true}) {
        test_frames_pass(sealed);
        test_a_frame_given_back(sealed);
        test_broken_input(sealed);
    }
    return report("link unit tests");
}
