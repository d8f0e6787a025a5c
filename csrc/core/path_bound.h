// PathBound: a critical path of a flush schedule as a lower bound on the
// makespan of every balance; RoundTripBound: every stage's chains through the
// other stages, as a min-max over the cuts (MinMaxCuts, which the search's
// per-stage work bound shares); all for the configuration
// search's branch and bound (configure_search.cpp). Internal to csrc/core.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "configure_model.h"

namespace pipedream {

// A critical path of the schedule (a chain of its dependencies: each action
// starts after the one before it on its rank, or after the data it waits for
// and its transfer) is a lower bound on the makespan at EVERY balance, since
// the simulator runs each rank's list in a fixed order whatever the costs:
// its length is the dot product of how often each stage's F, B (I), W and
// boundary transfer lie on it with their costs, all nonnegative. So for a
// prefix of the stages cut, its length over those stages plus the least, over
// the cuts of the remaining layers, of its length over the remaining stages
// (dynamic programming over (stage, first layer)) never exceeds the makespan
// of any completion: the least over completions of one path's length is at
// most that of the longest path of each. The remaining stages are costed
// without recomputation, which only adds to B (I).
class PathBound {
 public:
  PathBound(const PointModel& model, CriticalPath path, int layers)
      : path_(std::move(path)), stages_(model.stages()), layers_(layers),
        rest_(static_cast<size_t>(stages_ + 1) * (layers_ + 1), kNone) {
    rest_[at(stages_, layers_)] = 0.0;
    for (int k = stages_ - 1; k >= 0; --k) {
      const bool hasComm = k + 1 < stages_ && path_.comm[k] > 0;
      for (int a = k; a < layers_; ++a) {
        double best = kNone;
        for (int e = a + 1; e <= layers_ - (stages_ - 1 - k); ++e) {
          const double after = rest_[at(k + 1, e)];
          if (after == kNone) continue;
          const double comm = hasComm ? model.commSeconds(e) : 0.0;
          best = std::min(best, stage(k, model.stageCost(k, a, e, false), comm) + after);
        }
        rest_[at(k, a)] = best;
      }
    }
  }

  // Stage k's share of the path's length at costs `c`, `comm` its boundary's transfer.
  double stage(int k, const StageCost& c, double comm) const {
    double length = path_.forward[k] * c.forward + path_.backward[k] * c.backward +
                    path_.weight[k] * c.weight;
    if (k + 1 < stages_) length += path_.comm[k] * comm;
    return length;
  }
  // The least share of stages k.. cut from layers [a, L) (infinite: no such cut).
  double rest(int k, int a) const { return rest_[at(k, a)]; }

 private:
  static constexpr double kNone = std::numeric_limits<double>::infinity();
  size_t at(int k, int a) const { return static_cast<size_t>(k) * (layers_ + 1) + a; }

  CriticalPath path_;
  int stages_, layers_;
  std::vector<double> rest_;
};

// The least, over the cuts of layers [a, L) into the last s of `stages`
// stages, of the largest stage cost: cost(k, a, e) for stage k holding layers
// [a, e), which must never shrink as e grows (the scan over e stops at the
// first cut whose own stage costs no less than the best found). Rows by s are
// built on first use and kept; `cost` must be the same function at every call.
class MinMaxCuts {
 public:
  MinMaxCuts(int layers, int stages) : layers_(layers), stages_(stages) {}

  // Infinite when layers [a, L) cannot be cut into s stages.
  template <typename Cost>
  double rest(int s, int a, const Cost& cost) {
    if (s == 0) return a == layers_ ? 0.0 : std::numeric_limits<double>::infinity();
    while (static_cast<int>(table_.size()) <= s) extend(cost);
    return table_[s][a];
  }

