#include "engine.hpp"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <climits>
#include <optional>
#include <string>
#include <vector>

#include "deal.hpp"
#include "dtype.hpp"
#include "error.hpp"
#include "pacing.hpp"
#include "reduce.hpp"
#include "seal.hpp"
#include "socket.hpp"

namespace pccl {

namespace {

// How much of a payload a sealed link seals before sending it: large enough that a send
// moves a lot per syscall, small enough that the sealed bytes are still in cache.
constexpr uint64_t kSealPiece = 256u << 10;
constexpr uint64_t kOpenBatch = 16u << 10;  // see Engine::open_arrived

// One connection's part in the op. Frames are dealt to a peer's streams as they have room
// (deal.hpp): a stream carries one outgoing and one incoming frame at a time.
struct LinkState {
    // The outgoing frame this stream took (a send item; -1: none): header then payload.
    int32_t tx = -1;
    uint8_t out_hdr[wire::kFrameHeaderSize];
    uint64_t out_done = 0;  // bytes of the frame (sealed: of its records) that left
    // A sealed link's outgoing frame (seal.hpp): its records are sealed into the link's
    // buffer piece by piece; sealed_pos .. sealed_len of it is still to send, and
    // plain_done payload bytes have been sealed. out_seq0: the first record's number, put
    // back if the frame is given up before a byte of it left.
    uint64_t plain_done = 0;
    size_t sealed_pos = 0, sealed_len = 0;
    uint64_t out_seq0 = 0;
    bool sealed_tag_out = false;  // the payload record's tag is in the buffer
    bool want_out = false;  // the last send hit EAGAIN: wait for POLLOUT
    // The incoming frame whose header this stream delivered (a receive item; -1: none).
    int32_t rx = -1;
    uint64_t in_got = 0;
    uint8_t in_tag[seal::kTagSize];  // a sealed payload's tag, read after the payload
    uint64_t in_tag_got = 0;
    uint64_t in_opened = 0;  // payload bytes of a sealed frame opened (in place) so far
    // Links with nothing of this op to receive are still read for ABORT frames.
    bool watch = false;
    // Nothing more of this op comes here: a later op's frame is at its head (kept in
    // `later`), or the peer closed the stream (`eof`).
    bool idle = false;
    bool eof = false;
    bool has_later = false;
    wire::FrameHeader later;
};

struct PeerState {
    size_t sends_left = 0;   // send items not yet wholly handed to the sockets
    size_t recvs_left = 0;   // receive items not yet landed
    size_t next_stream = 0;  // where the next deal looks first: streams with room take turns
};

class Engine {
public:
    Engine(pcclComm *comm, const Schedule &s, int64_t deadline)
        : comm_(comm), s_(s), deadline_(deadline), S_(size_t(comm->stripe)),
          stride_(size_t(comm->streams)), links_(comm->links.size()),
          peers_(size_t(comm->world_size)), dealer_(s, comm->world_size),
          arrivals_(s, comm->world_size, comm->coll_seq),
          remaining_(s.sends.size() + s.recvs.size()) {
        // Striping: any of the first `stripe` streams to a peer (pcclCommSetStripe) takes
        // the peer's next ready frame when it has room, and the receiver places every
        // frame by the op and step its header names (deal.hpp).
        for (const SendItem &it : s.sends) ++peers_[size_t(it.peer)].sends_left;
        for (const RecvItem &it : s.recvs) ++peers_[size_t(it.peer)].recvs_left;
        for (size_t li = 0; li < links_.size(); ++li) {
            int p = peer_of(li);
            links_[li].watch = p != comm->rank && (s.watch_all || pending(p));
        }
        es_ = type_size(s.dtype);
        if (stride_ > 1) {  // only striped streams are paced (pacing.hpp)
            std::vector<char> sends_to(size_t(comm->world_size), 0);
            for (const SendItem &it : s.sends) sends_to[size_t(it.peer)] = 1;
            probe_.emplace(comm, sends_to);
        }
    }

