#include "engine.hpp"

#include <errno.h>
#include <poll.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "deal.hpp"
#include "dtype.hpp"
#include "error.hpp"
#include "link.hpp"
#include "pacing.hpp"
#include "reduce.hpp"
#include "socket.hpp"

namespace pccl {

namespace {

// One connection's part in the op. Frames are dealt to a peer's streams as they have room
// (deal.hpp): a stream carries one outgoing and one incoming frame at a time; how their
// bytes move (plain or sealed) is its FrameLink's business (link.hpp).
struct LinkState {
    int32_t tx = -1;        // the outgoing frame this stream took (a send item; -1: none)
    bool want_out = false;  // the socket took no more: wait for POLLOUT
    int32_t rx = -1;        // the incoming frame whose header it delivered (a receive item)
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
          stride_(size_t(comm->streams)), send_S_(size_t(comm->world_size), S_),
          links_(comm->links.size()),
          peers_(size_t(comm->world_size)), dealer_(s, comm->world_size),
          arrivals_(s, comm->world_size, comm->coll_seq),
          remaining_(s.sends.size() + s.recvs.size()) {
        // Striping: any of the first send_S_[peer] streams to a peer (comm's stripe, or what
        // the path's rate controller picked) takes the peer's next ready frame when it has
        // room, and the receiver, reading every connected stream, places every frame by
        // the op and step its header names (deal.hpp).
        for (const SendItem &it : s.sends) ++peers_[size_t(it.peer)].sends_left;
        for (const RecvItem &it : s.recvs) ++peers_[size_t(it.peer)].recvs_left;
        io_.reserve(links_.size());
        for (size_t li = 0; li < links_.size(); ++li) {
            int p = peer_of(li);
            links_[li].watch = p != comm->rank && (s.watch_all || pending(p));
            io_.push_back(open_link(comm, comm->links[li]));
        }
        es_ = type_size(s.dtype);
        if (stride_ > 1) {  // only striped streams are paced (pacing.hpp)
            std::vector<char> sends_to(size_t(comm->world_size), 0);
            for (const SendItem &it : s.sends) sends_to[size_t(it.peer)] = 1;
            probe_.emplace(comm, sends_to);
            // The stripe is the sender's: the path's controller picks it for this op, and
            // the receiver reads every connected stream (rate.hpp).
            for (int p = 0; p < comm->world_size; ++p)
                send_S_[size_t(p)] = std::max<size_t>(1, std::min(stride_, size_t(probe_->stripe(p))));
        }
    }

