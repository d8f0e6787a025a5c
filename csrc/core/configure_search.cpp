// searchConfigurations: branch and bound over the points of the space and,
// inside each, over the balances (stage by stage), with admissible lower
// bounds on the step time:
//   - a rank's makespan is at least its busy time; a stage's first forward
//     waits for the forwards of the stages before it (head) and, without a
//     split backward, its last backward is followed by theirs (tail);
//   - one microbatch's forwards and backwards through every stage are a chain;
//   - the stages still to cut take at least the least, over the cuts of the
//     remaining layers, of the largest such path (dynamic programming);
//   - a critical path of a simulation is a chain of dependencies at every
//     balance: its length is exact over the stages cut and the least over the
//     cuts of the rest (dynamic programming; PathBound, path_bound.h). The
//     min-max balance's path is one; where only the simulated bound (below)
//     prunes a node, its simulation's critical path is collected too, so the
//     nodes like it are pruned by the cheap bounds (at most kMaxPaths);
//   - the simulator is monotone in every action cost (a list schedule run in
//     a fixed order), so recomputation, which only adds cost, is chosen only
//     where the rank does not fit without it;
//   - the same monotonicity: simulating the stages cut so far at their costs
//     and each later stage at the least a stage can cost whose first layer
//     lies where that stage's can (at least one layer per stage before and
//     after it) bounds the makespan; a replay of the schedule
//     (MakespanReplay, replay.h) makes that simulation cheap enough for every
//     node the cheaper bounds leave (at a depth where it rarely prunes, for a
//     sample of them);
//   - for a flush schedule with one stage per rank, each stage's chains (the
//     forwards before it, its rank's list, its microbatches' round trips
//     through the later stages, the backwards after it) at the least costs its
//     layers allow: the largest over the stages cut and the least, over the
//     cuts of the rest, of the largest over theirs (RoundTripBound,
//     path_bound.h; admissibility there); at the root it bounds the whole
//     point before its seed is scored;
//   - a rank whose layers are all cut and that does not fit prunes the prefix.
// Phase 1 visits the points by their bound and scores the min-max balance of
// each (its seed) until the bound cannot beat the (candidates + 1)-th best
// seed: the points after that can be neither the best nor a runner-up. Phase
// 2 searches the seeded points, the best seeds first; a point's bar is the
// (candidates + 1)-th best of the other points (their seeds or their searched
// bests), and a prefix is dropped when its bound cannot beat the point's best
// nor that bar. Asynchronous schedules (the step is a difference of two
// windows, not a makespan) are pruned by memory only.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "configure.h"
#include "configure_model.h"
#include "configure_space.h"
#include "path_bound.h"
#include "replay.h"
#include "traits.h"

namespace pipedream {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
// Sums taken in another order than the simulator's differ by far less.
constexpr double kRounding = 1e-12;
// Improvements below this share of the step are not searched for (they would
// make every near-tie of a symmetric instance a branch).
constexpr double kTie = 1e-10;

// Critical paths a point's search collects at most (each costs a table and a
// term of every node's bound).
constexpr int kMaxPaths = 64;

// The simulated bound costs most of a node; where it rarely prunes it runs
// on a sample of the nodes (PointSearch::simulating).
constexpr long long kWarmUp = 64;
constexpr long long kPruneRate = 256;
constexpr long long kSample = 16;

bool cannotBeat(double bound, double threshold) {
  return bound * (1 - kRounding) >= threshold * (1 - kTie);
}

// Per-microbatch work of `stages` stages cut from the layers at one microbatch
// size, and a bound on every suffix of the layers cut into the last s stages:
// stage k starting at layer a waits for the forwards of the layers before a
// (head) and, without a split backward, its last backward is followed by
// theirs (tail); in between it is busy with its own microbatches. The least,
// over the cuts, of the largest such path is found by dynamic programming.
class WorkTable {
 public:
  WorkTable(const std::vector<LayerCost>& layers, int samples, int tp, bool split,
            double actionSeconds, int microbatches, int stages)
      : layers_(static_cast<int>(layers.size())),
        stages_(stages),
        fixed_(actionSeconds * (split ? 3 : 2)),
        chainFixed_(actionSeconds * 2),
        split_(split),
        act_(actionSeconds),
        n_(microbatches),
        work_(layers_ + 1, 0.0),
        chain_(layers_ + 1, 0.0),
        head_(layers_ + 1, 0.0),
        cuts_(layers_, stages) {
    for (int l = 0; l < layers_; ++l) {
      const LayerCost& c = layers[l];
      const double forward = (c.forwardFixed + c.forwardPerSample * samples) / tp;
      const double backward = (c.backwardFixed + c.backwardPerSample * samples) / tp;
      const double input = split ? (1 - c.weightShare) * backward : backward;
      work_[l + 1] = work_[l] + forward + backward;
      chain_[l + 1] = chain_[l] + forward + input;
      head_[l + 1] = head_[l] + forward;
    }
  }

