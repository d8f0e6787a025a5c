// Discrete-event simulator of a schedule's per-rank action lists.
//
// Model (the contract the runtime follows too):
//   - each rank runs its list strictly in order, one action at a time;
//   - F/B/I/W take the stage's cost; U takes no time;
//   - SEND_* takes no rank time (asynchronous); its data reaches the peer
//     t_comm(boundary) later; RECV_* only posts the receive (no time, no
//     wait) and the consumer (F, B or I) waits until the data is there;
//   - an un-lowered (compute-only) schedule is simulated with the same
//     latencies applied directly between producer and consumer;
//   - ALLREDUCE is a collective of all replicas of a stage: it starts when
//     every replica has reached it and takes t_allreduce(stage);
//   - if no rank can make progress before all lists are done, the schedule
//     deadlocks and simulate() throws DeadlockError.
//
// Costs: with `weight` empty the backward is not split: B costs backward[j]
// and I, W cost backward[j]/2 each. With `weight` given, I costs backward[j],
// W costs weight[j] and B costs backward[j] + weight[j] (the zero-bubble
// paper's T_B and T_W).
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "schedule.h"

namespace pipedream {

struct StageCosts {
  std::vector<double> forward;    // per stage
  std::vector<double> backward;   // per stage (see above)
  std::vector<double> weight;     // per stage, or empty: backward not split
  std::vector<double> comm;       // per boundary j -> j+1 (stages - 1 entries)
  std::vector<double> allReduce;  // per stage

  // The same costs for every stage; tW < 0 means "not split".
  static StageCosts uniform(int stages, double tF, double tB, double tW, double tComm,
                            double tAllReduce = 0.0);
  // Throws std::invalid_argument unless sizes match `stages` and all costs
  // are finite and >= 0.
  void check(int stages) const;
};

struct TimedAction {
  int rank = 0;
  int step = 0;  // position in the rank's list
  Action action;
  double start = 0.0;
  double end = 0.0;
};

struct SimulationResult {
  double makespan = 0.0;
  // 1 - (compute time of all ranks) / (ranks * makespan).
  double bubbleFraction = 0.0;
  std::vector<double> bubbleFractionPerRank;
  std::vector<double> busyTimePerRank;  // F/B/I/W time per rank
  // Microbatches between F and the end of B (or I when split): their full
  // activations are stashed. Peak over the list order, per stage (max over
  // its replicas) and per rank (summed over the stages a rank holds).
  std::vector<int> peakActivations;
  std::vector<int> peakActivationsPerRank;
  // Microbatches between I and W (zero-bubble): only the small stash a
  // weight gradient needs (layer inputs and output gradients).
  std::vector<int> peakDeferredWeightGrads;
  // Distinct weight versions a stage must keep: versions read by its
  // in-flight microbatches, its current version, and every version from the
  // one its next forward reads up to the current one (vertical sync reads
  // old versions later); peak per stage.
  std::vector<int> peakWeightVersions;
  std::vector<TimedAction> timeline;  // in execution order
};

class DeadlockError : public std::invalid_argument {
 public:
  DeadlockError(const std::string& message, int rank, int step)
      : std::invalid_argument(message), rank_(rank), step_(step) {}
  int rank() const { return rank_; }  // first blocked rank
  int step() const { return step_; }  // its blocked step

 private:
  int rank_;
  int step_;
};

// The rank time an action of `kind` on `stage` takes under `costs` (the rule
// above: F, B, I, W; every other kind takes none). Shared with the makespan
// replay (replay.h), which must charge exactly what the simulator does.
inline double actionCost(ActionKind kind, int stage, const StageCosts& costs) {
  const bool split = !costs.weight.empty();
  switch (kind) {
    case ActionKind::kForward: return costs.forward[stage];
    case ActionKind::kBackward:
      return split ? costs.backward[stage] + costs.weight[stage] : costs.backward[stage];
    case ActionKind::kBackwardInput:
      return split ? costs.backward[stage] : costs.backward[stage] / 2;
    case ActionKind::kBackwardWeight:
      return split ? costs.weight[stage] : costs.backward[stage] / 2;
    default: return 0.0;
  }
}

SimulationResult simulate(const Schedule& schedule, const StageCosts& costs);

// What a simulation records beyond makespan, busy times and bubbles: all of
// it (simulate() above), or less for the passes that need only a deadlock
// check (validate()) or the send times (orderTransfers()).
enum class Recording {
  kFull,       // the timeline of every action and the memory figures
  kSendsOnly,  // the timeline's SEND actions; no memory figures
  kNone,       // no timeline, no memory figures
};
SimulationResult simulate(const Schedule& schedule, const StageCosts& costs, Recording recording);

// Peak in-flight activations / weight versions from list order alone (no
// timing). Filled into SimulationResult by simulate() as well.
void computeMemoryFigures(const Schedule& schedule, SimulationResult& result);

// Chrome trace (chrome://tracing, Perfetto): one thread per rank, one
// complete event per action with stage, microbatch and version in args.
std::string toChromeTrace(const Schedule& schedule, const SimulationResult& result);

}  // namespace pipedream