 private:
  template <typename Cost>
  void extend(const Cost& cost) {
    const double inf = std::numeric_limits<double>::infinity();
    const int size = static_cast<int>(table_.size());
    std::vector<double> row(layers_ + 1, inf);
    if (size == 0) row[layers_] = 0.0;
    const int k = stages_ - size;  // the stage this row's first cut makes
    for (int a = 0; size > 0 && a < layers_; ++a) {
      if (size == 1) {
        row[a] = cost(k, a, layers_);
        continue;
      }
      double best = inf;
      for (int e = a + 1; e <= layers_ - (size - 1); ++e) {
        const double here = cost(k, a, e);
        if (here >= best) break;  // later cuts only make this stage costlier
        best = std::min(best, std::max(here, table_[size - 1][e]));
      }
      row[a] = best;
    }
    table_.push_back(std::move(row));
  }

  int layers_, stages_;
  std::vector<std::vector<double>> table_;  // rest(s, a) by s
};

// A lower bound on the makespan of a flush schedule with one stage per rank,
// for every balance, as the least over the cuts of the largest of per-stage
// terms Q(k, a, e) (stage k holding layers [a, e)): a min-max dynamic program
// like the search's WorkTable, but each term follows stage k's own list.
//
// Admissibility. The simulator runs each rank's list in order: an action
// starts at or after the end of the one before it on its rank and of the
// actions it waits for (plus the boundary's transfer between ranks), so any
// chain of such dependencies bounds the makespan from below by the sum of
// its costs. Stage k's rank (a different rank from every other stage's, so
// every boundary is a transfer, at least the least commSeconds of any layer)
// has these chains, each with its own cost counts (cF, cB, cW) of stage k:
//   - head: the rank's first action is a forward F(i), after F(i) of every
//     earlier stage: at least the forwards of layers [0, a), k action
//     overheads and k transfers;
//   - then the rank's list up to the end (T0), or up to its last backward
//     (B or I) X of microbatch x, after which x's backwards through the
//     earlier stages follow (tail: their input gradients, overheads and
//     transfers; T1);
//   - or, for a microbatch i, the list up to F(i), then i's forwards and
//     backwards (input gradients) through every later stage and back (its
//     round trip: the layers [e, L) at least, 2 (S - 1 - k) overheads and
//     transfers), then the list from i's backward to the end (R0) or to X
//     and the tail (R1).
// Stage k's costs are at least its layers' sums plus one action overhead
// each and the time to post its sends (a forward's: the least over the cuts,
// a backward's: its first layer's; tp collectives and recomputation only add),
// and the other stages' at least theirs (each posting at least the least any
// cut can: the forwards of stages 0..S-2 and the backwards of 1..S-1 send):
// so Q(k, a, e), the largest chain at those
// least costs, is at most the makespan of every balance cutting stage k at
// [a, e), and the largest Q of a balance's stages is too. Q never shrinks as
// e grows: the counts are nonnegative and a chain through the round trip
// counts F(i) and its backward, so a layer moving from the later stages into
// stage k costs it at least as much. Disabled (enabled() false) for other
// schedules: several stages on a rank, collectives in the lists, or
// backwards the search's costs do not charge as B or I.
class RoundTripBound {
 public:
  RoundTripBound(const PointModel& model, const std::vector<LayerCost>& layers,
                 double actionSeconds, int tp);

  bool enabled() const { return enabled_; }
  // Q(k, a, e): a bound on the makespan of every balance cutting stage k at [a, e).
  double stage(int k, int a, int e) const;
  // The least, over the cuts of layers [a, L) into the last s stages, of their
  // largest Q (infinite: no such cut).
  double rest(int s, int a);

 private:
  using Counts = std::array<double, 3>;  // F, B (I), W of stage k
  struct Family {
    bool tail = false, trip = false;
    std::vector<Counts> counts;  // none dominated by another
  };
  bool readLists(const PointModel& model);

  bool enabled_ = false;
  bool split_ = false;
  int stages_ = 0, layers_ = 0;
  double act_ = 0.0, comm_ = 0.0;
  // The least time any stage's forward takes to post its send, a backward's
  // with its first layer at a (postBackward_[a]) and the least of those.
  double postForward_ = 0.0, postInput_ = 0.0;
  std::vector<double> postBackward_;
  std::vector<double> forward_, input_, weight_;  // prefix sums per microbatch
  std::vector<std::vector<Family>> families_;     // per stage
  MinMaxCuts cuts_;                                // rest(s, a)
};

}  // namespace pipedream
