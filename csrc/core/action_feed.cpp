#include "action_feed.h"

#include <numeric>
#include <set>
#include <tuple>
#include <stdexcept>

#include "channels.h"
#include "lower.h"
#include "traits.h"

namespace pipedream {

AsyncActionFeed::AsyncActionFeed(ScheduleOptions options) : options_(std::move(options)) {
  const ScheduleTraits& traits = scheduleTraits(options_.name);
  if (!traits.streaming) {
    std::string streaming;
    for (const auto& t : allScheduleTraits()) {
      if (t.streaming) streaming += (streaming.empty() ? "'" : " or '") + t.name + "'";
    }
    throw std::invalid_argument("AsyncActionFeed needs schedule " + streaming + " (got '" +
                                options_.name + "')");
  }
  // pipedream: one minibatch and one update per step; 2bw: one batch of m.
  const bool perMinibatch = traits.updateRule == UpdateRule::kPerMinibatch;
  std::vector<int> replicas = options_.replicas;
  if (replicas.empty()) replicas.assign(std::max(1, options_.stages), 1);
  int ranks = 0;
  for (int r : replicas) ranks += r;
  versionsPerPeriod_.assign(replicas.size(), 1);
  perStep_ = traits.microbatchesPerStep(options_.microbatches);
  period_ = 1;  // 2bw: one batch, one update per stage
  if (perMinibatch) {
    for (int r : replicas) period_ = std::lcm(period_, std::max(1, r));
    for (size_t j = 0; j < replicas.size(); ++j) {
      versionsPerPeriod_[j] = period_ / (options_.verticalSync ? replicas[0] : replicas[j]);
    }
  }
  // Enough steps that every stage is in its steady 1F1B pattern and reads
  // versions > 0 (so shifting a version is adding to it).
  // A multiple of the period: the base list's minibatch count must be one
  // (pipedream with replicas takes minibatches in rounds of lcm(replicas)).
  warmup_ = 2 * (ranks + period_) + 2;
  warmup_ = (warmup_ + period_ - 1) / period_ * period_;
  base_ = lowered(warmup_ + 2 * period_);
  for (int r = 0; r < base_.numRanks(); ++r) {
    baseSlices_.push_back(slices(base_, r, warmup_ + 2 * period_));
  }
}

Schedule AsyncActionFeed::lowered(int steps) const {
  ScheduleOptions o = options_;
  if (scheduleTraits(o.name).updateRule == UpdateRule::kPerMinibatch) {
    o.microbatches = steps;
    o.batches = 1;
  } else {
    o.batches = steps;
  }
  return orderTransfers(lower(buildSchedule(o)), perStep_);
}

std::vector<std::pair<size_t, size_t>> AsyncActionFeed::slices(const Schedule& schedule, int rank,
                                                               int steps) const {
  const auto& list = schedule.actions(rank);
  // end[t]: just after the last forward of step t on this rank and the sends
  // that follow it (so a downstream rank never waits for our next step).
  std::vector<size_t> end(steps, 0);
  std::vector<bool> has(steps, false);
  for (size_t k = 0; k < list.size(); ++k) {
    const Action& a = list[k];
    if (a.kind != ActionKind::kForward) continue;
    const int t = a.microbatch / perStep_;
    // Its sends, and receives posted between the forward and them.
    size_t e = k + 1;
    for (size_t n = k + 1; n < list.size(); ++n) {
      const Action& b = list[n];
      if (b.kind == ActionKind::kSendForward && b.microbatch == a.microbatch) {
        e = n + 1;
      } else if (b.kind != ActionKind::kRecvForward && b.kind != ActionKind::kRecvBackward) {
        break;
      }
    }
    end[t] = std::max(end[t], e);
    has[t] = true;
  }
  std::vector<std::pair<size_t, size_t>> out;
  size_t begin = 0;
  for (int t = 0; t < steps; ++t) {
    const size_t stop = has[t] ? std::max(begin, end[t]) : begin;
    out.push_back({begin, stop});
    begin = stop;
  }
  return out;
}

std::vector<Action> AsyncActionFeed::shifted(std::vector<Action> actions, int64_t periods) const {
  if (periods == 0) return actions;
  const int64_t microbatchShift = periods * period_ * perStep_;
  for (auto& a : actions) {
    if (!isVersionOnly(a.kind)) a.microbatch = static_cast<int>(a.microbatch + microbatchShift);
    if (isCompute(a.kind) || isVersionOnly(a.kind)) {
      a.version = static_cast<int>(a.version + periods * versionsPerPeriod_.at(a.stage));
    }
  }
  return actions;
}

std::vector<Action> AsyncActionFeed::stepActions(int rank, int64_t step) const {
  if (step < 0) throw std::invalid_argument("step must be >= 0 (got " + std::to_string(step) + ")");
  const auto& list = base_.actions(rank);
  int64_t source = step;
  int64_t periods = 0;
  if (step >= warmup_ + period_) {
    source = warmup_ + (step - warmup_) % period_;
    periods = (step - source) / period_;
  }
  const auto [begin, end] = baseSlices_.at(rank).at(static_cast<size_t>(source));
  return shifted(std::vector<Action>(list.begin() + begin, list.begin() + end), periods);
}

std::vector<Action> AsyncActionFeed::drainActions(int rank, int64_t steps) const {
  if (steps <= 0) return {};
  int64_t source = steps;
  int64_t periods = 0;
  if (steps > warmup_ + 2 * period_) {
    source = warmup_ + period_ + (steps - warmup_ - period_) % period_;
    periods = (steps - source) / period_;
  }
  // The rest of a run of `source` steps: what its lowered list holds beyond
  // the steps already served. Not simply the list's tail: where a run posts
  // a receive depends on the sends after it (channels.h), so the served steps
  // (cut from the unbounded run) may leave a receive the finite list posts
  // earlier; each pair's operations still come in the finite list's order.
  const Schedule s = lowered(static_cast<int>(source));
  std::set<std::tuple<ActionKind, int, int, int>> served;
  for (int64_t t = 0; t < source; ++t) {
    for (const Action& a : stepActions(rank, t)) served.insert({a.kind, a.stage, a.microbatch, a.version});
  }
  std::vector<Action> rest;
  for (const Action& a : s.actions(rank)) {
    if (!served.count({a.kind, a.stage, a.microbatch, a.version})) rest.push_back(a);
  }
  return shifted(std::move(rest), periods);
}

}  // namespace pipedream