  // A stage of layers [a, e) over all microbatches of a step.
  double busy(int a, int e) const { return n_ * (work_[e] - work_[a] + fixed_); }
  // One microbatch's forward and backward (input gradient) through [a, e) in s stages.
  double chain(int a, int e, int s) const { return chain_[e] - chain_[a] + s * chainFixed_; }
  double totalBusy() const { return n_ * (work_[layers_] + stages_ * fixed_); }
  // Stage k of layers [a, e): its first forward waits for the forwards of
  // the stages before (head); the last of its backwards (input gradients
  // when split) is followed by theirs (tail); in between its rank runs all
  // of its F and B (or F and I, before that last I) one after the other.
  double path(int k, int a, int e) const {
    const double chainBefore = chain_[a] + k * chainFixed_;
    const double chainOwn = n_ * (chain_[e] - chain_[a] + chainFixed_);
    if (!split_) return chainBefore + busy(a, e);
    return std::max(head_[a] + k * act_ + busy(a, e), chainBefore + chainOwn);
  }

  // The least, over the cuts of layers [a, L) into the last s stages, of the
  // largest path of those stages.
  double suffix(int s, int a) {
    return cuts_.rest(s, a, [this](int k, int from, int to) { return path(k, from, to); });
  }

  // A balance reaching suffix(stages, 0).
  std::vector<int> bestBalance() {
    std::vector<int> balance;
    int a = 0;
    for (int s = stages_; s > 0; --s) {
      const double target = suffix(s, a);
      const int k = stages_ - s;
      int e = a + 1;
      while (e < layers_ - (s - 1) && std::max(path(k, a, e), suffix(s - 1, e)) > target) {
        ++e;
      }
      if (s == 1) e = layers_;
      balance.push_back(e - a);
      a = e;
    }
    return balance;
  }

 private:
  int layers_, stages_;
  double fixed_, chainFixed_;
  bool split_;
  double act_;
  int n_;
  std::vector<double> work_, chain_, head_;
  MinMaxCuts cuts_;  // suffix(s, a)
};

double sharedRanksOf(const MachineCosts& machine, int world) {
  const int onNode = machine.ranksPerNode > 0 ? std::min(machine.ranksPerNode, world) : world;
  return machine.cores > 0 && onNode > machine.cores ? static_cast<double>(onNode) / machine.cores
                                                     : 0.0;
}

// The optimizer's step on one rank holding `bytes` in `tensors` parameter tensors.
double optimizerSeconds(const MachineCosts& machine, const SpacePoint& point, bool fsdp,
                        double bytes, double tensors) {
  return estimatedOptimizerSeconds(machine, bytes, tensors, point.mesh[2], point.mesh[1], fsdp);
}

// Lower bounds on the per-step terms (stepSeconds, optimizer, all-reduce) from
// the largest parameter bytes a rank is known to hold and a lower bound on
// the slowest rank's optimizer step.
double stepTermsBound(const MachineCosts& machine, const SpacePoint& point, double rankBytes,
                      double optimizer, int ep) {
  const int dp = point.mesh[1];
  const double bytes = rankBytes / point.mesh[2];
  double bound = machine.stepSeconds + optimizer;
  if (dp > 1 && ep == 1) {  // with ep, which of the bytes are experts (reduced over fewer) is unknown here
    // No call latency: a stage without parameters makes none (replicate or FSDP).
    bound += 2.0 * (dp - 1) / dp * bytes / machine.allReduceBandwidth;
  }
  return bound;
}

// Completed points' best step times (those that fit), for the runners-up.
class Standings {
 public:
  explicit Standings(int candidates) : keep_(candidates + 1) {}
  void add(double step) {
    steps_.insert(std::upper_bound(steps_.begin(), steps_.end(), step), step);
    if (static_cast<int>(steps_.size()) > keep_) steps_.pop_back();
  }
  // What a point's best must beat to be the best or a runner-up.
  double bar() const { return static_cast<int>(steps_.size()) < keep_ ? kInf : steps_.back(); }

