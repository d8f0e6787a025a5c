#include "path_bound.h"

#include <algorithm>

namespace pipedream {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Keeps the count vectors no other one is at least as large as in every
// entry (a dominated one never gives the largest chain at nonnegative costs).
std::vector<std::array<double, 3>> undominated(std::vector<std::array<double, 3>> counts) {
  std::sort(counts.begin(), counts.end());
  counts.erase(std::unique(counts.begin(), counts.end()), counts.end());
  std::vector<std::array<double, 3>> kept;
  for (size_t x = 0; x < counts.size(); ++x) {
    bool dominated = false;
    for (size_t y = 0; y < counts.size() && !dominated; ++y) {
      dominated = y != x && counts[y][0] >= counts[x][0] && counts[y][1] >= counts[x][1] &&
                  counts[y][2] >= counts[x][2];
    }
    if (!dominated) kept.push_back(counts[x]);
  }
  return kept;
}

}  // namespace

RoundTripBound::RoundTripBound(const PointModel& model, const std::vector<LayerCost>& layers,
                               double actionSeconds, int tp)
    : split_(model.splitBackward()),
      stages_(model.stages()),
      layers_(static_cast<int>(layers.size())),
      act_(actionSeconds),
      forward_(layers_ + 1, 0.0),
      input_(layers_ + 1, 0.0),
      weight_(layers_ + 1, 0.0),
      cuts_(layers_, stages_) {
  const double b = model.samples();
  for (int l = 0; l < layers_; ++l) {
    const LayerCost& c = layers[l];
    const double full = c.backwardFixed + c.backwardPerSample * b;
    const double weight = split_ ? c.weightShare * full : 0.0;
    forward_[l + 1] = forward_[l] + (c.forwardFixed + c.forwardPerSample * b) / tp;
    input_[l + 1] = input_[l] + (full - weight) / tp;
    weight_[l + 1] = weight_[l] + weight / tp;
  }
  comm_ = postForward_ = postInput_ = kInf;
  postBackward_.assign(layers_ + 1, 0.0);
  for (int l = 1; l < layers_; ++l) {
    comm_ = std::min(comm_, model.commSeconds(l));
    postForward_ = std::min(postForward_, model.postSeconds(l - 1, true));
    postBackward_[l] = model.postSeconds(l, false);
    postInput_ = std::min(postInput_, postBackward_[l]);
  }
  if (stages_ < 2) comm_ = postForward_ = postInput_ = 0.0;
  enabled_ = comm_ >= 0.0 && readLists(model);
}

// The count vectors of each stage's chains (T0, T1, R0, R1 of the header),
// from its rank's list; false where the bound does not apply.
bool RoundTripBound::readLists(const PointModel& model) {
  const Schedule& schedule = model.schedule();
  const int total = schedule.totalMicrobatches();
  if (model.ranks() != stages_) return false;
  families_.assign(stages_, {});
  for (int k = 0; k < stages_; ++k) {
    if (model.rankStages(model.rankOf(k)).size() != 1) return false;
    // prefix[p]: the counts of the list's first p compute actions.
    std::vector<Counts> prefix(1, Counts{0.0, 0.0, 0.0});
    std::vector<int> forwardAt(total, -1), gradAt(total, -1);
    for (const Action& a : schedule.actions(model.rankOf(k))) {
      if (isComm(a.kind) || a.kind == ActionKind::kUpdate) continue;
      if (!isCompute(a.kind) || a.stage != k || a.microbatch < 0 || a.microbatch >= total) {
        return false;
      }
      Counts add{0.0, 0.0, 0.0};
      const int at = static_cast<int>(prefix.size()) - 1;
      if (a.kind == ActionKind::kForward) {
        add[0] = 1.0;
        forwardAt[a.microbatch] = at;
      } else if (a.kind == ActionKind::kBackward) {
        add = {0.0, 1.0, split_ ? 1.0 : 0.0};
        gradAt[a.microbatch] = at;
      } else if (split_ && a.kind == ActionKind::kBackwardInput) {
        add[1] = 1.0;
        gradAt[a.microbatch] = at;
      } else if (split_ && a.kind == ActionKind::kBackwardWeight) {
        add[2] = 1.0;
      } else {
        return false;  // I or W of a schedule the search costs as whole backwards
      }
      Counts next = prefix.back();
      for (int x = 0; x < 3; ++x) next[x] += add[x];
      prefix.push_back(next);
    }
    int last = -1;
    for (int i = 0; i < total; ++i) {
      if (forwardAt[i] < 0 || gradAt[i] <= forwardAt[i]) return false;
      last = std::max(last, gradAt[i]);
    }
    const int end = static_cast<int>(prefix.size()) - 2;  // the last compute action
    // Counts of the list's actions [from, to], plus `extra`.
    const auto span = [&](int from, int to, Counts extra) {
      for (int x = 0; x < 3; ++x) extra[x] += prefix[to + 1][x] - prefix[from][x];
      return extra;
    };
    Family t0, t1, r0, r1;
    t0.counts = {span(0, end, {0.0, 0.0, 0.0})};
    t1.tail = true;
    t1.counts = {span(0, last, {0.0, 0.0, 0.0})};
    r0.trip = r1.trip = r1.tail = true;
    for (int i = 0; i < total; ++i) {
      r0.counts.push_back(span(gradAt[i], end, prefix[forwardAt[i] + 1]));
      r1.counts.push_back(span(gradAt[i], last, prefix[forwardAt[i] + 1]));
    }
    r0.counts = undominated(std::move(r0.counts));
    r1.counts = undominated(std::move(r1.counts));
    families_[k] = {t0, t1, r0, r1};
  }
  return true;
}

double RoundTripBound::stage(int k, int a, int e) const {
  // Posting the forward's send at the least over the cuts keeps Q growing with e.
  const int after = stages_ - 1 - k;
  const Counts cost{forward_[e] - forward_[a] + act_ + (after > 0 ? postForward_ : 0.0),
                    input_[e] - input_[a] + act_ + (k > 0 ? postBackward_[a] : 0.0),
                    split_ ? weight_[e] - weight_[a] + act_ : 0.0};
  const double hop = act_ + comm_;
  const double head = forward_[a] + k * (hop + postForward_);
  const double tail = input_[a] + k * hop + std::max(0, k - 1) * postInput_;
  const double trip = forward_[layers_] - forward_[e] + input_[layers_] - input_[e] +
                      2.0 * after * hop + std::max(0, after - 1) * postForward_ +
                      after * postInput_;
  double best = 0.0;
  for (const Family& f : families_[k]) {
    double own = 0.0;
    for (const Counts& c : f.counts) {
      own = std::max(own, c[0] * cost[0] + c[1] * cost[1] + c[2] * cost[2]);
    }
    best = std::max(best, head + (f.tail ? tail : 0.0) + (f.trip ? trip : 0.0) + own);
  }
  return best;
}

double RoundTripBound::rest(int s, int a) {
  return cuts_.rest(s, a, [this](int k, int from, int to) { return stage(k, from, to); });
}

}  // namespace pipedream
