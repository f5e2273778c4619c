#include "deal.hpp"

#include <algorithm>
#include <cstdio>
#include <functional>

namespace pccl {

Dealer::Dealer(const Schedule &s, int world_size)
    : s_(s), heap_(size_t(world_size)), first_(s.recvs.size() + 1, 0) {
    // The sends that wait for each receive, grouped by receive (counting sort).
    for (const SendItem &it : s.sends)
        if (it.dep >= 0) ++first_[size_t(it.dep) + 1];
    for (size_t r = 0; r < s.recvs.size(); ++r) first_[r + 1] += first_[r];
    waiting_.resize(size_t(first_.back()));
    std::vector<int32_t> fill(first_.begin(), first_.end() - 1);
    for (size_t i = 0; i < s.sends.size(); ++i) {
        const SendItem &it = s.sends[i];
        if (it.dep >= 0)
            waiting_[size_t(fill[size_t(it.dep)]++)] = int32_t(i);
        else
            push(int32_t(i));
    }
}

void Dealer::push(int32_t item) {
    std::vector<int32_t> &h = heap_[size_t(s_.sends[size_t(item)].peer)];
    h.push_back(item);
    std::push_heap(h.begin(), h.end(), std::greater<int32_t>());
}

int32_t Dealer::take(int peer) {
    std::vector<int32_t> &h = heap_[size_t(peer)];
    if (h.empty()) return -1;
    std::pop_heap(h.begin(), h.end(), std::greater<int32_t>());
    int32_t item = h.back();
    h.pop_back();
    return item;
}

void Dealer::give_back(int32_t item) { push(item); }

void Dealer::landed(int32_t recv) {
    for (int32_t k = first_[size_t(recv)]; k < first_[size_t(recv) + 1]; ++k) push(waiting_[size_t(k)]);
}

Arrivals::Arrivals(const Schedule &s, int world_size, uint64_t next_coll_seq)
    : s_(s), next_coll_seq_(next_coll_seq), from_(size_t(world_size)),
      claimed_(s.recvs.size(), 0), unclaimed_(size_t(world_size), 0) {
    for (size_t i = 0; i < s.recvs.size(); ++i) {
        const RecvItem &it = s.recvs[i];
        std::vector<Message> &msgs = from_[size_t(it.peer)];
        auto m = std::find_if(msgs.begin(), msgs.end(), [&](const Message &x) {
            return x.coll == it.expect.coll && x.seq == it.expect.seq;
        });
        if (m == msgs.end()) {
            msgs.push_back({it.expect.coll, it.expect.seq, it.expect.step, {}});
            m = msgs.end() - 1;
        }
        // The schedule numbers a message's frames from first_step on, in order (schedule.cpp);
        // anything else still maps, with holes that read as out of range.
        uint32_t step = it.expect.step;
        if (step < m->first_step) {
            m->items.insert(m->items.begin(), size_t(m->first_step - step), -1);
            m->first_step = step;
        }
        size_t k = size_t(step - m->first_step);
        if (k >= m->items.size()) m->items.resize(k + 1, -1);
        m->items[k] = int32_t(i);
        ++unclaimed_[size_t(it.peer)];
    }
}

int32_t Arrivals::first_unclaimed(int peer) const {
    for (const Message &m : from_[size_t(peer)])
        for (int32_t i : m.items)
            if (i >= 0 && !claimed_[size_t(i)]) return i;
    return -1;
}

Arrivals::Verdict Arrivals::place(int peer, const wire::FrameHeader &h, int32_t *item,
                                  pcclResult_t *rc, std::string *why) {
    const std::vector<Message> &msgs = from_[size_t(peer)];
    if (msgs.empty()) return kLater;  // nothing of this op comes from this peer
    // Which of the op's messages the frame belongs to, or whether it is from a later op or
    // an earlier one. Collectives and point-to-point messages are numbered apart (seq is
    // coll_seq or the per-peer message count), so each is compared with its own kind.
    const bool p2p = h.coll == wire::kCollP2P;
    const Message *m = nullptr;
    bool any = false, later = true;
    for (const Message &x : msgs) {
        if ((x.coll == wire::kCollP2P) != p2p) continue;
        any = true;
        if (x.seq == h.seq) m = &x;
        if (h.seq <= x.seq) later = false;
    }
    if (!any) {
        // A point-to-point message met during a collective was sent after it; a collective
        // met during a point-to-point op is later unless this rank already ran it.
        later = p2p || h.seq >= next_coll_seq_;
    }
    if (!m) {
        if (later) return kLater;
        // Stale: the peer is behind this rank, or they disagree on the order of their ops.
        int32_t first = first_unclaimed(peer);
        wire::FrameHeader want = s_.recvs[size_t(first >= 0 ? first : msgs[0].items[0])].expect;
        if (wire::check_expected(h, want, why) == pcclSuccess)  // not reached: seq or coll differ
            *why = "a frame of an earlier operation";
        *rc = pcclMismatch;
        return kRefuse;
    }
    const uint64_t k = uint64_t(h.step) - m->first_step;
    if (h.step < m->first_step || k >= m->items.size() || m->items[size_t(k)] < 0) {
        // Frames numbered past this schedule's belong to the op's next schedule (the quantized
        // all-reduce's second phase), which the peer started after sending all of these.
        if (s_.continued && h.step >= m->first_step && k >= m->items.size()) return kLater;
        wire::FrameHeader want = s_.recvs[size_t(m->items[0])].expect;
        want.step = h.step;
        want.length = h.length;
        if (wire::check_expected(h, want, why) != pcclSuccess) {
            *rc = pcclMismatch;
            return kRefuse;
        }
        char buf[200];
        snprintf(buf, sizeof(buf), "sent frame %u of %s #%llu; this rank expects frames %u..%u of it",
                 h.step, wire::coll_name(h.coll), (unsigned long long)h.seq, m->first_step,
                 unsigned(m->first_step + m->items.size() - 1));
        *why = buf;
        *rc = pcclProtocolError;
        return kRefuse;
    }
    const int32_t idx = m->items[size_t(k)];
    if (wire::check_expected(h, s_.recvs[size_t(idx)].expect, why) != pcclSuccess) {
        *rc = pcclMismatch;
        return kRefuse;
    }
    if (claimed_[size_t(idx)]) {
        char buf[160];
        snprintf(buf, sizeof(buf), "sent frame %u of %s #%llu twice", h.step, wire::coll_name(h.coll),
                 (unsigned long long)h.seq);
        *why = buf;
        *rc = pcclProtocolError;
        return kRefuse;
    }
    claimed_[size_t(idx)] = 1;
    --unclaimed_[size_t(peer)];
    *item = idx;
    return kPlace;
}

}  // namespace pccl