 private:
  int keep_;
  std::vector<double> steps_;
};

struct Context {
  const std::vector<LayerCost>& layers;
  const MachineCosts& machine;
  const SearchSpace& space;
  std::map<std::tuple<int, int, bool, int>, std::unique_ptr<WorkTable>> tables;
  double totalParameters = 0.0;
  double totalTensors = 0.0;
  long long evaluated = 0;
  long long pruned = 0;

  WorkTable& table(const SpacePoint& point, bool split) {
    const int m = point.microbatches;
    auto& slot = tables[{m, point.mesh[2], split, point.stages()}];
    if (!slot) {
      const int samples = (space.batchSize + m - 1) / m;
      slot = std::make_unique<WorkTable>(layers, samples, point.mesh[2], split,
                                         machine.actionSeconds, m, point.stages());
    }
    return *slot;
  }
};

// Branch and bound over the balances (and recompute choices) of one point.
class PointSearch {
 public:
  PointSearch(Context& context, const SpacePoint& point, const PointModel& model)
      : c_(context), point_(point), model_(model),
        stages_(model.stages()), ranks_(model.ranks()), layers_(static_cast<int>(context.layers.size())),
        bounded_(!model.asynchronous()),
        table_(context.table(point, model.splitBackward())),
        start_(stages_ + 1, 0), recompute_(stages_, 0), lastStage_(ranks_, 0),
        simulated_(stages_) {
    for (int r = 0; r < ranks_; ++r) lastStage_[r] = model.rankStages(r).back();
    const bool fixedList = !c_.space.recomputeStages.empty();
    if (fixedList) recompute_ = c_.space.recomputeStages;
    if (c_.space.recompute == RecomputeChoice::kAlways && !fixedList) recompute_.assign(stages_, 1);
    searching_ = !fixedList && c_.space.recompute == RecomputeChoice::kSearch;
    if (bounded_ && c_.space.balance.empty()) {
      trip_ = std::make_unique<RoundTripBound>(model, c_.layers, c_.machine.actionSeconds, point.mesh[2]);
      if (!trip_->enabled()) trip_.reset();
    }
  }

  // A bound on the makespan of every balance of the point (0: none known).
  double rootMakespan() { return trip_ ? trip_->rest(stages_, 0) : 0.0; }

  // Scores the min-max balance; true when it fits (then seedStep() is its step).
  bool seed(Ranked& fallback, bool& anyFallback) {
    const std::vector<int> balance = c_.space.balance.empty() ? table_.bestBalance()
                                                              : c_.space.balance;
    scoreSeed(balance, fallback, anyFallback);
    seed_ = balance;
    return found_;
  }
  double seedStep() const { return best_.config.prediction.stepSeconds; }

