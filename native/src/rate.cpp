#include "rate.hpp"

#include <algorithm>
#include <cmath>

namespace pccl {
namespace rate {

namespace {
constexpr double kCycle[kCycleLength] = {1.0, kProbeGain, kProbeGain, kDrainGain, kDrainGain, 1.0};

double median(std::vector<double> v) {
    const size_t k = v.size() / 2;
    std::nth_element(v.begin(), v.begin() + std::ptrdiff_t(k), v.end());
    return v[k];
}
}  // namespace

double gain_at(int index) { return kCycle[((index % kCycleLength) + kCycleLength) % kCycleLength]; }

double sample(const Window &before, const Window &prev, const Window &w) {
    if (!(w.seconds > 0 && prev.seconds > 0 && before.seconds > 0)) return 0.0;
    const double delivered = (prev.delivered + w.delivered) / (prev.seconds + w.seconds);
    const double sent = (before.sent + prev.sent) / (before.seconds + prev.seconds);
    return std::min(delivered, sent);
}

Controller::Controller(int stripe, int fewest, int most)
    : stripe_(std::max(1, stripe)), fewest_(std::max(1, fewest)),
      most_(std::max(std::max(1, fewest), most)), proposal_(std::max(1, stripe)),
      score_(size_t(std::max(std::max(1, fewest), most)) + 1, 0.0) {}

double Controller::bandwidth() const {
    double bw = app_max_;
    for (const Sample &s : filter_) bw = std::max(bw, s.rate);
    return bw;
}

double Controller::cap_at(double gain) const {
    const double bw = bandwidth();
    if (!filled_) gain = kStartupGain;
    return bw > 0 && stripe_ > 1 ? kHeadroom * bw * gain : 0.0;
}

double Controller::cap() const { return cap_at(1.0); }

void Controller::bound(int fewest, int most) {
    fewest_ = std::max(1, fewest);
    most_ = std::max(fewest_, most);
    if (score_.size() < size_t(most_) + 1) score_.resize(size_t(most_) + 1, 0.0);
}

Controller::Start Controller::begin_op(int fewest, int most, double min_rtt, double window) {
    bound(fewest, most);
    if (fewest_ == most_) {
        proposal_ = fewest_;
    } else if (filled_ && min_rtt > 0 && window > 0) {
        const double in_flight = bandwidth() * min_rtt;
        int need = int(std::ceil(in_flight * kStripeMargin / window));
        // Streams that held nearly their windows in flight were held by them: the path may
        // carry more than they showed (four streams at 200 ms RTT carried 440 Mbit/s of a
        // 1 Gbit/s link, 0.87 of their nominal windows, which asks for only 5 at 1.4x).
        if (in_flight >= kWindowBound * stripe_ * window)
            need = std::max(need, int(std::ceil(kStripeStep * stripe_)));
        need = std::max(fewest_, std::min(most_, need));
        // More than what the stripe was last anchored at (the estimate grew into it, or
        // the path got longer or faster), or far less: the need is the new anchor.
        const bool grew = need > anchor_ && need >= kStripeStep * stripe_;
        const bool fell = kStripeStep * need <= anchor_;
        if (grew || fell) {
            anchor_ = need;
            // Grown by kStripeStep at least (a stream new to the stripe starts cold, and a
            // stripe of 5 instead of 4 cost more than it gave: 63-68 % of an emulated
            // 1 Gbit/s, 100 ms link against 74-80 % with 4 pinned).
            if ((grew && need > stripe_) || (fell && need != stripe_)) {
                set_stripe(need);
                trial_from_ = 0;  // what the path needs, not a trial to be judged
            }
        }
    }
    proposal_ = std::max(fewest_, std::min(most_, proposal_));
    if (proposal_ != stripe_) set_stripe(proposal_);
    index_ = 0;
    prev_ = before_ = {};
    queued_ = true;
    op_samples_.clear();
    return {cap_at(gain_at(0)), stripe_};
}

void Controller::take(double sample, bool busy, double seconds) {
    if (!(sample > 0)) return;
    if (!busy) {
        // A window the op ran dry in reads low for want of bytes, not of path: it can only
        // show the path is faster (BBR's rule for application-limited samples). So it
        // cannot be a path's first estimate: that would put a cap where there was none, at
        // what a small op happened to carry (Streaming DiLoCo's first ops on a path were
        // its 8-byte tau agreement: a cap of 1.6 kB/s, then a fragment's exchange crawling
        // at it until its deadline, on an emulated 20 Mbit/s link).
        if (!filter_.empty() && sample > bandwidth()) app_max_ = sample;
        return;
    }
    busy_ += seconds;
    filter_.push_back({sample, busy_});
    while (filter_.size() > size_t(kBwWindows) && busy_ - filter_.front().at > kBwSeconds)
        filter_.erase(filter_.begin());
    // Busy samples now speak for the path; an old app-limited max must age out with them.
    if (filter_.size() >= size_t(kBwWindows)) app_max_ = 0;
    op_samples_.push_back(sample);
    ++seen_;
    if (!filled_) {
        const double bw = bandwidth();
        if (bw >= kFullGrowth * full_bw_) {
            full_bw_ = bw;
            full_cnt_ = 0;
        } else if (++full_cnt_ >= kFullWindows) {
            filled_ = true;
        }
    }
}

double Controller::on_window(const Window &w) {
    if (!(w.seconds > 0)) {
        prev_ = {};  // not measured (shared with another lane): no lag to bound by
    } else {
        // A sample spans two windows: ACKs bunched at a window's edge move bytes from one
        // to the next, and the pair sums them again. What the pair delivered was sent a
        // round trip (about a window) before it: never more than that went out, whatever
        // the ACKs' bunching says.
        take(sample(before_, prev_, w), !w.app_limited && !prev_.app_limited, w.seconds);
        before_ = prev_;
        prev_ = w;
        queued_ = w.queue > kQueueSlack * w.seconds;
    }
    // The gain is the window's index alone, so every rank of a ring probes in the same
    // window. A probe lasts two windows: loss in it ends it as the drain begins, and takes
    // nothing from the bandwidth (the path held what it delivered).
    ++index_;
    const double gain = gain_at(index_);
    return cap_at(gain < 1.0 && !queued_ ? 1.0 : gain);
}

void Controller::end_op() {
    if (op_samples_.size() < size_t(kStripeWindows) || fewest_ == most_) return;
    const double carried = median(op_samples_);
    score_[size_t(stripe_)] = carried;
    if (trial_from_ > 0) {
        // A trial of a wider stripe: kept when it carried measurably more.
        const int from = trial_from_;
        trial_from_ = 0;
        if (carried < kStripeGain * score_[size_t(from)]) {
            proposal_ = from;
            trial_every_ = std::min(trial_every_ * 2, kStripeTrialMax);
        } else {
            trial_every_ = kStripeTrialEvery;
        }
        scored_ = 0;
        return;
    }
    // A narrower stripe that carried measurably more than this one: back to it (never
    // below what the bandwidth-delay product needs: fewer streams cannot hold it, and a
    // stream that just joined the stripe is cold and carries less for a while).
    for (int n = std::max(fewest_, anchor_); n < stripe_; ++n) {
        if (score_[size_t(n)] > 0 && carried * kStripeGain < score_[size_t(n)]) {
            proposal_ = n;
            scored_ = 0;
            return;
        }
    }
    if (++scored_ >= trial_every_ && stripe_ < most_) {
        proposal_ = std::min(most_, int(std::ceil(stripe_ * kStripeStep)));
        scored_ = 0;
    }
}

void Controller::set_stripe(int stripe) {
    // Wider than what was measured: a trial, judged against the stripe it came from.
    trial_from_ = stripe > stripe_ && score_[size_t(stripe_)] > 0 ? stripe_ : 0;
    stripe_ = stripe;
    proposal_ = stripe;
    scored_ = 0;
}

}  // namespace rate
}  // namespace pccl