    pcclResult_t run() {
        pcclResult_t rc = loop();
        if (rc == pcclSuccess && probe_) probe_->finish();
        if (rc != pcclSuccess) {
            std::vector<char> mid(links_.size(), 0);
            for (size_t li = 0; li < links_.size(); ++li) {
                const LinkState &l = links_[li];
                mid[li] = l.tx >= 0 && l.out_done > 0;
                // A frame sealed but not sent: its record numbers are free again, so the
                // ABORT that fail_comm seals next is the record the peer expects.
                seal::LinkSeal *ls = comm_->links[li].seal.get();
                if (ls && l.tx >= 0 && l.out_done == 0) ls->out.rewind(l.out_seq0);
            }
            fail_comm(comm_, rc, &mid);
        }
        return rc;
    }

private:
    // Links are indexed peer * stride_ + stream; `li` below is such an index.
    int peer_of(size_t li) const { return int(li / stride_); }
    size_t stream_of(size_t li) const { return li % stride_; }
    const std::string &name(size_t li) const { return comm_->links[li].name; }
    int fd(size_t li) const { return comm_->links[li].fd; }
    // "rank 2 (10.0.0.2:4000)": a peer's name without a stream's.
    std::string peer_name(int peer) const {
        std::string n = name(size_t(peer) * stride_);
        size_t cut = n.rfind(" stream ");
        return cut == std::string::npos ? n : n.substr(0, cut);
    }
    bool pending(int peer) const {
        return peers_[size_t(peer)].sends_left > 0 || peers_[size_t(peer)].recvs_left > 0;
    }
    // Whether this op still owes `peer` bytes (a hang-up then fails it).
    bool owed(int peer) const { return peers_[size_t(peer)].sends_left > 0; }

    pcclResult_t lost(size_t li, const char *what) {
        return fail(pcclPeerLost, name(li) + " " + what + " during " + op_name());
    }
    std::string op_name() const {
        uint8_t coll = s_.sends.empty() ? (s_.recvs.empty() ? 0 : s_.recvs[0].expect.coll) : s_.sends[0].hdr.coll;
        uint64_t seq = s_.sends.empty() ? (s_.recvs.empty() ? 0 : s_.recvs[0].expect.seq) : s_.sends[0].hdr.seq;
        return std::string(wire::coll_name(coll)) + " #" + std::to_string(seq);
    }

    pcclResult_t io_error(size_t li, const char *syscall, int err) {
        // ETIMEDOUT: nothing acknowledged for the link timeout (net::set_link_timeout).
        pcclResult_t rc = (err == ECONNRESET || err == EPIPE || err == ENOTCONN || err == ETIMEDOUT)
                              ? pcclPeerLost
                              : pcclSystemError;
        return fail(rc, syscall_error(syscall, err, name(li)) + " during " + op_name());
    }

    seal::LinkSeal *sealed(size_t li) const { return comm_->links[li].seal.get(); }
    size_t header_size(size_t li) const {
        return sealed(li) ? seal::kHeaderSize : wire::kFrameHeaderSize;
    }

    pcclResult_t integrity(size_t li, const char *what) {
        return fail(pcclIntegrityError,
                    name(li) + ": " + what + " failed its integrity check during " + op_name() +
                        " (altered, dropped, replayed or reordered on the way); nothing of it "
                        "was used");
    }

    // ---- sending ------------------------------------------------------------------

