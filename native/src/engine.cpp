#include "engine.hpp"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <climits>
#include <optional>
#include <string>
#include <vector>

#include "error.hpp"
#include "pacing.hpp"
#include "reduce.hpp"
#include "seal.hpp"
#include "socket.hpp"
#include "dtype.hpp"

namespace pccl {

namespace {

// How much of a payload a sealed link seals before sending it: large enough that a send
// moves a lot per syscall, small enough that the sealed bytes are still in cache.
constexpr uint64_t kSealPiece = 256u << 10;
constexpr uint64_t kOpenBatch = 16u << 10;  // see Engine::open_arrived

struct LinkState {
    std::vector<int32_t> sendq, recvq;
    size_t si = 0, ri = 0;
    // The outgoing frame in progress: header then payload.
    bool out_started = false;
    uint8_t out_hdr[wire::kFrameHeaderSize];
    uint64_t out_done = 0;
    // A sealed link's outgoing frame (seal.hpp): its records are sealed into the link's
    // buffer piece by piece; sealed_pos .. sealed_len of it is still to send, and
    // plain_done payload bytes have been sealed. out_seq0: the first record's number, put
    // back if the op fails before a byte of the frame left.
    uint64_t plain_done = 0;
    size_t sealed_pos = 0, sealed_len = 0;
    uint64_t out_seq0 = 0;
    bool sealed_tag_out = false;  // the payload record's tag is in the buffer
    bool want_out = false;  // the last send hit EAGAIN: wait for POLLOUT
    // The incoming frame in progress (a sealed header is longer: seal::kHeaderSize).
    uint8_t in_hdr[seal::kHeaderSize];
    size_t in_hdr_got = 0;
    bool in_hdr_ok = false;
    uint64_t in_got = 0;
    uint8_t in_tag[seal::kTagSize];  // a sealed payload's tag, read after the payload
    uint64_t in_tag_got = 0;
    uint64_t in_opened = 0;  // payload bytes of a sealed frame opened (in place) so far
    // Links with nothing to receive in this op are still read for ABORT frames.
    bool watch = false;
    bool idle = false;  // data for a later op is queued there, or the peer left cleanly

    bool pending() const { return si < sendq.size() || ri < recvq.size(); }
};

class Engine {
public:
    Engine(pcclComm *comm, const Schedule &s, int64_t deadline)
        : comm_(comm), s_(s), deadline_(deadline), S_(size_t(comm->stripe)),
          stride_(size_t(comm->streams)),
          links_(comm->links.size()), done_(s.recvs.size(), 0),
          remaining_(s.sends.size() + s.recvs.size()) {
        // Striping: the n-th frame ever sent to a peer goes on stream n % S, and the
        // n-th frame ever received from it is read from stream n % S. Both ends count
        // the same frames in the same order (that is what `step` checks), so every
        // stream stays an ordered FIFO and one op spreads over S connections: the
        // first `stripe` of the peer's `streams`, which every rank changes between the
        // same two ops (pcclCommSetStripe), when both ends' counts are equal.
        for (size_t i = 0; i < s.sends.size(); ++i) {
            size_t peer = size_t(s.sends[i].peer);
            links_[peer * stride_ + comm->items_sent[peer]++ % S_].sendq.push_back(int32_t(i));
        }
        for (size_t i = 0; i < s.recvs.size(); ++i) {
            size_t peer = size_t(s.recvs[i].peer);
            links_[peer * stride_ + comm->items_received[peer]++ % S_].recvq.push_back(int32_t(i));
        }
        for (size_t li = 0; li < links_.size(); ++li) {
            int p = int(li / stride_);
            links_[li].watch = p != comm->rank && (s.watch_all || peer_pending(p));
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
            for (size_t p = 0; p < links_.size(); ++p) {
                const LinkState &l = links_[p];
                mid[p] = l.out_started && l.out_done > 0;
                // A frame sealed but not sent: its record numbers are free again, so the
                // ABORT that fail_comm seals next is the record the peer expects.
                seal::LinkSeal *ls = comm_->links[p].seal.get();
                if (ls && l.out_started && l.out_done == 0) ls->out.rewind(l.out_seq0);
            }
            fail_comm(comm_, rc, &mid);
        }
        return rc;
    }

private:
    // Links are indexed peer * stride_ + stream; `li` below is such an index.
    const std::string &name(int li) const { return comm_->links[size_t(li)].name; }
    int fd(int li) const { return comm_->links[size_t(li)].fd; }
    // Whether this op still owes `peer` bytes or waits for bytes from it, on any stream.
    bool peer_pending(int peer) const {
        for (size_t k = 0; k < S_; ++k)
            if (links_[size_t(peer) * stride_ + k].pending()) return true;
        return false;
    }
    // Whether this op still owes `peer` bytes, on any stream.
    bool peer_owed(int peer) const {
        for (size_t k = 0; k < S_; ++k) {
            const LinkState &l = links_[size_t(peer) * stride_ + k];
            if (l.si < l.sendq.size()) return true;
        }
        return false;
    }

