// PathBound: a critical path of a flush schedule as a lower bound on the
// makespan of every balance, for the configuration search's branch and bound
// (configure_search.cpp). Internal to csrc/core.
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>
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

}  // namespace pipedream