  // The best configuration of the point that can beat `bar`, if any (after seed()).
  bool search(double bar) {
    bar_ = bar;
    if (bounded_ && c_.space.balance.empty()) {
      addPath(model_.criticalPath(seed_, std::vector<int>(stages_, 0)), -1);
    }
    State state;
    state.rankBusy.assign(ranks_, 0.0);
    state.rankBytes.assign(ranks_, 0.0);
    state.rankTensors.assign(ranks_, 0.0);
    descend(0, state);
    return found_;
  }

  // The point's best found (after search(), or the seed when not searched).
  Ranked& best() { return best_; }

 private:
  struct State {
    int next = 0;                 // first layer not cut yet
    double head = 0.0;            // forwards (and transfers) before the next stage
    double tail = 0.0;            // backwards (input gradients) before the next stage
    double chain = 0.0;           // one microbatch through the stages cut so far
    double pathBound = 0.0;       // the largest makespan bound of the stages cut so far
    double tripBound = 0.0;       // the largest RoundTripBound::stage of the stages cut so far
    std::vector<double> rankBusy;
    std::vector<double> rankBytes;
    std::vector<double> rankTensors;
  };

  double threshold() const { return std::min(bar_, found_ ? best_.config.prediction.stepSeconds : kInf); }

  void consider(Ranked r) {
    if (!r.config.prediction.fits) return;
    if (!found_ || better(r, best_)) {
      best_ = std::move(r);
      found_ = true;
    }
  }

  // The min-max balance, recompute decided per rank as the search would.
  void scoreSeed(const std::vector<int>& seed, Ranked& fallback, bool& anyFallback) {
    std::vector<int> recompute = recompute_;
    start_ = model_.starts(seed);
    bool fits = true;
    for (int r = 0; r < ranks_; ++r) fits = decideRank(r, recompute) && fits;
    Ranked r = ranked(point_, seed, recompute, model_.predict(seed, recompute));
    ++c_.evaluated;
    if (!r.config.prediction.fits) {
      if (!anyFallback || better(r, fallback)) fallback = r;
      anyFallback = true;
    }
    if (fits) consider(std::move(r));
  }

  bool fitsRank(int rank, const std::vector<int>& recompute) const {
    const double limit = c_.space.memoryBytes;
    return limit <= 0 || model_.peakBytes(rank, start_, recompute) <= limit;
  }

  // Recompute for a rank whose stages are all cut: none if it fits without,
  // else all of its stages (when the search decides). False: it cannot fit.
  bool decideRank(int rank, std::vector<int>& recompute) const {
    if (!searching_) return fitsRank(rank, recompute);
    for (int j : model_.rankStages(rank)) recompute[j] = 0;
    if (fitsRank(rank, recompute)) return true;
    for (int j : model_.rankStages(rank)) recompute[j] = 1;
    return fitsRank(rank, recompute);
  }

  double rankBusy(int rank) const {
    double busy = 0.0;
    for (int j : model_.rankStages(rank)) {
      if (start_[j + 1] <= start_[j]) continue;
      const StageCost s = model_.stageCost(j, start_[j], start_[j + 1], recompute_[j] != 0);
      busy += point_.microbatches * (s.forward + s.backward + s.weight);
    }
    return busy;
  }

  // Whether the simulated bound runs at depth j: at its first kWarmUp nodes
  // there, then while it prunes at least one node in kPruneRate, else at
  // every kSample-th node (it still samples; its critical paths are
  // collected from those). Skipping a bound only weakens the prune test.
  bool simulating(int j) {
    Simulated& at = simulated_[j];
    const bool run = at.calls < kWarmUp || at.prunes * kPruneRate >= at.calls ||
                     ++at.skipped % kSample == 0;
    if (run) ++at.calls;
    return run;
  }

  void addPath(const CriticalPath& path, int j);
  void descend(int j, const State& state);
  void leaf();
  double bound(int j, int e, const State& next, const StageCost& stage, double boundary,
               double& terms);
  double simulatedBound(int j, int e, double terms, StageCosts& costs);
  StageCost cheapestStage(int k, int first, int last) const;

