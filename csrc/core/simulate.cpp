#include "simulate.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <sstream>

namespace pipedream {

namespace {

constexpr double kUnset = -1.0;

std::string str(int value) { return std::to_string(value); }

// Times indexed by (stage, microbatch).
class EventTable {
 public:
  EventTable(int stages, int microbatches)
      : microbatches_(microbatches), times_(static_cast<size_t>(stages) * microbatches, kUnset) {}
  double get(int stage, int microbatch) const { return times_[index(stage, microbatch)]; }
  bool has(int stage, int microbatch) const { return get(stage, microbatch) != kUnset; }
  void set(int stage, int microbatch, double t) { times_[index(stage, microbatch)] = t; }

 private:
  size_t index(int stage, int microbatch) const {
    return static_cast<size_t>(stage) * microbatches_ + microbatch;
  }
  int microbatches_;
  std::vector<double> times_;
};

}  // namespace

StageCosts StageCosts::uniform(int stages, double tF, double tB, double tW, double tComm,
                               double tAllReduce) {
  StageCosts costs;
  costs.forward.assign(stages, tF);
  costs.backward.assign(stages, tB);
  if (tW >= 0) costs.weight.assign(stages, tW);
  costs.comm.assign(std::max(0, stages - 1), tComm);
  costs.allReduce.assign(stages, tAllReduce);
  return costs;
}

void StageCosts::check(int stages) const {
  auto checkList = [&](const std::vector<double>& values, size_t expected, const char* name) {
    if (values.size() != expected) {
      throw std::invalid_argument(std::string(name) + " lists " + str(values.size()) +
                                  " costs but the schedule needs " + str(expected) +
                                  " (one per " + (std::string(name) == "t_comm" ? "boundary" : "stage") +
                                  "); pass a single number or a list of that length");
    }
    for (double value : values) {
      if (!std::isfinite(value) || value < 0) {
        throw std::invalid_argument(std::string(name) + " must be finite and >= 0 (got " +
                                    std::to_string(value) + ")");
      }
    }
  };
  checkList(forward, stages, "t_f");
  checkList(backward, stages, "t_b");
  if (!weight.empty()) checkList(weight, stages, "t_w");
  checkList(comm, std::max(0, stages - 1), "t_comm");
  checkList(allReduce, stages, "t_allreduce");
}

void computeMemoryFigures(const Schedule& schedule, SimulationResult& result) {
  const int stages = schedule.numStages();
  result.peakActivations.assign(stages, 0);
  result.peakWeightVersions.assign(stages, 0);
  result.peakDeferredWeightGrads.assign(stages, 0);
  result.peakActivationsPerRank.assign(schedule.numRanks(), 0);
  for (int r = 0; r < schedule.numRanks(); ++r) {
    const auto& list = schedule.actions(r);
    // oldestFutureRead[k][j]: the version the next forward of stage j after
    // position k reads (forwards read non-decreasing versions); every version
    // from there up to the current one must be kept (vertical sync reads old
    // versions later).
    std::vector<std::vector<int>> oldestFutureRead(list.size() + 1, std::vector<int>(stages, INT_MAX));
    for (size_t k = list.size(); k-- > 0;) {
      oldestFutureRead[k] = oldestFutureRead[k + 1];
      const Action& a = list[k];
      if (a.kind == ActionKind::kForward && a.stage >= 0 && a.stage < stages) {
        oldestFutureRead[k][a.stage] = a.version;
      }
    }
    std::vector<int> inFlight(stages, 0), deferred(stages, 0);
    std::vector<int> current(stages, 0);
    std::vector<std::map<int, int>> readers(stages);  // version -> in-flight count
    int rankInFlight = 0;
    auto liveVersions = [&](int j, size_t k) {
      std::set<int> live;
      for (int v = std::max(0, oldestFutureRead[k + 1][j]); v <= current[j]; ++v) live.insert(v);
      live.insert(current[j]);
      for (const auto& [version, count] : readers[j]) {
        if (count > 0) live.insert(version);
      }
      return static_cast<int>(live.size());
    };
    for (const auto& layoutStage : schedule.layout().stagesOfRank(r)) {
      result.peakWeightVersions[layoutStage] = std::max(result.peakWeightVersions[layoutStage], 1);
    }
    for (size_t k = 0; k < list.size(); ++k) {
      const Action& a = list[k];
      const int j = a.stage;
      if (j < 0 || j >= stages) continue;
      if (a.kind == ActionKind::kForward) {
        ++inFlight[j];
        ++rankInFlight;
        ++readers[j][a.version];
      } else if (a.kind == ActionKind::kBackward) {
        --inFlight[j];
        --rankInFlight;
        --readers[j][a.version];
      } else if (a.kind == ActionKind::kBackwardInput) {
        --inFlight[j];
        --rankInFlight;
        ++deferred[j];
      } else if (a.kind == ActionKind::kBackwardWeight) {
        --deferred[j];
        --readers[j][a.version];
      } else if (a.kind == ActionKind::kUpdate) {
        current[j] = a.version;
      } else {
        continue;
      }
      result.peakActivations[j] = std::max(result.peakActivations[j], inFlight[j]);
      result.peakDeferredWeightGrads[j] = std::max(result.peakDeferredWeightGrads[j], deferred[j]);
      result.peakActivationsPerRank[r] = std::max(result.peakActivationsPerRank[r], rankInFlight);
      result.peakWeightVersions[j] = std::max(result.peakWeightVersions[j], liveVersions(j, k));
    }
  }
}

SimulationResult simulate(const Schedule& schedule, const StageCosts& costs) {
  const Layout& layout = schedule.layout();
  const int stages = schedule.numStages();
  const int ranks = schedule.numRanks();
  const int total = schedule.totalMicrobatches();
  costs.check(stages);
  const bool lowered = schedule.isLowered();
  const bool split = !costs.weight.empty();

  auto costOf = [&](const Action& a) -> double {
    switch (a.kind) {
      case ActionKind::kForward: return costs.forward[a.stage];
      case ActionKind::kBackward:
        return split ? costs.backward[a.stage] + costs.weight[a.stage] : costs.backward[a.stage];
      case ActionKind::kBackwardInput:
        return split ? costs.backward[a.stage] : costs.backward[a.stage] / 2;
      case ActionKind::kBackwardWeight:
        return split ? costs.weight[a.stage] : costs.backward[a.stage] / 2;
      default: return 0.0;
    }
  };

  EventTable forwardDone(stages, total), gradDone(stages, total);
  EventTable sentForward(stages, total), sentBackward(stages, total);
  EventTable recvForward(stages, total), recvBackward(stages, total);
  std::vector<size_t> next(ranks, 0);
  std::vector<double> freeAt(ranks, 0.0);
  SimulationResult result;
  result.busyTimePerRank.assign(ranks, 0.0);

  auto inRange = [&](const Action& a) {
    return a.stage >= 0 && a.stage < stages &&
           (isVersionOnly(a.kind) || (a.microbatch >= 0 && a.microbatch < total));
  };

  // Returns the earliest start of rank r's next action, or kUnset if a
  // dependency has not happened yet.
  auto readyTime = [&](int r, const Action& a) -> double {
    double t = freeAt[r];
    const int j = a.stage;
    const int i = a.microbatch;
    // The data of transfer (neighbour -> j): the same rank hands it over; a
    // lowered schedule needs its RECV posted and waits for the data's arrival
    // (sent + latency); a compute-only one applies the latency directly.
    auto needNeighbour = [&](int neighbour, const EventTable& produced, const EventTable& sent,
                             const EventTable& posted, double latency) -> double {
      if (layout.rankFor(neighbour, i) == r || !lowered) {
        if (!produced.has(neighbour, i)) return kUnset;
        const double extra = layout.rankFor(neighbour, i) == r ? 0.0 : latency;
        return std::max(t, produced.get(neighbour, i) + extra);
      }
      if (!posted.has(j, i) || !sent.has(neighbour, i)) return kUnset;
      return std::max(t, sent.get(neighbour, i) + latency);
    };
    switch (a.kind) {
      case ActionKind::kForward:
        if (j == 0) return t;
        return needNeighbour(j - 1, forwardDone, sentForward, recvForward, costs.comm[j - 1]);
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput:
        if (!forwardDone.has(j, i)) return kUnset;
        t = std::max(t, forwardDone.get(j, i));
        if (j == stages - 1) return t;
        return needNeighbour(j + 1, gradDone, sentBackward, recvBackward, costs.comm[j]);
      case ActionKind::kBackwardWeight:
        if (!gradDone.has(j, i)) return kUnset;
        return std::max(t, gradDone.get(j, i));
      case ActionKind::kSendForward:
        if (!forwardDone.has(j, i)) return kUnset;
        return std::max(t, forwardDone.get(j, i));
      case ActionKind::kSendBackward:
        if (!gradDone.has(j, i)) return kUnset;
        return std::max(t, gradDone.get(j, i));
      case ActionKind::kRecvForward:
      case ActionKind::kRecvBackward:
        return t;  // posting takes no time; the consumer waits for the data
      case ActionKind::kUpdate:
      case ActionKind::kAllReduce:
        return t;
    }
    return kUnset;
  };

  auto record = [&](int r, const Action& a, double start, double end) {
    const int j = a.stage;
    const int i = a.microbatch;
    switch (a.kind) {
      case ActionKind::kForward: forwardDone.set(j, i, end); break;
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput: gradDone.set(j, i, end); break;
      case ActionKind::kSendForward: sentForward.set(j, i, end); break;
      case ActionKind::kSendBackward: sentBackward.set(j, i, end); break;
      case ActionKind::kRecvForward: recvForward.set(j, i, end); break;
      case ActionKind::kRecvBackward: recvBackward.set(j, i, end); break;
      default: break;
    }
    if (isCompute(a.kind)) result.busyTimePerRank[r] += end - start;
    result.timeline.push_back(TimedAction{r, static_cast<int>(next[r]), a, start, end});
    freeAt[r] = end;
    ++next[r];
  };

  for (;;) {
    bool progress = false;
    bool finished = true;
    for (int r = 0; r < ranks; ++r) {
      const auto& list = schedule.actions(r);
      while (next[r] < list.size()) {
        const Action& a = list[next[r]];
        if (!inRange(a)) {
          throw std::invalid_argument("rank " + str(r) + " step " + str(static_cast<int>(next[r])) +
                                      ": action " + a.toString() + " is out of range");
        }
        if (a.kind == ActionKind::kAllReduce) {
          // Collective: every replica of the stage must be at this ALLREDUCE.
          const auto& peers = layout.stageRanks(a.stage);
          double start = 0.0;
          bool all = true;
          for (int q : peers) {
            const auto& peerList = schedule.actions(q);
            if (next[q] >= peerList.size() || peerList[next[q]] != a) {
              all = false;
              break;
            }
            start = std::max(start, freeAt[q]);
          }
          if (!all) break;
          const double end = start + costs.allReduce[a.stage];
          for (int q : peers) record(q, a, start, end);
          progress = true;
          continue;
        }
        const double start = readyTime(r, a);
        if (start == kUnset) break;
        record(r, a, start, start + costOf(a));
        progress = true;
      }
      if (next[r] < list.size()) finished = false;
    }
    if (finished) break;
    if (!progress) {
      std::ostringstream message;
      message << "deadlock: no rank can make progress;";
      int firstRank = -1;
      int firstStep = -1;
      for (int r = 0; r < ranks; ++r) {
        const auto& list = schedule.actions(r);
        if (next[r] >= list.size()) continue;
        if (firstRank < 0) {
          firstRank = r;
          firstStep = static_cast<int>(next[r]);
        }
        message << " rank " << r << " waits at step " << next[r] << " (" << list[next[r]].toString()
                << ");";
      }
      throw DeadlockError(message.str(), firstRank, firstStep);
    }
  }

  for (double end : freeAt) result.makespan = std::max(result.makespan, end);
  double busy = 0.0;
  for (int r = 0; r < ranks; ++r) {
    busy += result.busyTimePerRank[r];
    result.bubbleFractionPerRank.push_back(
        result.makespan > 0 ? 1.0 - result.busyTimePerRank[r] / result.makespan : 0.0);
  }
  result.bubbleFraction = result.makespan > 0 ? 1.0 - busy / (ranks * result.makespan) : 0.0;
  computeMemoryFigures(schedule, result);
  return result;
}

std::string toChromeTrace(const Schedule& schedule, const SimulationResult& result) {
  std::ostringstream out;
  out.precision(12);
  out << "{\"displayTimeUnit\": \"ms\", \"otherData\": {\"schedule\": \"" << schedule.name()
      << "\"}, \"traceEvents\": [\n";
  bool first = true;
  auto comma = [&]() {
    if (!first) out << ",\n";
    first = false;
  };
  for (int r = 0; r < schedule.numRanks(); ++r) {
    comma();
    out << "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 0, \"tid\": " << r
        << ", \"args\": {\"name\": \"rank " << r << "\"}}";
  }
  // Simulated time units are written as milliseconds (ts is microseconds).
  for (const auto& event : result.timeline) {
    const Action& a = event.action;
    if (isComm(a.kind) || a.kind == ActionKind::kUpdate) continue;
    comma();
    out << "{\"name\": \"" << a.toString() << "\", \"cat\": \"" << kindToken(a.kind)
        << "\", \"ph\": \"X\", \"pid\": 0, \"tid\": " << event.rank
        << ", \"ts\": " << event.start * 1000.0 << ", \"dur\": " << (event.end - event.start) * 1000.0
        << ", \"args\": {\"stage\": " << a.stage << ", \"microbatch\": " << a.microbatch
        << ", \"version\": " << a.version << ", \"step\": " << event.step << "}}";
  }
  out << "\n]}\n";
  return out.str();
}

}  // namespace pipedream