    // Deals `peer`'s ready frames to its streams: a stream that is not in the middle of a
    // frame and whose socket takes more (TCP_NOTSENT_LOWAT: little unsent data there,
    // deal.hpp) takes the earliest ready frame; streams with room take turns, so with
    // room everywhere the frames go round-robin. A stream that stalls takes no more.
    pcclResult_t deal(int peer) {
        PeerState &ps = peers_[size_t(peer)];
        for (;;) {
            bool finished = false;
            const size_t start = ps.next_stream;
            for (size_t j = 0; j < S_; ++j) {
                const size_t k = (start + j) % S_, li = size_t(peer) * stride_ + k;
                LinkState &l = links_[li];
                if (l.want_out) continue;
                if (l.tx < 0) {
                    if ((l.tx = dealer_.take(peer)) < 0) continue;
                    ps.next_stream = (k + 1) % S_;
                    pcclResult_t rc = start_frame(li);
                    if (rc != pcclSuccess) return rc;
                }
                bool done = false;
                pcclResult_t rc = send_frame(li, &done);
                if (rc != pcclSuccess) return rc;
                if (done) {
                    l.tx = -1;
                    --ps.sends_left;
                    --remaining_;
                    finished = true;
                } else if (l.out_done == 0 && S_ > 1) {
                    // The socket had no room for a byte of it: another stream may take it.
                    if (seal::LinkSeal *ls = sealed(li)) ls->out.rewind(l.out_seq0);
                    dealer_.give_back(l.tx);
                    l.tx = -1;
                }
            }
            if (!finished) return pcclSuccess;
        }
    }

    pcclResult_t start_frame(size_t li) {
        LinkState &l = links_[li];
        const SendItem &it = s_.sends[size_t(l.tx)];
        wire::encode_frame(it.hdr, l.out_hdr);
        l.out_done = 0;
        seal::LinkSeal *ls = sealed(li);
        if (!ls) return pcclSuccess;
        l.out_seq0 = ls->out.next();
        l.plain_done = 0;
        l.sealed_pos = 0;
        l.sealed_tag_out = false;
        // Room for two pieces: one being sent, one sealed while the socket is full.
        size_t want = seal::kHeaderSize + 2 * size_t(std::min<uint64_t>(it.len, kSealPiece)) +
                      seal::kTagSize;
        if (ls->buf.size() < want) ls->buf.resize(want);
        if (!ls->out.seal(l.out_hdr, wire::kFrameHeaderSize, ls->buf.data()))
            return fail(pcclSystemError, "libcrypto failed to seal a frame header");
        l.sealed_len = seal::kHeaderSize;
        return seal_more(l, *ls, it);
    }

    // One send of what `iov` holds on a link: what left is added to *moved and the
    // communicator's count; a full socket sets the link's want_out (wait for POLLOUT).
    pcclResult_t send_some(size_t li, const iovec *iov, int cnt, uint64_t *moved) {
        msghdr msg{};
        msg.msg_iov = const_cast<iovec *>(iov);
        msg.msg_iovlen = size_t(cnt);
        for (;;) {
            ssize_t n = sendmsg(fd(li), &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
            if (n > 0) {
                *moved += uint64_t(n);
                comm_->bytes_sent += uint64_t(n);
                return pcclSuccess;
            }
            if (n < 0 && errno == EINTR) continue;
            if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
                links_[li].want_out = true;
                return pcclSuccess;
            }
            return io_error(li, "send()", n < 0 ? errno : EPIPE);
        }
    }

    // Sends what the socket takes of the stream's frame; *done once all of it left.
    pcclResult_t send_frame(size_t li, bool *done) {
        if (sealed(li)) return send_sealed(li, done);
        LinkState &l = links_[li];
        const SendItem &it = s_.sends[size_t(l.tx)];
        const uint64_t total = wire::kFrameHeaderSize + it.len;
        while (l.out_done < total) {
            iovec iov[2];
            int cnt = 0;
            if (l.out_done < wire::kFrameHeaderSize) {
                iov[cnt++] = {l.out_hdr + l.out_done, wire::kFrameHeaderSize - l.out_done};
                if (it.len) iov[cnt++] = {(void *)it.data, it.len};
            } else {
                uint64_t off = l.out_done - wire::kFrameHeaderSize;
                iov[cnt++] = {(void *)(it.data + off), it.len - off};
            }
            uint64_t moved = 0;
            pcclResult_t rc = send_some(li, iov, cnt, &moved);
            if (rc != pcclSuccess || l.want_out) return rc;
            l.out_done += moved;
        }
        *done = true;
        return pcclSuccess;
    }