    pcclResult_t lost(int peer, const char *what) {
        return fail(pcclPeerLost, name(peer) + " " + what + " during " +
                                      wire::coll_name(first_coll()) + " #" + std::to_string(seq()));
    }
    uint8_t first_coll() const {
        return s_.sends.empty() ? (s_.recvs.empty() ? 0 : s_.recvs[0].expect.coll) : s_.sends[0].hdr.coll;
    }
    uint64_t seq() const {
        return s_.sends.empty() ? (s_.recvs.empty() ? 0 : s_.recvs[0].expect.seq) : s_.sends[0].hdr.seq;
    }

    pcclResult_t io_error(int peer, const char *syscall, int err) {
        // ETIMEDOUT: nothing acknowledged for the link timeout (net::set_link_timeout).
        pcclResult_t rc = (err == ECONNRESET || err == EPIPE || err == ENOTCONN || err == ETIMEDOUT)
                              ? pcclPeerLost
                              : pcclSystemError;
        return fail(rc, syscall_error(syscall, err, name(peer)) + " during " +
                            wire::coll_name(first_coll()) + " #" + std::to_string(seq()));
    }

    seal::LinkSeal *sealed(int li) const { return comm_->links[size_t(li)].seal.get(); }
    size_t header_size(int li) const {
        return sealed(li) ? seal::kHeaderSize : wire::kFrameHeaderSize;
    }

    pcclResult_t integrity(int peer, const char *what) {
        return fail(pcclIntegrityError,
                    name(peer) + ": " + what + " failed its integrity check during " +
                        wire::coll_name(first_coll()) + " #" + std::to_string(seq()) +
                        " (altered, dropped, replayed or reordered on the way); nothing of it "
                        "was used");
    }

    // One send of what `iov` holds on a link: what left is added to *moved and the
    // communicator's count; a full socket sets the link's want_out (wait for POLLOUT).
    pcclResult_t send_some(int peer, const iovec *iov, int cnt, uint64_t *moved) {
        msghdr msg{};
        msg.msg_iov = const_cast<iovec *>(iov);
        msg.msg_iovlen = size_t(cnt);
        for (;;) {
            ssize_t n = sendmsg(fd(peer), &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
            if (n > 0) {
                *moved += uint64_t(n);
                comm_->bytes_sent += uint64_t(n);
                return pcclSuccess;
            }
            if (n < 0 && errno == EINTR) continue;
            if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
                links_[size_t(peer)].want_out = true;
                return pcclSuccess;
            }
            return io_error(peer, "send()", n < 0 ? errno : EPIPE);
        }
    }

    // One receive of at most `want` bytes from a link into `into`: what came is added to
    // *got and the communicator's count; *none when nothing was there yet.
    pcclResult_t recv_some(int peer, uint8_t *into, size_t want, uint64_t *got, bool *none) {
        *none = false;
        for (;;) {
            ssize_t n = recv(fd(peer), into, want, MSG_DONTWAIT);
            if (n > 0) {
                *got += uint64_t(n);
                comm_->bytes_received += uint64_t(n);
                return pcclSuccess;
            }
            if (n == 0) return lost(peer, "closed the connection");
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                *none = true;
                return pcclSuccess;
            }
            return io_error(peer, "recv()", errno);
        }
    }

