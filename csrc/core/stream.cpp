#include "stream.h"

#include <numeric>
#include <stdexcept>

#include "lower.h"
#include "traits.h"

namespace pipedream {

AsyncStream::AsyncStream(ScheduleOptions options) : options_(std::move(options)) {
  const ScheduleTraits& traits = scheduleTraits(options_.name);
  if (!traits.streaming) {
    std::string streaming;
    for (const auto& t : allScheduleTraits()) {
      if (t.streaming) streaming += (streaming.empty() ? "'" : " or '") + t.name + "'";
    }
    throw std::invalid_argument("an asynchronous stream needs schedule " + streaming + " (got '" +
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

Schedule AsyncStream::lowered(int steps) const {
  ScheduleOptions o = options_;
  if (scheduleTraits(o.name).updateRule == UpdateRule::kPerMinibatch) {
    o.microbatches = steps;
    o.batches = 1;
  } else {
    o.batches = steps;
  }
  return lower(buildSchedule(o));
}

std::vector<std::pair<size_t, size_t>> AsyncStream::slices(const Schedule& schedule, int rank,
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
    size_t e = k + 1;
    while (e < list.size() && list[e].kind == ActionKind::kSendForward && list[e].microbatch == a.microbatch) ++e;
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

std::vector<Action> AsyncStream::shifted(std::vector<Action> actions, int64_t periods) const {
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

std::vector<Action> AsyncStream::stepActions(int rank, int64_t step) const {
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

std::vector<Action> AsyncStream::drainActions(int rank, int64_t steps) const {
  if (steps <= 0) return {};
  int64_t source = steps;
  int64_t periods = 0;
  if (steps > warmup_ + 2 * period_) {
    source = warmup_ + period_ + (steps - warmup_ - period_) % period_;
    periods = (steps - source) / period_;
  }
  const Schedule s = lowered(static_cast<int>(source));
  const auto& list = s.actions(rank);
  const size_t begin = slices(s, rank, static_cast<int>(source)).back().second;
  return shifted(std::vector<Action>(list.begin() + begin, list.end()), periods);
}

}  // namespace pipedream