    // A sealed link's frame: its header record and payload record are sealed into the
    // link's buffer a piece at a time and sent from there.
    pcclResult_t send_sealed(size_t li, bool *done) {
        LinkState &l = links_[li];
        seal::LinkSeal &ls = *sealed(li);
        const SendItem &it = s_.sends[size_t(l.tx)];
        for (;;) {
            if (l.sealed_pos == l.sealed_len) {
                if (l.plain_done == it.len && (it.len == 0 || l.sealed_tag_out)) break;
                l.sealed_pos = l.sealed_len = 0;
                pcclResult_t rc = seal_more(l, ls, it);
                if (rc != pcclSuccess) return rc;
                continue;
            }
            iovec iov = {ls.buf.data() + l.sealed_pos, l.sealed_len - l.sealed_pos};
            uint64_t moved = 0;
            pcclResult_t rc = send_some(li, &iov, 1, &moved);
            if (rc != pcclSuccess) return rc;
            if (l.want_out) {
                // Seal ahead while the peer drains the socket (time otherwise spent in
                // poll), once the frame is this stream's for good: a byte of it left.
                if ((l.out_done > 0 || S_ == 1) && l.plain_done < it.len &&
                    l.sealed_len + kSealPiece + seal::kTagSize <= ls.buf.size())
                    return seal_more(l, ls, it);
                return pcclSuccess;
            }
            l.sealed_pos += size_t(moved);
            l.out_done += moved;
        }
        *done = true;
        return pcclSuccess;
    }

    // Appends the next piece of the frame's payload record (and, after its last byte, the
    // record's tag) to what the link's buffer holds from sealed_len on.
    pcclResult_t seal_more(LinkState &l, seal::LinkSeal &ls, const SendItem &it) {
        if (l.plain_done == it.len) {
            if (it.len > 0 && !l.sealed_tag_out) {
                if (!ls.out.finish_seal(ls.buf.data() + l.sealed_len))
                    return fail(pcclSystemError, "libcrypto failed to seal a payload");
                l.sealed_len += seal::kTagSize;
                l.sealed_tag_out = true;
            }
            return pcclSuccess;
        }
        if (l.plain_done == 0 && !ls.out.begin())
            return fail(pcclSystemError, "libcrypto failed to seal a payload");
        size_t n = size_t(std::min<uint64_t>(it.len - l.plain_done, kSealPiece));
        if (!ls.out.update(it.data + l.plain_done, ls.buf.data() + l.sealed_len, n))
            return fail(pcclSystemError, "libcrypto failed to seal a payload");
        l.sealed_len += n;
        l.plain_done += n;
        if (l.plain_done == it.len) return seal_more(l, ls, it);  // the tag fits: buf has room
        return pcclSuccess;
    }

    // ---- receiving ----------------------------------------------------------------

    // What a link is waiting for in this op.
    enum Mode {
        kPayload,  // the rest of a frame whose header it delivered
        kHeader,   // the next header: a frame of this op is still due from the peer, and
                   // this stream has not shown a later op's frame (or its end) yet
        kWatch,    // nothing of this op: an ABORT, a later op's frame, or the end
    };
    Mode mode(size_t li) const {
        const LinkState &l = links_[li];
        if (l.rx >= 0) return kPayload;
        if (!l.idle && stream_of(li) < S_ && arrivals_.unclaimed(peer_of(li)) > 0) return kHeader;
        return kWatch;
    }

    // One receive of at most `want` bytes from a link into `into`: what came is added to
    // *got and the communicator's count; *none when nothing was there yet.
    pcclResult_t recv_some(size_t li, uint8_t *into, size_t want, uint64_t *got, bool *none) {
        *none = false;
        for (;;) {
            ssize_t n = recv(fd(li), into, want, MSG_DONTWAIT);
            if (n > 0) {
                *got += uint64_t(n);
                comm_->bytes_received += uint64_t(n);
                return pcclSuccess;
            }
            if (n == 0) return lost(li, "closed the connection");
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                *none = true;
                return pcclSuccess;
            }
            return io_error(li, "recv()", errno);
        }
    }