  Context& c_;
  const SpacePoint& point_;
  const PointModel& model_;
  double bar_ = kInf;
  int stages_, ranks_, layers_;
  bool bounded_;
  bool searching_ = false;
  WorkTable& table_;
  std::vector<int> start_;
  std::vector<int> recompute_;
  std::vector<int> lastStage_;
  bool found_ = false;
  Ranked best_;
  std::vector<int> seed_;
  // A collected critical path and its length over stages 0..k-1 as cut on
  // the way to the current node (prefix[k]).
  struct Collected {
    Collected(PathBound b, int stages) : bound(std::move(b)), prefix(stages + 1, 0.0) {}
    PathBound bound;
    std::vector<double> prefix;
  };
  // The last to prune first; the one pruning least recently is replaced.
  std::vector<std::unique_ptr<Collected>> paths_;
  struct Simulated {
    long long calls = 0, prunes = 0, skipped = 0;
  };
  std::vector<Simulated> simulated_;  // per depth
  StageCosts costs_;  // simulatedBound's scratch
  std::unique_ptr<MakespanReplay> replay_;  // the schedule's makespan, for simulatedBound
  std::unique_ptr<RoundTripBound> trip_;    // null where it does not apply
};

// The step-time bound of a prefix whose stage j ends at layer e.
// `stage`: stage j's costs; `boundary`: its boundary's transfer.
double PointSearch::bound(int j, int e, const State& next, const StageCost& stage,
                          double boundary, double& terms) {
  double makespan = next.pathBound;
  if (j + 1 < stages_) makespan = std::max(makespan, table_.suffix(stages_ - 1 - j, e));
  makespan = std::max(makespan, next.chain + table_.chain(e, layers_, stages_ - 1 - j));
  if (trip_) makespan = std::max({makespan, next.tripBound, trip_->rest(stages_ - 1 - j, e)});
  double rankBytes = c_.totalParameters / ranks_;
  // The slowest optimizer is at least the average and any rank's known part.
  double optimizer = optimizerSeconds(c_.machine, point_, c_.space.fsdp, rankBytes,
                                      c_.totalTensors / ranks_);
  for (int r = 0; r < ranks_; ++r) {
    makespan = std::max(makespan, next.rankBusy[r]);
    rankBytes = std::max(rankBytes, next.rankBytes[r]);
    optimizer = std::max(optimizer, optimizerSeconds(c_.machine, point_, c_.space.fsdp,
                                                     next.rankBytes[r], next.rankTensors[r]));
  }
  const int world = point_.mesh[0] * point_.mesh[1] * point_.mesh[2];
  const double shared = sharedRanksOf(c_.machine, world) * table_.totalBusy() / ranks_;
  terms = stepTermsBound(c_.machine, point_, rankBytes, optimizer, c_.space.ep);
  double result = std::max(makespan, shared) + terms;
  // The collected paths last, the last to prune first: the loop stops at a
  // prune (the node has no children that would read the later prefixes).
  const double bar = threshold();
  for (size_t p = 0; p < paths_.size(); ++p) {
    Collected& path = *paths_[p];
    path.prefix[j + 1] = path.prefix[j] + path.bound.stage(j, stage, boundary);
    result = std::max(result, path.prefix[j + 1] + path.bound.rest(j + 1, e) + terms);
    if (cannotBeat(result, bar)) {
      std::rotate(paths_.begin(), paths_.begin() + p, paths_.begin() + p + 1);
      break;
    }
  }
  return result;
}

// Stage k whose first layer lies in [first, last] holds that layer: each of
// its costs is at least that of the cheapest single layer there (a stage's
// costs are sums over its layers plus per-action terms; recompute only adds).
StageCost PointSearch::cheapestStage(int k, int first, int last) const {
  StageCost least = model_.stageCost(k, first, first + 1, false);
  for (int l = first + 1; l <= last; ++l) {
    const StageCost c = model_.stageCost(k, l, l + 1, false);
    least.forward = std::min(least.forward, c.forward);
    least.backward = std::min(least.backward, c.backward);
    least.weight = std::min(least.weight, c.weight);
  }
  return least;
}

// The simulator is monotone in every cost: the stages cut so far at their
// costs and the rest at the least any of them can have bound the makespan
// (stage k > j starts at layer e + (k - j - 1) or later, and leaves at least
// one layer to each stage after it); `terms`, the node's bound on the per-step
// terms (bound()), is added to it as bound() adds it to its makespan.
double PointSearch::simulatedBound(int j, int e, double terms, StageCosts& costs) {
  costs.forward.resize(stages_);
  costs.backward.resize(stages_);
  if (model_.splitBackward()) costs.weight.resize(stages_);
  costs.comm.assign(std::max(0, stages_ - 1), 0.0);
  costs.allReduce.assign(stages_, 0.0);
  for (int k = 0; k < stages_; ++k) {
    const StageCost s = k <= j ? model_.stageCost(k, start_[k], start_[k + 1], recompute_[k] != 0)
                               : cheapestStage(k, e + (k - j - 1), layers_ - (stages_ - k));
    costs.forward[k] = s.forward;
    costs.backward[k] = s.backward;
    if (model_.splitBackward()) costs.weight[k] = s.weight;
    if (k < j) costs.comm[k] = model_.commSeconds(start_[k + 1]);
    if (k == j && k + 1 < stages_) costs.comm[k] = model_.commSeconds(e);
    if (k > j && k + 1 < stages_) costs.comm[k] = c_.machine.latencySeconds;
  }
  if (!replay_) replay_ = std::make_unique<MakespanReplay>(model_.schedule(), costs);
  const double makespan = replay_->compiled() ? replay_->makespan(costs) : model_.makespan(costs);
  const int world = point_.mesh[0] * point_.mesh[1] * point_.mesh[2];
  const double shared = sharedRanksOf(c_.machine, world) * table_.totalBusy() / ranks_;
  return std::max(makespan, shared) + terms;
}

// Adds a critical path's bound; the node at depth j has its stages 0..j cut
// (start_). Its length over them is counted without recomputation when the
// search decides it (a later sibling may undo a decision; recompute only adds).
void PointSearch::addPath(const CriticalPath& path, int j) {
  auto added = std::make_unique<Collected>(PathBound(model_, path, layers_), stages_);
  for (int k = 0; k <= j; ++k) {
    const StageCost cost = model_.stageCost(k, start_[k], start_[k + 1],
                                            !searching_ && recompute_[k] != 0);
    const double boundary = k + 1 < stages_ ? model_.commSeconds(start_[k + 1]) : 0.0;
    added->prefix[k + 1] = added->prefix[k] + added->bound.stage(k, cost, boundary);
  }
  if (static_cast<int>(paths_.size()) >= kMaxPaths) paths_.pop_back();
  paths_.insert(paths_.begin(), std::move(added));
}

void PointSearch::descend(int j, const State& state) {
  const int a = state.next;
  const int lastEnd = c_.space.balance.empty() ? layers_ - (stages_ - 1 - j) : a + c_.space.balance[j];
  const int firstEnd = c_.space.balance.empty() ? (j + 1 == stages_ ? layers_ : a + 1) : lastEnd;
  const bool split = model_.splitBackward();
  for (int e = firstEnd; e <= lastEnd; ++e) {
    start_[j] = a;
    start_[j + 1] = e;
    const std::vector<int> saved = recompute_;
    const int rank = model_.rankOf(j);
    // Memory grows with the stage's layers: a rank that cannot fit now never will.
    if (lastStage_[rank] == j && !decideRank(rank, recompute_)) {
      ++c_.pruned;
      recompute_ = saved;
      break;
    }
    State next = state;
    next.next = e;
    const StageCost s = model_.stageCost(j, a, e, recompute_[j] != 0);
    const double busy = point_.microbatches * (s.forward + s.backward + s.weight);
    const double comm = j + 1 < stages_ && model_.rankOf(j + 1) != rank ? model_.commSeconds(e) : 0.0;
    const double own = point_.microbatches * (s.forward + s.backward);
    const double stagePath = split ? std::max(state.head + busy, state.head + state.tail + own)
                                   : state.head + busy + state.tail;
    next.pathBound = std::max(state.pathBound, stagePath);
    // Both only grow with e (the break below).
    const double stageBound = trip_ ? std::max(stagePath, trip_->stage(j, a, e)) : stagePath;
    next.tripBound = std::max(state.tripBound, stageBound);
    next.head += s.forward + comm;
    next.tail += s.backward + comm;
    next.chain += s.forward + s.backward + comm;
    next.rankBusy[rank] = lastStage_[rank] == j ? rankBusy(rank) : state.rankBusy[rank] + busy;
    next.rankBytes[rank] += model_.parameterBytes(a, e);
    next.rankTensors[rank] += model_.parameterTensors(a, e);
    if (bounded_) {
      const double boundary = j + 1 < stages_ ? model_.commSeconds(e) : 0.0;
      double terms = 0.0;  // the prefix's bound on the per-step terms (bound() sets it)
      double here = bound(j, e, next, s, boundary, terms);
      if (!cannotBeat(here, threshold()) && simulating(j)) {
        here = std::max(here, simulatedBound(j, e, terms, costs_));  // the costliest bound: last
        // Where only the simulation prunes, its critical path becomes a
        // cheap bound for the nodes like this one.
        if (cannotBeat(here, threshold())) {
          ++simulated_[j].prunes;
          if (c_.space.balance.empty()) addPath(model_.criticalPath(costs_), j);
        }
      }
      if (cannotBeat(here, threshold())) {
        ++c_.pruned;
        const double alone = stageBound + stepTermsBound(c_.machine, point_, 0.0, 0.0, c_.space.ep);
        recompute_ = saved;
        if (cannotBeat(alone, threshold())) break;  // the stage only grows with e
        continue;
      }
    }
    if (j + 1 == stages_) {
      leaf();
    } else {
      descend(j + 1, next);
    }
    recompute_ = saved;
  }
}

void PointSearch::leaf() {
  std::vector<int> balance(stages_);
  for (int j = 0; j < stages_; ++j) balance[j] = start_[j + 1] - start_[j];
  if (!bounded_ && searching_) {
    // A difference of two windows is not monotone in the costs: every choice.
    for (const auto& recompute : recomputeChoices(point_, model_, c_.space)) {
      ++c_.evaluated;
      consider(ranked(point_, balance, recompute, model_.predict(balance, recompute)));
    }
    return;
  }
  ++c_.evaluated;
  consider(ranked(point_, balance, recompute_, model_.predict(balance, recompute_)));
}

// A point that can matter: its model and its search, kept between the phases.
struct Visited {
  Visited(double b, const SpacePoint& p) : bound(b), point(p) {}
  double bound;
  SpacePoint point;
  std::unique_ptr<PointModel> model;
  std::unique_ptr<PointSearch> search;
  bool seeded = false;
};

// A bound on the per-step terms of every configuration of a point.
double pointTerms(Context& c, const SpacePoint& point) {
  const double rankBytes = c.totalParameters / point.mesh[0];
  return stepTermsBound(
      c.machine, point, rankBytes,
      optimizerSeconds(c.machine, point, c.space.fsdp, rankBytes, c.totalTensors / point.mesh[0]),
      c.space.ep);
}

// The bound of a point before its schedule is built.
double pointBound(Context& c, const SpacePoint& point) {
  const ScheduleTraits& traits = scheduleTraits(point.schedule);
  const double terms = pointTerms(c, point);
  if (traits.asynchronous) return terms;
  WorkTable& table = c.table(point, traits.splitBackward);
  const int stages = point.stages();
  const int layers = static_cast<int>(c.layers.size());
  double makespan = std::max(table.chain(0, layers, stages), table.totalBusy() / point.mesh[0]);
  if (c.space.balance.empty()) makespan = std::max(makespan, table.suffix(stages, 0));
  const int world = point.mesh[0] * point.mesh[1] * point.mesh[2];
  const double shared = sharedRanksOf(c.machine, world) * table.totalBusy() / point.mesh[0];
  return std::max(makespan, shared) + terms;
}

}  // namespace