    // Sends what it can of a sealed link's frames: each frame's header record and payload
    // record are sealed into the link's buffer a piece at a time and sent from there.
    pcclResult_t pump_send_sealed(int peer) {
        LinkState &l = links_[size_t(peer)];
        seal::LinkSeal &ls = *sealed(peer);
        while (l.si < l.sendq.size()) {
            const SendItem &it = s_.sends[size_t(l.sendq[l.si])];
            if (it.dep >= 0 && !done_[size_t(it.dep)]) return pcclSuccess;
            if (!l.out_started) {
                l.out_started = true;
                l.out_done = 0;
                l.out_seq0 = ls.out.next();
                l.plain_done = 0;
                l.sealed_pos = 0;
                l.sealed_tag_out = false;
                wire::encode_frame(it.hdr, l.out_hdr);
                // Room for two pieces: one being sent, one sealed while the socket is full.
                size_t want = seal::kHeaderSize + 2 * size_t(std::min<uint64_t>(it.len, kSealPiece)) +
                              seal::kTagSize;
                if (ls.buf.size() < want) ls.buf.resize(std::max(want, ls.buf.size()));
                if (!ls.out.seal(l.out_hdr, wire::kFrameHeaderSize, ls.buf.data()))
                    return fail(pcclSystemError, "libcrypto failed to seal a frame header");
                l.sealed_len = seal::kHeaderSize;
                pcclResult_t rc = seal_more(l, ls, it);
                if (rc != pcclSuccess) return rc;
            }
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
                pcclResult_t rc = send_some(peer, &iov, 1, &moved);
                if (rc != pcclSuccess) return rc;
                if (l.want_out) {
                    // Seal ahead while the peer drains the socket: time otherwise spent in poll.
                    if (l.plain_done < it.len &&
                        l.sealed_len + kSealPiece + seal::kTagSize <= ls.buf.size())
                        return seal_more(l, ls, it);
                    return pcclSuccess;
                }
                l.sealed_pos += size_t(moved);
                l.out_done += moved;
            }
            l.out_started = false;
            ++l.si;
            --remaining_;
        }
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

    pcclResult_t pump_send(int peer) {
        if (sealed(peer)) return pump_send_sealed(peer);
        LinkState &l = links_[size_t(peer)];
        while (l.si < l.sendq.size()) {
            const SendItem &it = s_.sends[size_t(l.sendq[l.si])];
            if (it.dep >= 0 && !done_[size_t(it.dep)]) return pcclSuccess;
            if (!l.out_started) {
                wire::encode_frame(it.hdr, l.out_hdr);
                l.out_started = true;
                l.out_done = 0;
            }
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
                pcclResult_t rc = send_some(peer, iov, cnt, &moved);
                if (rc != pcclSuccess || l.want_out) return rc;
                l.out_done += moved;
            }
            l.out_started = false;
            ++l.si;
            --remaining_;
        }
        return pcclSuccess;
    }