    // Peeks the link's next header (nothing consumed; a sealed one is opened without taking
    // its record number). *whole false: not all of it is there yet; *n the bytes peeked
    // (0: the peer closed the stream).
    pcclResult_t peek_header(size_t li, wire::FrameHeader *h, ssize_t *n) {
        const size_t hs = header_size(li);
        uint8_t raw[seal::kHeaderSize], plain[wire::kFrameHeaderSize];
        for (;;) {
            *n = recv(fd(li), raw, hs, MSG_DONTWAIT | MSG_PEEK);
            if (*n >= 0 || errno != EINTR) break;
        }
        if (*n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) return pcclSuccess;
            return io_error(li, "recv()", errno);
        }
        if (size_t(*n) < hs) return pcclSuccess;
        seal::LinkSeal *ls = sealed(li);
        if (ls && !ls->in.peek(raw, wire::kFrameHeaderSize, plain)) return integrity(li, "a frame header");
        std::string why;
        if (wire::decode_frame(ls ? plain : raw, h, &why) != pcclSuccess)
            return fail(pcclProtocolError, name(li) + ": " + why);
        return pcclSuccess;
    }

    // Takes the peeked header off the socket (and, sealed, its record number).
    pcclResult_t consume_header(size_t li) {
        const size_t hs = header_size(li);
        uint8_t raw[seal::kHeaderSize], plain[wire::kFrameHeaderSize];
        uint64_t got = 0;
        bool none = false;
        pcclResult_t rc = recv_some(li, raw, hs, &got, &none);
        if (rc != pcclSuccess) return rc;
        if (got != hs)  // not reached: the header was peeked whole and nothing else reads here
            return fail(pcclSystemError, name(li) + ": a peeked frame header could not be read");
        seal::LinkSeal *ls = sealed(li);
        if (ls && !ls->in.open(raw, wire::kFrameHeaderSize, plain)) return integrity(li, "a frame header");
        return pcclSuccess;
    }

    // Reads an ABORT frame's reason (bounded by decode_frame) and reports it.
    pcclResult_t remote_abort(size_t li, const wire::FrameHeader &h) {
        pcclResult_t rc = consume_header(li);
        if (rc != pcclSuccess) return rc;
        std::string reason(size_t(h.length), '\0');
        if (h.length) {
            seal::LinkSeal *ls = sealed(li);
            std::vector<uint8_t> raw(size_t(seal::payload_size(h.length)));
            uint8_t *into = ls ? raw.data() : (uint8_t *)&reason[0];
            size_t size = ls ? raw.size() : reason.size();
            set_rcvlowat(comm_->links[li], 1);  // a reason shorter than a header wakes poll() too
            rc = net::read_exact(fd(li), into, size, deadline_, comm_->abort_fd, name(li));
            if (rc == pcclSuccess && ls && !ls->in.open(raw.data(), reason.size(), (uint8_t *)&reason[0]))
                reason = "(reason failed its integrity check)";
            else if (rc != pcclSuccess)
                reason = "(reason unreadable)";
        }
        return fail(wire::abort_code(h), name(li) + " aborted " + op_name() + ": " + reason);
    }

    // A stream of a peer with frames of this op still due delivered a header: an ABORT,
    // one of this op's frames (placed by its step, then read), or a later op's frame.
    pcclResult_t read_header(size_t li, short rev) {
        LinkState &l = links_[li];
        const int peer = peer_of(li);
        wire::FrameHeader h;
        ssize_t n = 0;
        pcclResult_t rc = peek_header(li, &h, &n);
        if (rc != pcclSuccess || n < 0) return rc;
        if (n == 0) return end_of_stream(li);
        if (size_t(n) < header_size(li)) {
            // SO_RCVLOWAT holds poll() until a whole header is there, unless the stream ended.
            if (rev & (POLLRDHUP | POLLHUP | POLLERR)) return lost(li, "closed the connection mid-frame");
            return pcclSuccess;
        }
        if (h.type == wire::kFrameAbort) return remote_abort(li, h);
        int32_t item = -1;
        pcclResult_t why_rc = pcclSuccess;
        std::string why;
        switch (arrivals_.place(peer, h, &item, &why_rc, &why)) {
            case Arrivals::kRefuse:
                return fail(why_rc, (why_rc == pcclMismatch ? "with " : "") + name(li) + ": " + why);
            case Arrivals::kLater:
                l.idle = l.has_later = true;
                l.later = h;
                return starved(peer);
            case Arrivals::kPlace:
                break;
        }
        rc = consume_header(li);
        if (rc != pcclSuccess) return rc;
        const RecvItem &it = s_.recvs[size_t(item)];
        l.rx = item;
        l.in_got = l.in_tag_got = l.in_opened = 0;
        seal::LinkSeal *ls = sealed(li);
        if (ls && it.len > 0 && !ls->in.begin())
            return fail(pcclSystemError, "libcrypto failed to open a payload");
        return read_payload(li);
    }