    pcclResult_t run() {
        pcclResult_t rc = loop();
        if (rc == pcclSuccess && probe_) probe_->finish();
        if (rc != pcclSuccess) {
            std::vector<char> mid(links_.size(), 0);
            for (size_t li = 0; li < links_.size(); ++li) {
                if (links_[li].tx < 0) continue;
                mid[li] = io_[li]->sent() > 0;
                // A frame none of which left is given back (a sealed link's record numbers
                // are free again, so the ABORT that fail_comm seals next is the one the
                // peer expects).
                if (!mid[li]) io_[li]->give_back();
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

    std::string op_name() const {
        uint8_t coll = s_.sends.empty() ? (s_.recvs.empty() ? 0 : s_.recvs[0].expect.coll) : s_.sends[0].hdr.coll;
        uint64_t seq = s_.sends.empty() ? (s_.recvs.empty() ? 0 : s_.recvs[0].expect.seq) : s_.sends[0].hdr.seq;
        return std::string(wire::coll_name(coll)) + " #" + std::to_string(seq);
    }

    pcclResult_t lost(size_t li, const char *what) {
        return fail(pcclPeerLost, name(li) + " " + what + " during " + op_name());
    }

    // A link's failure in words: which link, which syscall or check, during which op.
    pcclResult_t report(size_t li, const LinkError &e) {
        switch (e.kind) {
            case LinkError::kNone:
                return pcclSuccess;
            case LinkError::kClosed:
                return lost(li, "closed the connection");
            case LinkError::kSyscall: {
                // ETIMEDOUT: nothing acknowledged for the link timeout (net::set_link_timeout).
                bool gone = e.err == ECONNRESET || e.err == EPIPE || e.err == ENOTCONN || e.err == ETIMEDOUT;
                return fail(gone ? pcclPeerLost : pcclSystemError,
                            syscall_error(e.what, e.err, name(li)) + " during " + op_name());
            }
            case LinkError::kProtocol:
                return fail(pcclProtocolError, name(li) + ": " + e.why);
            case LinkError::kIntegrity:
                return fail(pcclIntegrityError,
                            name(li) + ": " + e.what + " failed its integrity check during " + op_name() +
                                " (altered, dropped, replayed or reordered on the way); nothing of it "
                                "was used");
            case LinkError::kCrypto:
                return fail(pcclSystemError, std::string("libcrypto failed to ") + e.what);
        }
        return pcclSystemError;
    }

    // ---- sending ------------------------------------------------------------------

    // Deals `peer`'s ready frames to its streams: a stream that is not in the middle of a
    // frame and whose socket takes more (TCP_NOTSENT_LOWAT: little unsent data there,
    // deal.hpp) takes the earliest ready frame; streams with room take turns, so with
    // room everywhere the frames go round-robin. A stream that stalls takes no more.
    pcclResult_t deal(int peer) {
        PeerState &ps = peers_[size_t(peer)];
        const size_t S = send_S_[size_t(peer)];
        for (;;) {
            bool finished = false;
            const size_t start = ps.next_stream % S;
            for (size_t j = 0; j < S; ++j) {
                const size_t k = (start + j) % S, li = size_t(peer) * stride_ + k;
                LinkState &l = links_[li];
                FrameLink &io = *io_[li];
                if (l.want_out) continue;
                if (l.tx < 0) {
                    if ((l.tx = dealer_.take(peer)) < 0) continue;
                    ps.next_stream = (k + 1) % S;
                    const SendItem &it = s_.sends[size_t(l.tx)];
                    if (LinkError e = io.begin_send(it.hdr, it.data, S > 1)) return report(li, e);
                }
                bool done = false;
                if (LinkError e = io.send_some(&done)) return report(li, e);
                if (done) {
                    l.tx = -1;
                    --ps.sends_left;
                    --remaining_;
                    finished = true;
                    continue;
                }
                l.want_out = true;
                if (io.sent() == 0 && S > 1) {
                    // The socket had no room for a byte of it: another stream may take it.
                    io.give_back();
                    dealer_.give_back(l.tx);
                    l.tx = -1;
                }
            }
            if (!finished) return pcclSuccess;
        }
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
        if (!l.idle && arrivals_.unclaimed(peer_of(li)) > 0) return kHeader;
        return kWatch;
    }

    // Reads an ABORT frame (its header peeked) and reports it.
    pcclResult_t remote_abort(size_t li, const wire::FrameHeader &h) {
        if (LinkError e = io_[li]->take_header(nullptr, 0)) return report(li, e);
        set_rcvlowat(comm_->links[li], 1);  // a reason shorter than a header wakes poll() too
        std::string reason = io_[li]->abort_reason(h.length, deadline_, comm_->abort_fd, name(li));
        return fail(wire::abort_code(h), name(li) + " aborted " + op_name() + ": " + reason);
    }

    // A stream of a peer with frames of this op still due delivered a header: an ABORT,
    // one of this op's frames (placed by its step, then read), or a later op's frame.
    pcclResult_t read_header(size_t li, short rev) {
        LinkState &l = links_[li];
        const int peer = peer_of(li);
        wire::FrameHeader h;
        FrameLink::Peeked state;
        if (LinkError e = io_[li]->peek_header(&h, &state)) return report(li, e);
        switch (state) {
            case FrameLink::Peeked::kNone:
                return pcclSuccess;
            case FrameLink::Peeked::kClosed:
                return end_of_stream(li);
            case FrameLink::Peeked::kPartial:
                // SO_RCVLOWAT holds poll() until a whole header is there, unless the stream ended.
                if (rev & (POLLRDHUP | POLLHUP | POLLERR)) return lost(li, "closed the connection mid-frame");
                return pcclSuccess;
            case FrameLink::Peeked::kHeader:
                break;
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
        const RecvItem &it = s_.recvs[size_t(item)];
        if (LinkError e = io_[li]->take_header(it.dst, it.len)) return report(li, e);
        l.rx = item;
        return read_payload(li);
    }

    // Reads what has arrived of the stream's frame; lands it once whole (a sealed one once
    // its tag verified).
    pcclResult_t read_payload(size_t li) {
        LinkState &l = links_[li];
        bool done = false;
        uint64_t due = 0;
        if (LinkError e = io_[li]->recv_some(&done, &due)) return report(li, e);
        if (!done) {
            // Nothing more there yet: poll() wakes at a whole header's worth (SO_RCVLOWAT),
            // or at what is left of the frame if that is less.
            set_rcvlowat(comm_->links[li], int(std::min<uint64_t>(io_[li]->header_size(), due)));
            return pcclSuccess;
        }
        // Each item reduces into its own destination, so the result does not depend on
        // which stream brought which frame first.
        const RecvItem &it = s_.recvs[size_t(l.rx)];
        size_t count = size_t(it.len / es_);
        if (it.reduce_src) reduce_into(it.dst, it.reduce_src, count, s_.dtype, s_.op);
        if (it.finalize_avg) finalize_avg(it.dst, count, s_.dtype, s_.world_size);
        dealer_.landed(l.rx);
        --peers_[size_t(it.peer)].recvs_left;
        --remaining_;
        l.rx = -1;
        set_rcvlowat(comm_->links[li], int(io_[li]->header_size()));
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
        // Every connected stream: the sender picks how many it deals over (rate.hpp).
        const size_t first = size_t(peer) * stride_;
        for (size_t k = 0; k < stride_; ++k)
            if (!links_[first + k].idle) return pcclSuccess;
        for (size_t k = 0; k < stride_; ++k)
            if (links_[first + k].eof) return lost(first + k, "closed the connection");
        for (size_t k = 0; k < stride_; ++k) {
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
        FrameLink::Peeked state;
        LinkError e = io_[li]->peek_header(&h, &state);
        if (e.kind == LinkError::kSyscall) state = FrameLink::Peeked::kClosed;  // as a hang-up
        else if (e) return report(li, e);
        switch (state) {
            case FrameLink::Peeked::kNone:
                return pcclSuccess;
            case FrameLink::Peeked::kClosed:
                if (owed(peer_of(li))) return lost(li, "closed the connection");
                l.idle = l.eof = true;
                return pcclSuccess;
            case FrameLink::Peeked::kPartial:
                break;
            case FrameLink::Peeked::kHeader:
                if (h.type == wire::kFrameAbort) return remote_abort(li, h);
                break;
        }
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
            for (size_t k = 0; k < send_S_[size_t(p)] && owed(p); ++k)
                full = full || links_[size_t(p) * stride_ + k].want_out;
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
                if (m != kPayload && ev) set_rcvlowat(comm_->links[li], int(io_[li]->header_size()));
                if (l.want_out && (l.tx >= 0 || dealer_.ready(p))) ev |= POLLOUT;
                // Streams this op still sends over are polled for a hang-up even while
                // their frames wait for a dependency.
                if (ev == 0 && !(owed(p) && stream_of(li) < send_S_[size_t(p)])) continue;
                pfds.push_back({comm_->links[li].fd, ev, 0});
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
                for (int p = 0; p < comm_->world_size; ++p) {
                    bool full = false;  // a socket to p took no more: the path holds it back
                    for (size_t k = 0; k < send_S_[size_t(p)] && owed(p); ++k)
                        full = full || links_[size_t(p) * stride_ + k].want_out;
                    busy[size_t(p)] = char(owed(p) ? (full ? 2 : 1) : 0);
                }
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
    size_t S_;                       // comm->stripe: what an op deals over unless paced
    size_t stride_;                  // streams per peer connected (comm->streams)
    std::vector<size_t> send_S_;     // per peer: the streams this op deals its frames over
    std::vector<LinkState> links_;   // one per connection: peer * stride_ + stream
    std::vector<std::unique_ptr<FrameLink>> io_;  // how each one's frames move (link.hpp)
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