    // Reads an ABORT frame's reason (bounded by decode_frame) and reports it.
    pcclResult_t remote_abort(int peer, const wire::FrameHeader &h) {
        std::string reason(size_t(h.length), '\0');
        if (h.length) {
            seal::LinkSeal *ls = sealed(peer);
            std::vector<uint8_t> raw(size_t(seal::payload_size(h.length)));
            uint8_t *into = ls ? raw.data() : (uint8_t *)&reason[0];
            size_t size = ls ? raw.size() : reason.size();
            pcclResult_t rc = net::read_exact(fd(peer), into, size, deadline_, comm_->abort_fd,
                                              name(peer));
            if (rc == pcclSuccess && ls && !ls->in.open(raw.data(), reason.size(), (uint8_t *)&reason[0]))
                reason = "(reason failed its integrity check)";
            else if (rc != pcclSuccess)
                reason = "(reason unreadable)";
        }
        return fail(wire::abort_code(h), name(peer) + " aborted " + wire::coll_name(first_coll()) +
                                             " #" + std::to_string(seq()) + ": " + reason);
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

    // Reads whatever has arrived on a link; returns after each completed frame
    // so that sends waiting on it are pumped promptly. On a sealed link the payload is
    // opened in place as it arrives, and used only once its tag has verified.
    pcclResult_t pump_recv(int peer) {
        LinkState &l = links_[size_t(peer)];
        seal::LinkSeal *ls = sealed(peer);
        const size_t hs = header_size(peer);
        while (l.ri < l.recvq.size()) {
            int32_t idx = l.recvq[l.ri];
            const RecvItem &it = s_.recvs[size_t(idx)];
            bool none = false;
            if (!l.in_hdr_ok) {
                uint64_t got = 0;
                pcclResult_t rc = recv_some(peer, l.in_hdr + l.in_hdr_got, hs - l.in_hdr_got, &got, &none);
                if (rc != pcclSuccess || none) return rc;
                l.in_hdr_got += size_t(got);
                if (l.in_hdr_got < hs) continue;
                uint8_t plain[wire::kFrameHeaderSize];
                if (ls && !ls->in.open(l.in_hdr, wire::kFrameHeaderSize, plain))
                    return integrity(peer, "a frame header");
                wire::FrameHeader h;
                std::string why;
                if (wire::decode_frame(ls ? plain : l.in_hdr, &h, &why) != pcclSuccess)
                    return fail(pcclProtocolError, name(peer) + ": " + why);
                if (h.type == wire::kFrameAbort) return remote_abort(peer, h);
                wire::FrameHeader want = it.expect;
                if (wire::check_expected(h, want, &why) != pcclSuccess)
                    return fail(pcclMismatch, "with " + name(peer) + ": " + why);
                if (ls && it.len > 0 && !ls->in.begin())
                    return fail(pcclSystemError, "libcrypto failed to open a payload");
                l.in_hdr_ok = true;
                l.in_got = 0;
                l.in_tag_got = 0;
                l.in_opened = 0;
            }
            while (l.in_got < it.len) {
                pcclResult_t rc = recv_some(peer, it.dst + l.in_got, it.len - l.in_got, &l.in_got, &none);
                if (rc != pcclSuccess || none) return rc;
                if (ls && !open_arrived(l, *ls, it))
                    return fail(pcclSystemError, "libcrypto failed to open a payload");
            }
            if (ls && !open_arrived(l, *ls, it))
                return fail(pcclSystemError, "libcrypto failed to open a payload");
            if (ls && it.len > 0) {
                while (l.in_tag_got < seal::kTagSize) {
                    pcclResult_t rc = recv_some(peer, l.in_tag + l.in_tag_got,
                                                seal::kTagSize - l.in_tag_got, &l.in_tag_got, &none);
                    if (rc != pcclSuccess || none) return rc;
                }
                if (!ls->in.finish_open(l.in_tag)) return integrity(peer, "a frame's payload");
            }
            size_t count = size_t(it.len / es_);
            if (it.reduce_src) reduce_into(it.dst, it.reduce_src, count, s_.dtype, s_.op);
            if (it.finalize_avg) finalize_avg(it.dst, count, s_.dtype, s_.world_size);
            done_[size_t(idx)] = 1;
            ++l.ri;
            --remaining_;
            l.in_hdr_ok = false;
            l.in_hdr_got = 0;
            return pcclSuccess;
        }
        return pcclSuccess;
    }

    // A link with nothing left to receive in this op became readable: either an
    // ABORT (fail now), the peer's data for a later op (leave it queued), or EOF.
    pcclResult_t inspect_idle(int peer) {
        LinkState &l = links_[size_t(peer)];
        seal::LinkSeal *ls = sealed(peer);
        const size_t hs = header_size(peer);
        uint8_t hdr[seal::kHeaderSize];
        ssize_t n = recv(fd(peer), hdr, hs, MSG_DONTWAIT | MSG_PEEK);
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return pcclSuccess;
        if (n <= 0) {
            // The peer hung up. It matters only if we still owe it bytes, on any of
            // its streams (a stream lost alone is the peer lost); a peer that
            // finished this op and exited is not a failure of this op. Bytes still
            // due from it are in flight on other streams, which report their own EOF.
            if (peer_owed(int(size_t(peer) / stride_))) return lost(peer, "closed the connection");
            l.idle = true;
            return pcclSuccess;
        }
        if (size_t(n) == hs) {
            // A sealed header is opened without taking its record number: a data frame
            // stays queued for a later op, which opens it again.
            uint8_t plain[wire::kFrameHeaderSize];
            if (ls && !ls->in.peek(hdr, wire::kFrameHeaderSize, plain))
                return integrity(peer, "a frame header");
            wire::FrameHeader h;
            std::string why;
            if (wire::decode_frame(ls ? plain : hdr, &h, &why) != pcclSuccess)
                return fail(pcclProtocolError, name(peer) + ": " + why);
            if (h.type == wire::kFrameAbort) {
                recv(fd(peer), hdr, hs, MSG_DONTWAIT);  // consume the peeked header
                if (ls) ls->in.open(hdr, wire::kFrameHeaderSize, plain);  // ... and its number
                comm_->bytes_received += hs;
                return remote_abort(peer, h);
            }
        }
        l.idle = true;
        return pcclSuccess;
    }

    std::string waiting_for() const {
        std::string out;
        for (size_t p = 0; p < links_.size(); ++p) {
            const LinkState &l = links_[p];
            if (l.ri < l.recvq.size())
                out += "; frame " + std::to_string(s_.recvs[size_t(l.recvq[l.ri])].expect.step) +
                       " from " + name(int(p));
            if (l.si < l.sendq.size() && l.want_out)
                out += "; " + name(int(p)) + " not reading what we send";
        }
        return out;
    }

    pcclResult_t loop() {
        std::vector<pollfd> pfds;
        std::vector<int> who;
        while (remaining_ > 0) {
            if (comm_->aborted.load()) return abort_error(comm_);
            for (size_t p = 0; p < links_.size(); ++p) {
                LinkState &l = links_[p];
                if (l.si < l.sendq.size() && !l.want_out) {
                    pcclResult_t rc = pump_send(int(p));
                    if (rc != pcclSuccess) return rc;
                }
            }
            if (remaining_ == 0) break;
            pfds.clear();
            who.clear();
            pfds.push_back({comm_->abort_fd, POLLIN, 0});
            who.push_back(-1);
            for (size_t p = 0; p < links_.size(); ++p) {
                LinkState &l = links_[p];
                short ev = 0;
                if (l.ri < l.recvq.size() || (l.watch && !l.idle)) ev |= POLLIN;
                if (l.want_out) ev |= POLLOUT;
                if (ev == 0 && !l.pending()) continue;
                pfds.push_back({fd(int(p)), ev, 0});
                who.push_back(int(p));
            }
            int64_t left = deadline_ - net::now_ms();
            if (left <= 0)
                // torch's wording ("Timed out waiting <T>ms for ..."), which its tests and
                // users' log filters match.
                return fail(pcclTimeout, "Timed out waiting " + std::to_string(comm_->op_timeout_ms) +
                                             "ms for " + wire::coll_name(first_coll()) + " #" +
                                             std::to_string(seq()) + " (waiting for" +
                                             waiting_for().substr(1) + ")");
            // The rate probe wakes the loop once per window of a long op (pacing.hpp).
            const int64_t due = probe_ ? probe_->next_ms() : INT64_MAX;
            int64_t wait = std::min<int64_t>(left, 1000000);
            if (due != INT64_MAX) wait = std::max<int64_t>(0, std::min(wait, due - net::now_ms()));
            int n = poll(pfds.data(), pfds.size(), int(wait));
            if (due <= net::now_ms()) {
                std::vector<char> busy(size_t(comm_->world_size), 0);
                for (int p = 0; p < comm_->world_size; ++p) busy[size_t(p)] = peer_owed(p);
                probe_->sample(busy);
            }
            if (n < 0) {
                if (errno == EINTR) continue;
                return fail(pcclSystemError, syscall_error("poll()", errno, "in the engine"));
            }
            if (n == 0) continue;  // the deadline is re-checked at the top
            if (pfds[0].revents & POLLIN) return abort_error(comm_);
            for (size_t i = 1; i < pfds.size(); ++i) {
                short rev = pfds[i].revents;
                if (!rev) continue;
                int p = who[i];
                LinkState &l = links_[size_t(p)];
                if (rev & (POLLOUT | POLLERR | POLLHUP)) l.want_out = false;
                if (l.ri < l.recvq.size()) {
                    if (rev & (POLLIN | POLLERR | POLLHUP)) {
                        pcclResult_t rc = pump_recv(p);
                        if (rc != pcclSuccess) return rc;
                    }
                    continue;
                }
                if (rev & POLLIN) {
                    pcclResult_t rc = inspect_idle(p);
                    if (rc != pcclSuccess) return rc;
                }
                if (rev & (POLLERR | POLLHUP)) {
                    // Reported on every poll from now on: decide here rather than spin.
                    if (peer_owed(int(size_t(p) / stride_))) return lost(p, "hung up");
                    l.idle = true;
                }
            }
        }
        return pcclSuccess;
    }

    pcclComm *comm_;
    const Schedule &s_;
    int64_t deadline_;
    size_t S_;                       // streams per peer this op stripes over (comm->stripe)
    size_t stride_;                  // streams per peer connected (comm->streams)
    std::vector<LinkState> links_;   // one per connection: peer * stride_ + stream
    std::vector<char> done_;
    size_t remaining_;
    size_t es_ = 1;
    std::optional<RateProbe> probe_;
};

}  // namespace

pcclResult_t run_schedule(pcclComm *comm, const Schedule &s, int64_t deadline_ms) {
    return Engine(comm, s, deadline_ms).run();
}

}  // namespace pccl