    // Opens (in place) what has arrived of a sealed payload while it is still in cache, in
    // whole AES blocks of at least kOpenBatch bytes until the last: OpenSSL's GCM runs at
    // two thirds of its speed on pieces that split blocks. False if libcrypto failed.
    bool open_arrived(LinkState &l, seal::LinkSeal &ls, const RecvItem &it) {
        uint64_t end = l.in_got == it.len ? it.len : l.in_got & ~uint64_t(15);
        if (end == l.in_opened || (end < it.len && end - l.in_opened < kOpenBatch)) return true;
        bool ok = ls.in.update(it.dst + l.in_opened, it.dst + l.in_opened, size_t(end - l.in_opened));
        l.in_opened = end;
        return ok;
    }

    // Nothing more there yet and `due` bytes of the frame still to come: poll() wakes at a
    // whole header's worth (SO_RCVLOWAT), or at what is left of the frame if that is less.
    pcclResult_t wait_for(size_t li, uint64_t due) {
        set_rcvlowat(comm_->links[li], int(std::min<uint64_t>(header_size(li), due)));
        return pcclSuccess;
    }

    // Reads what has arrived of the stream's frame; lands it once whole. On a sealed link
    // the payload is opened in place as it arrives, and used only once its tag verified.
    pcclResult_t read_payload(size_t li) {
        LinkState &l = links_[li];
        seal::LinkSeal *ls = sealed(li);
        const RecvItem &it = s_.recvs[size_t(l.rx)];
        bool none = false;
        while (l.in_got < it.len) {
            pcclResult_t rc = recv_some(li, it.dst + l.in_got, it.len - l.in_got, &l.in_got, &none);
            if (rc != pcclSuccess) return rc;
            if (none) return wait_for(li, it.len - l.in_got + (ls ? seal::kTagSize : 0));
            if (ls && !open_arrived(l, *ls, it))
                return fail(pcclSystemError, "libcrypto failed to open a payload");
        }
        if (ls && !open_arrived(l, *ls, it))
            return fail(pcclSystemError, "libcrypto failed to open a payload");
        if (ls && it.len > 0) {
            while (l.in_tag_got < seal::kTagSize) {
                pcclResult_t rc = recv_some(li, l.in_tag + l.in_tag_got, seal::kTagSize - l.in_tag_got,
                                            &l.in_tag_got, &none);
                if (rc != pcclSuccess) return rc;
                if (none) return wait_for(li, seal::kTagSize - l.in_tag_got);
            }
            if (!ls->in.finish_open(l.in_tag)) return integrity(li, "a frame's payload");
        }
        // Each item reduces into its own destination, so the result does not depend on
        // which stream brought which frame first.
        size_t count = size_t(it.len / es_);
        if (it.reduce_src) reduce_into(it.dst, it.reduce_src, count, s_.dtype, s_.op);
        if (it.finalize_avg) finalize_avg(it.dst, count, s_.dtype, s_.world_size);
        dealer_.landed(l.rx);
        --peers_[size_t(it.peer)].recvs_left;
        --remaining_;
        l.rx = -1;
        set_rcvlowat(comm_->links[li], int(header_size(li)));
        return pcclSuccess;
    }