SearchResult searchConfigurations(const std::vector<LayerCost>& layers,
                                  const MachineCosts& machine, const SearchSpace& space) {
  checkSpace(layers, machine, space);
  Context c{layers, machine, space, {}, 0.0, 0, 0};
  for (const LayerCost& l : layers) {
    c.totalParameters += heldParameterBytes(l, space.ep, space.fsdp);
    c.totalTensors += l.parameterTensors;
  }
  std::vector<std::pair<double, SpacePoint>> points;
  for (const SpacePoint& p : spacePoints(layers, space)) points.push_back({pointBound(c, p), p});
  std::stable_sort(points.begin(), points.end(),
                   [](const auto& x, const auto& y) { return x.first < y.first; });
  // Phase 1, by bound: every point that can matter scores its min-max balance
  // (its seed). The (candidates + 1)-th smallest seed of the other points bounds
  // what a point's best must beat to be the best or a runner-up.
  Standings seeds(space.candidates);
  std::vector<std::unique_ptr<Visited>> visited;
  Ranked fallback;
  bool anyFallback = false, anyBuilt = false;
  std::string refusal;
  for (const auto& [bound, point] : points) {
    if (cannotBeat(bound, seeds.bar())) {
      ++c.pruned;
      continue;
    }
    auto v = std::make_unique<Visited>(bound, point);
    try {
      v->model = std::make_unique<PointModel>(layers, space.batchSize, machine, pointOptions(point, space));
    } catch (const std::invalid_argument& e) {
      if (refusal.empty()) refusal = e.what();
      continue;
    }
    anyBuilt = true;
    v->search = std::make_unique<PointSearch>(c, v->point, *v->model);
    // With its schedule the point may have a better bound: then it is not seeded.
    v->bound = std::max(v->bound, v->search->rootMakespan() + pointTerms(c, point));
    if (cannotBeat(v->bound, seeds.bar())) {
      ++c.pruned;
      continue;
    }
    v->seeded = v->search->seed(fallback, anyFallback);
    if (v->seeded) seeds.add(v->search->seedStep());
    visited.push_back(std::move(v));
  }
  // Phase 2, the best seeds first: branch and bound inside each point.
  std::stable_sort(visited.begin(), visited.end(), [](const auto& x, const auto& y) {
    return x->seeded != y->seeded ? x->seeded : x->seeded && x->search->seedStep() < y->search->seedStep();
  });
  Standings standings(space.candidates);
  std::vector<Ranked> pointBests;
  for (auto& v : visited) {
    // The bar may count the point's own seed: then its seed is already at
    // least as good as the bar, and the point keeps it.
    const double bar = std::min(standings.bar(), seeds.bar());
    bool found = v->seeded;
    if (cannotBeat(v->bound, bar)) {
      ++c.pruned;
    } else {
      found = v->search->search(bar);
    }
    // A seeded point keeps at least its seed: the other points' bars counted it.
    if (found) {
      standings.add(v->search->best().config.prediction.stepSeconds);
      pointBests.push_back(std::move(v->search->best()));
    }
    v.reset();
  }
  if (!anyBuilt && pointBests.empty()) {
    throw std::invalid_argument(
        "no configuration of the space can run: every (mesh, schedule, chunks, microbatches) "
        "needs more stages than the " + std::to_string(layers.size()) +
        " layers, does not match the fixed balance or recompute list, or the schedule refuses it" +
        (refusal.empty() ? std::string() : " (" + refusal + ")"));
  }
  if (pointBests.empty()) pointBests.push_back(fallback);
  return resultOf(std::move(pointBests), space.candidates, c.evaluated, c.pruned, space.ep);
}

}  // namespace pipedream
