// The cost model of configure.h for one point of the search space (schedule,
// chunks, microbatches, mesh, replicas): the schedule is built once and every
// (balance, recompute) scored against it. Shared by predictConfiguration,
// enumerateConfigurations and searchConfigurations, so all three compute
// bit-identical predictions. Internal to csrc/core.
#pragma once

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "configure.h"
#include "schedule.h"
#include "simulate.h"
#include "traits.h"

namespace pipedream {

// What configure*.cpp's checks share to word their errors.
namespace configure_detail {

[[noreturn]] inline void fail(const std::string& message) {
  throw std::invalid_argument(message);
}

inline std::string joined(const std::vector<int>& values) {
  std::string out = "[";
  for (size_t k = 0; k < values.size(); ++k) {
    out += (k ? ", " : "") + std::to_string(values[k]);
  }
  return out + "]";
}

}  // namespace configure_detail

// Throw std::invalid_argument naming the bad value.
void checkLayers(const std::vector<LayerCost>& layers);
void checkMachine(const MachineCosts& machine);

// The optimizer's step a rank holding `bytes` of parameters in `tensors`
// tensors pays by the machine's per-byte and per-tensor costs (its bytes
// divided by tp, and by dp under FSDP); the layers' measured optimizerSeconds
// come on top. The prediction and the search's bounds both use it.
double estimatedOptimizerSeconds(const MachineCosts& machine, double bytes, double tensors,
                                 int tp, int dp, bool fsdp);
void checkMemoryArguments(double memoryBytes, double optimizerStateFactor);
// ep >= 1 dividing dp (the copies), and not with tp.
void checkExpertParallel(int ep, int dp, int tp);
// What one rank holds of a layer's parameters before FSDP's and tp's division:
// the dense part whole, its experts 1 / ep (under FSDP whole: FSDP's 1 / dp then
// covers the ep shards too).
double heldParameterBytes(const LayerCost& c, int ep, bool fsdp);

struct PointOptions {
  std::string schedule;
  int chunks = 1;
  int microbatches = 1;
  int pp = 1, dp = 1, tp = 1;
  int ep = 1;  // divides dp (SearchSpace::ep, Configuration::ep)
  std::vector<int> replicas;  // empty: 1 each
  double memoryBytes = 0.0;
  double optimizerStateFactor = 2.0;
  bool fsdp = false;
};

PointOptions pointOptions(const Configuration& config, double memoryBytes,
                          double optimizerStateFactor, bool fsdp);

// A count vector a rank's list passes through: in-flight and deferred
// microbatches of each stage it holds (2 entries per stage), taken just before
// a backward of its stage `backwardOf` (or after any action: -1).
struct MemoryPoint {
  int backwardOf = -1;
  std::vector<int> counts;
};

// One stage's action costs as the simulator takes them (simulate.h): F, B
// (I when split) and W (0 unless split).
struct StageCost {
  double forward = 0.0;
  double backward = 0.0;
  double weight = 0.0;
};

// How often each stage's F, B (I), W and boundary transfer lie on a critical
// path of the schedule: the path's length is their dot product with any
// costs, a lower bound on the makespan for every balance (the dependencies do
// not depend on the costs).
struct CriticalPath {
  std::vector<double> forward, backward, weight, comm;  // per stage (comm: per boundary)
};

class PointModel {
 public:
  // Throws std::invalid_argument when the schedule refuses the point.
  PointModel(const std::vector<LayerCost>& layers, int batchSize, const MachineCosts& machine,
             const PointOptions& options);

  int stages() const { return stages_; }
  int ranks() const { return ranks_; }
  int samples() const { return samples_; }
  const std::vector<int>& rankStages(int rank) const { return rankStages_[rank]; }
  // The first rank holding stage j.
  int rankOf(int stage) const { return firstRank_[stage]; }

  // The prediction for `balance` (layers per stage) and `recompute` (0/1 per
  // stage, or empty: none); arguments are not checked.
  Prediction predict(const std::vector<int>& balance, const std::vector<int>& recompute) const;
  // Rank r's peak bytes, `start` the stages' first layers (stages + 1 entries).
  double peakBytes(int rank, const std::vector<int>& start, const std::vector<int>& recompute) const;
  std::vector<int> starts(const std::vector<int>& balance) const;
  StageCosts stageCosts(const std::vector<int>& start, const std::vector<int>& recompute) const;
  // Stage j holding layers [a, e).
  StageCost stageCost(int j, int a, int e, bool recompute) const;
  // The transfer of a boundary after layer e - 1 (when it crosses ranks).
  double commSeconds(int e) const;
  // The sender's time to post what crosses after layer l (forward) or the
  // gradient of layer l's input (backward).
  double postSeconds(int l, bool forward) const;
  double parameterBytes(int a, int e) const;
  double parameterTensors(int a, int e) const;
  bool splitBackward() const { return split_; }
  bool asynchronous() const { return asynchronous_; }
  bool sendsForward(int stage) const;
  bool sendsBackward(int stage) const;
  // The simulated makespan of a flush schedule for per-stage costs.
  double makespan(const StageCosts& costs) const;
  // The schedule makespan() simulates.
  const Schedule& schedule() const { return schedules_.front(); }
  // The critical path of the simulated flush schedule at `balance`.
  CriticalPath criticalPath(const std::vector<int>& balance, const std::vector<int>& recompute) const;
  // The same for any per-stage costs of the flush schedule (a chain of its
  // dependencies, so a lower bound on the makespan at every cost).
  CriticalPath criticalPath(const StageCosts& costs) const;
  // 0 when ranks do not share cores, else ranks per core of a node.
  double sharedRanks() const;

 private:
  struct Sums;
  void buildSchedules(const ScheduleTraits& traits);
  void buildMemoryShapes(const Schedule& schedule);
  void countSends();
  struct Transients {
    double backward = 0.0;          // working memory of the largest layer's backward
    double largestParameter = 0.0;  // bytes of the largest parameter tensor
  };
  Transients transients(int a, int e) const;
  double stateBytes(int rank, const std::vector<int>& start) const;
  // Fills p's overhead and all-reduce terms, and each rank's optimizer step.
  void stepTerms(const std::vector<int>& start, Prediction& p, std::vector<double>& optimizer) const;
  double collectiveCalls(double stages, double units) const;
  struct SendCount {
    int stage = 0;
    double forward = 0.0, backward = 0.0;  // sends per step
  };

  const std::vector<LayerCost>& layers_;
  MachineCosts machine_;
  PointOptions options_;
  std::shared_ptr<Sums> sums_;
  bool asynchronous_ = false;
  bool split_ = false;
  int samples_ = 1;         // b: samples of the largest microbatch
  double stepScale_ = 1.0;  // steps per simulated window difference, inverted
  int stages_ = 0;
  int ranks_ = 0;
  std::vector<Schedule> schedules_;  // one, or two windows for an asynchronous schedule
  std::vector<int> firstRank_;
  std::vector<int> replicaCounts_;
  std::vector<int> versions_;  // weight versions per stage
  std::vector<std::vector<int>> rankStages_;
  std::vector<std::vector<MemoryPoint>> shapes_;
  std::vector<std::vector<SendCount>> sendCounts_;  // per rank, one per stage it holds
};

}  // namespace pipedream