    // The peer closed a stream at a frame boundary. It matters if this op still owes the
    // peer bytes, or once no stream of the peer can bring the frames still due from it; a
    // peer that finished this op and exited is not a failure of this op.
    pcclResult_t end_of_stream(size_t li) {
        const int peer = peer_of(li);
        if (owed(peer)) return lost(li, "closed the connection");
        links_[li].idle = links_[li].eof = true;
        return starved(peer);
    }

    // Fails the op if frames are still due from `peer` while every one of its streams has
    // ended or moved on to a later op: on a FIFO stream nothing of this op can follow.
    pcclResult_t starved(int peer) {
        if (arrivals_.unclaimed(peer) == 0) return pcclSuccess;
        const size_t first = size_t(peer) * stride_;
        for (size_t k = 0; k < S_; ++k)
            if (!links_[first + k].idle) return pcclSuccess;
        for (size_t k = 0; k < S_; ++k)
            if (links_[first + k].eof) return lost(first + k, "closed the connection");
        for (size_t k = 0; k < S_; ++k) {
            const LinkState &l = links_[first + k];
            if (!l.has_later) continue;
            const RecvItem &want = s_.recvs[size_t(arrivals_.first_unclaimed(peer))];
            std::string why;
            if (wire::check_expected(l.later, want.expect, &why) != pcclSuccess)
                return fail(pcclMismatch, "with " + name(first + k) + ": " + why);
            break;
        }
        return fail(pcclProtocolError, peer_name(peer) + " started its next operation without " +
                                           "sending all frames of " + op_name());
    }

    // A link with nothing of this op to receive became readable: either an ABORT (fail
    // now), the peer's data for a later op (leave it queued), or EOF.
    pcclResult_t inspect_idle(size_t li) {
        LinkState &l = links_[li];
        wire::FrameHeader h;
        ssize_t n = 0;
        pcclResult_t rc = peek_header(li, &h, &n);
        if (rc != pcclSuccess) return rc;
        if (n < 0) return pcclSuccess;  // nothing there after all
        if (n == 0) {
            if (owed(peer_of(li))) return lost(li, "closed the connection");
            l.idle = l.eof = true;
            return pcclSuccess;
        }
        if (size_t(n) == header_size(li) && h.type == wire::kFrameAbort) return remote_abort(li, h);
        l.idle = true;
        return pcclSuccess;
    }

    std::string waiting_for() const {
        std::string out;
        for (int p = 0; p < comm_->world_size; ++p) {
            if (size_t n = arrivals_.unclaimed(p)) {
                out += "; frame " + std::to_string(s_.recvs[size_t(arrivals_.first_unclaimed(p))].expect.step) +
                       " from " + peer_name(p);
                if (n > 1) out += " (and " + std::to_string(n - 1) + " more)";
            }
            bool full = false;
            for (size_t k = 0; k < S_ && owed(p); ++k) full = full || links_[size_t(p) * stride_ + k].want_out;
            if (full) out += "; " + peer_name(p) + " not reading what we send";
        }
        for (size_t li = 0; li < links_.size(); ++li)
            if (links_[li].rx >= 0)
                out += "; the rest of frame " + std::to_string(s_.recvs[size_t(links_[li].rx)].expect.step) +
                       " from " + name(li);
        return out.empty() ? " the op's frames" : out.substr(1);
    }

