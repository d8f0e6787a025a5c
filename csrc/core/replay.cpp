#include "replay.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace pipedream {

MakespanReplay::MakespanReplay(const Schedule& schedule, const StageCosts& costs)
    : stages_(schedule.numStages()), ranks_(schedule.numRanks()), split_(!costs.weight.empty()) {
  const int total = schedule.totalMicrobatches();
  const Layout& layout = schedule.layout();
  const bool lowered = schedule.isLowered();
  const SimulationResult run = simulate(schedule, costs, Recording::kFull);
  // Per (stage, microbatch): the op that ended its forward, its gradient, its sends.
  const size_t slots = static_cast<size_t>(stages_) * total;
  std::vector<int> forwardDone(slots, -1), gradDone(slots, -1), sentForward(slots, -1),
      sentBackward(slots, -1);
  const auto at = [total](int j, int i) { return static_cast<size_t>(j) * total + i; };
  for (const TimedAction& t : run.timeline) {
    const Action& a = t.action;
    const int j = a.stage, i = a.microbatch;
    if (a.kind == ActionKind::kAllReduce) {
      ops_.clear();
      return;
    }
    if (a.kind == ActionKind::kRecvForward || a.kind == ActionKind::kRecvBackward ||
        a.kind == ActionKind::kUpdate) {
      continue;  // no time, and nothing waits for when it happened
    }
    Op op;
    op.rank = t.rank;
    const int self = static_cast<int>(ops_.size());
    // A neighbour's data: handed over on the same rank, or sent and carried
    // over a boundary (a compute-only schedule carries it straight from the producer).
    const auto neighbour = [&](int n, const std::vector<int>& produced, const std::vector<int>& sent,
                               int boundary) {
      const bool same = layout.rankFor(n, i) == t.rank;
      op.data = same || !lowered ? produced[at(n, i)] : sent[at(n, i)];
      op.comm = same ? -1 : boundary;
    };
    switch (a.kind) {
      case ActionKind::kForward:
        op.cost = j;
        if (j > 0) neighbour(j - 1, forwardDone, sentForward, j - 1);
        forwardDone[at(j, i)] = self;
        break;
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput:
        op.cost = (a.kind == ActionKind::kBackward ? 1 : 2) * stages_ + j;
        op.own = forwardDone[at(j, i)];
        if (j + 1 < stages_) neighbour(j + 1, gradDone, sentBackward, j);
        gradDone[at(j, i)] = self;
        break;
      case ActionKind::kBackwardWeight:
        op.cost = 3 * stages_ + j;
        op.own = gradDone[at(j, i)];
        break;
      case ActionKind::kSendForward:
        op.own = forwardDone[at(j, i)];
        sentForward[at(j, i)] = self;
        break;
      case ActionKind::kSendBackward:
        op.own = gradDone[at(j, i)];
        sentBackward[at(j, i)] = self;
        break;
      default: break;
    }
    ops_.push_back(op);
  }
  compiled_ = true;
  end_.resize(ops_.size());
}

double MakespanReplay::makespan(const StageCosts& costs) const {
  if (!compiled_) throw std::invalid_argument("MakespanReplay: the schedule holds collectives");
  if (static_cast<int>(costs.forward.size()) != stages_ ||
      static_cast<int>(costs.backward.size()) != stages_ ||
      static_cast<int>(costs.comm.size()) != std::max(0, stages_ - 1) ||
      (split_ ? static_cast<int>(costs.weight.size()) != stages_ : !costs.weight.empty())) {
    throw std::invalid_argument("MakespanReplay: costs for " + std::to_string(stages_) +
                                " stages of the shape compiled with (split backward: " +
                                (split_ ? "yes" : "no") + ") expected");
  }
  // F, B, I, W per stage as simulate() charges them (the op's `cost` index).
  static constexpr ActionKind kCharged[] = {ActionKind::kForward, ActionKind::kBackward,
                                            ActionKind::kBackwardInput, ActionKind::kBackwardWeight};
  cost_.assign(4 * static_cast<size_t>(stages_), 0.0);
  for (int k = 0; k < 4; ++k) {
    for (int j = 0; j < stages_; ++j) cost_[k * stages_ + j] = actionCost(kCharged[k], j, costs);
  }
  free_.assign(ranks_, 0.0);
  for (size_t k = 0; k < ops_.size(); ++k) {
    const Op& op = ops_[k];
    double t = free_[op.rank];
    if (op.own >= 0) t = std::max(t, end_[op.own]);
    if (op.data >= 0) {
      t = std::max(t, op.comm < 0 ? end_[op.data] : end_[op.data] + costs.comm[op.comm]);
    }
    end_[k] = op.cost < 0 ? t : t + cost_[op.cost];
    free_[op.rank] = end_[k];
  }
  double makespan = 0.0;
  for (double t : free_) makespan = std::max(makespan, t);
  return makespan;
}

}  // namespace pipedream