    pcclResult_t loop() {
        std::vector<pollfd> pfds;
        std::vector<size_t> who;
        while (remaining_ > 0) {
            if (comm_->aborted.load()) return abort_error(comm_);
            for (int p = 0; p < comm_->world_size; ++p) {
                if (peers_[size_t(p)].sends_left == 0) continue;
                pcclResult_t rc = deal(p);
                if (rc != pcclSuccess) return rc;
            }
            if (remaining_ == 0) break;
            pfds.clear();
            who.clear();
            pfds.push_back({comm_->abort_fd, POLLIN, 0});
            who.push_back(0);
            for (size_t li = 0; li < links_.size(); ++li) {
                const int p = peer_of(li);
                if (p == comm_->rank) continue;
                LinkState &l = links_[li];
                short ev = 0;
                const Mode m = mode(li);
                if (m == kPayload) ev |= POLLIN;
                if (m == kHeader) ev |= POLLIN | POLLRDHUP;
                if (m == kWatch && l.watch && !l.idle) ev |= POLLIN;
                // Wake for a whole header, not for each piece of one (read_payload lowers it
                // for a frame's last bytes).
                if (m != kPayload && ev) set_rcvlowat(comm_->links[li], int(header_size(li)));
                if (l.want_out && (l.tx >= 0 || dealer_.ready(p))) ev |= POLLOUT;
                // Streams this op still sends over are polled for a hang-up even while
                // their frames wait for a dependency.
                if (ev == 0 && !(owed(p) && stream_of(li) < S_)) continue;
                pfds.push_back({fd(li), ev, 0});
                who.push_back(li);
            }
            int64_t left = deadline_ - net::now_ms();
            if (left <= 0)
                // torch's wording ("Timed out waiting <T>ms for ..."), which its tests and
                // users' log filters match.
                return fail(pcclTimeout, "Timed out waiting " + std::to_string(comm_->op_timeout_ms) +
                                             "ms for " + op_name() + " (waiting for " + waiting_for() + ")");
            // The rate probe wakes the loop once per window of a long op (pacing.hpp).
            const int64_t due = probe_ ? probe_->next_ms() : INT64_MAX;
            int64_t wait = std::min<int64_t>(left, 1000000);
            if (due != INT64_MAX) wait = std::max<int64_t>(0, std::min(wait, due - net::now_ms()));
            int n = poll(pfds.data(), pfds.size(), int(wait));
            if (due <= net::now_ms()) {
                std::vector<char> busy(size_t(comm_->world_size), 0);
                for (int p = 0; p < comm_->world_size; ++p) busy[size_t(p)] = owed(p);
                probe_->sample(busy);
            }
            if (n < 0) {
                if (errno == EINTR) continue;
                return fail(pcclSystemError, syscall_error("poll()", errno, "in the engine"));
            }
            if (n == 0) continue;  // the deadline is re-checked at the top
            if (pfds[0].revents & POLLIN) return abort_error(comm_);
            for (size_t i = 1; i < pfds.size(); ++i) {
                const short rev = pfds[i].revents;
                if (!rev) continue;
                pcclResult_t rc = handle(who[i], rev);
                if (rc != pcclSuccess) return rc;
            }
        }
        return pcclSuccess;
    }

    // What poll() reported on a link; its mode is taken now, as reading another link may
    // have changed it.
    pcclResult_t handle(size_t li, short rev) {
        LinkState &l = links_[li];
        if (rev & (POLLOUT | POLLERR | POLLHUP)) l.want_out = false;
        switch (mode(li)) {
            case kPayload:
                return (rev & (POLLIN | POLLERR | POLLHUP)) ? read_payload(li) : pcclSuccess;
            case kHeader:
                return (rev & (POLLIN | POLLERR | POLLHUP | POLLRDHUP)) ? read_header(li, rev) : pcclSuccess;
            case kWatch:
                break;
        }
        if ((rev & POLLIN) && l.watch && !l.idle) {
            pcclResult_t rc = inspect_idle(li);
            if (rc != pcclSuccess) return rc;
        }
        if (rev & (POLLERR | POLLHUP)) {
            // Reported on every poll from now on: decide here rather than spin.
            if (owed(peer_of(li))) return lost(li, "hung up");
            l.idle = true;
        }
        return pcclSuccess;
    }

    pcclComm *comm_;
    const Schedule &s_;
    int64_t deadline_;
    size_t S_;                       // streams per peer this op deals over (comm->stripe)
    size_t stride_;                  // streams per peer connected (comm->streams)
    std::vector<LinkState> links_;   // one per connection: peer * stride_ + stream
    std::vector<PeerState> peers_;
    Dealer dealer_;
    Arrivals arrivals_;
    size_t remaining_;
    size_t es_ = 1;
    std::optional<RateProbe> probe_;
};

}  // namespace

pcclResult_t run_schedule(pcclComm *comm, const Schedule &s, int64_t deadline_ms) {
    return Engine(comm, s, deadline_ms).run();
}

}  // namespace pccl
