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

namespace {

// For every position k of `list`: the version the next forward of list[k]'s
// stage after k reads (INT_MAX: none). Forwards read non-decreasing versions,
// so every version from there up to the current one must be kept (vertical
// sync reads old versions later).
std::vector<int> nextForwardReads(const std::vector<Action>& list, int stages) {
  std::vector<int> next(stages, INT_MAX);
  std::vector<int> out(list.size(), INT_MAX);
  for (size_t k = list.size(); k-- > 0;) {
    const Action& a = list[k];
    if (a.stage < 0 || a.stage >= stages) continue;
    out[k] = next[a.stage];
    if (a.kind == ActionKind::kForward) next[a.stage] = a.version;
  }
  return out;
}

// The versions a stage's in-flight microbatches read: a count per version and
// how many versions have a positive count inside a range, in O(log versions)
// (a Fenwick tree over the versions the rank's list reads for the stage).
class VersionReaders {
 public:
  explicit VersionReaders(std::vector<int> versions) : versions_(std::move(versions)) {
    std::sort(versions_.begin(), versions_.end());
    versions_.erase(std::unique(versions_.begin(), versions_.end()), versions_.end());
    count_.assign(versions_.size(), 0);
    tree_.assign(versions_.size() + 1, 0);
  }

  void add(int version, int delta) {
    const size_t x =
        std::lower_bound(versions_.begin(), versions_.end(), version) - versions_.begin();
    const bool before = count_[x] > 0;
    count_[x] += delta;
    const bool after = count_[x] > 0;
    if (before == after) return;
    positive_ += after ? 1 : -1;
    for (size_t i = x + 1; i < tree_.size(); i += i & (~i + 1)) tree_[i] += after ? 1 : -1;
  }

  // Versions with a positive count outside [lo, hi] (lo <= hi).
  int outside(int lo, int hi) const {
    return positive_ - (positiveBelow(hi, true) - positiveBelow(lo, false));
  }

 private:
  // Positive versions < v (<= v with `inclusive`).
  int positiveBelow(int v, bool inclusive) const {
    auto end = inclusive ? std::upper_bound(versions_.begin(), versions_.end(), v)
                         : std::lower_bound(versions_.begin(), versions_.end(), v);
    int sum = 0;
    for (size_t i = end - versions_.begin(); i > 0; i -= i & (~i + 1)) sum += tree_[i];
    return sum;
  }

  std::vector<int> versions_;  // ascending, distinct
  std::vector<int> count_;     // per version: F minus B/W of the microbatches reading it
  std::vector<int> tree_;      // Fenwick tree over (count_ > 0)
  int positive_ = 0;
};

// Weight versions stage j must keep at position k: every version from the one
// its next forward reads (`nextRead`) up to the current one, the current one,
// and those its in-flight microbatches read.
int liveVersions(int current, int nextRead, const VersionReaders& readers) {
  const int lo = std::min(std::max(0, nextRead), current);
  const long long range = static_cast<long long>(current) - lo + 1;
  return static_cast<int>(std::min<long long>(INT_MAX, range + readers.outside(lo, current)));
}

// One VersionReaders per stage of `list`, over the versions its F, B and W read.
std::map<int, VersionReaders> readersOf(const std::vector<Action>& list, int stages) {
  std::map<int, std::vector<int>> versions;
  for (const Action& a : list) {
    if (a.stage < 0 || a.stage >= stages) continue;
    if (a.kind == ActionKind::kForward || a.kind == ActionKind::kBackward ||
        a.kind == ActionKind::kBackwardWeight) {
      versions[a.stage].push_back(a.version);
    }
  }
  std::map<int, VersionReaders> out;
  for (auto& [j, v] : versions) out.emplace(j, VersionReaders(std::move(v)));
  return out;
}

}  // namespace

void computeMemoryFigures(const Schedule& schedule, SimulationResult& result) {
  const int stages = schedule.numStages();
  result.peakActivations.assign(stages, 0);
  result.peakWeightVersions.assign(stages, 0);
  result.peakDeferredWeightGrads.assign(stages, 0);
  result.peakActivationsPerRank.assign(schedule.numRanks(), 0);
  const VersionReaders noReaders({});
  for (int r = 0; r < schedule.numRanks(); ++r) {
    const auto& list = schedule.actions(r);
    const std::vector<int> nextRead = nextForwardReads(list, stages);
    std::map<int, VersionReaders> readers = readersOf(list, stages);
    std::vector<int> inFlight(stages, 0), deferred(stages, 0);
    std::vector<int> current(stages, 0);
    int rankInFlight = 0;
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
        readers.at(j).add(a.version, 1);
      } else if (a.kind == ActionKind::kBackward) {
        --inFlight[j];
        --rankInFlight;
        readers.at(j).add(a.version, -1);
      } else if (a.kind == ActionKind::kBackwardInput) {
        --inFlight[j];
        --rankInFlight;
        ++deferred[j];
      } else if (a.kind == ActionKind::kBackwardWeight) {
        --deferred[j];
        readers.at(j).add(a.version, -1);
      } else if (a.kind == ActionKind::kUpdate) {
        current[j] = a.version;
      } else {
        continue;
      }
      const auto stageReaders = readers.find(j);
      const VersionReaders& live = stageReaders == readers.end() ? noReaders : stageReaders->second;
      result.peakActivations[j] = std::max(result.peakActivations[j], inFlight[j]);
      result.peakDeferredWeightGrads[j] = std::max(result.peakDeferredWeightGrads[j], deferred[j]);
      result.peakActivationsPerRank[r] = std::max(result.peakActivationsPerRank[r], rankInFlight);
      result.peakWeightVersions[j] =
          std::max(result.peakWeightVersions[j], liveVersions(current[j], nextRead[k], live));
    }
  }
}

namespace {

// One run of simulate(): the per-rank cursors, the event tables and the
// result being filled. Each rank runs its list in order as far as its
// dependencies allow; a sweep over all ranks that moves none deadlocks.
class Simulator {
 public:
  Simulator(const Schedule& schedule, const StageCosts& costs, Recording recording)
      : schedule_(schedule),
        layout_(schedule.layout()),
        costs_(costs),
        stages_(schedule.numStages()),
        ranks_(schedule.numRanks()),
        total_(schedule.totalMicrobatches()),
        lowered_(schedule.isLowered()),
        recording_(recording),
        forwardDone_(stages_, total_),
        gradDone_(stages_, total_),
        sentForward_(stages_, total_),
        sentBackward_(stages_, total_),
        recvForward_(stages_, total_),
        recvBackward_(stages_, total_),
        next_(ranks_, 0),
        freeAt_(ranks_, 0.0) {
    result_.busyTimePerRank.assign(ranks_, 0.0);
    if (recording_ == Recording::kFull) {
      size_t actions = 0;
      for (int r = 0; r < ranks_; ++r) actions += schedule_.actions(r).size();
      result_.timeline.reserve(actions);
    }
  }

  SimulationResult run() {
    for (;;) {
      bool progress = false;
      bool finished = true;
      for (int r = 0; r < ranks_; ++r) {
        progress = advanceRank(r) || progress;
        if (next_[r] < schedule_.actions(r).size()) finished = false;
      }
      if (finished) break;
      if (!progress) throwDeadlock();
    }
    summarize();
    return std::move(result_);
  }

 private:
  double costOf(const Action& a) const { return actionCost(a.kind, a.stage, costs_); }

  bool inRange(const Action& a) const {
    return a.stage >= 0 && a.stage < stages_ &&
           (isVersionOnly(a.kind) || (a.microbatch >= 0 && a.microbatch < total_));
  }

  // Runs rank r's list as far as its dependencies allow; true if it moved.
  bool advanceRank(int r) {
    bool progress = false;
    const auto& list = schedule_.actions(r);
    while (next_[r] < list.size()) {
      const Action& a = list[next_[r]];
      if (!inRange(a)) {
        throw std::invalid_argument("rank " + str(r) + " step " + str(static_cast<int>(next_[r])) +
                                    ": action " + a.toString() + " is out of range");
      }
      if (a.kind == ActionKind::kAllReduce) {
        if (!tryAllReduce(a)) break;
        progress = true;
        continue;
      }
      const double start = readyTime(r, a);
      if (start == kUnset) break;
      record(r, a, start, start + costOf(a));
      progress = true;
    }
    return progress;
  }

  // Collective: runs `a` on every replica of its stage once all of them are
  // at this ALLREDUCE; false while one is not.
  bool tryAllReduce(const Action& a) {
    const auto& peers = layout_.stageRanks(a.stage);
    double start = 0.0;
    for (int q : peers) {
      const auto& peerList = schedule_.actions(q);
      if (next_[q] >= peerList.size() || peerList[next_[q]] != a) return false;
      start = std::max(start, freeAt_[q]);
    }
    const double end = start + costs_.allReduce[a.stage];
    for (int q : peers) record(q, a, start, end);
    return true;
  }

  // When rank r, free at `t`, has the data of transfer (neighbour -> a.stage)
  // for `a`'s microbatch, or kUnset: the same rank hands it over; a lowered
  // schedule needs its RECV posted and waits for the data's arrival (sent +
  // latency); a compute-only one applies the latency directly.
  double neighbourReady(int r, double t, const Action& a, int neighbour, const EventTable& produced,
                        const EventTable& sent, const EventTable& posted, double latency) const {
    const int i = a.microbatch;
    if (layout_.rankFor(neighbour, i) == r || !lowered_) {
      if (!produced.has(neighbour, i)) return kUnset;
      const double extra = layout_.rankFor(neighbour, i) == r ? 0.0 : latency;
      return std::max(t, produced.get(neighbour, i) + extra);
    }
    if (!posted.has(a.stage, i) || !sent.has(neighbour, i)) return kUnset;
    return std::max(t, sent.get(neighbour, i) + latency);
  }

  // The earliest start of rank r's next action `a`, or kUnset if a
  // dependency has not happened yet.
  double readyTime(int r, const Action& a) const {
    double t = freeAt_[r];
    const int j = a.stage;
    const int i = a.microbatch;
    switch (a.kind) {
      case ActionKind::kForward:
        if (j == 0) return t;
        return neighbourReady(r, t, a, j - 1, forwardDone_, sentForward_, recvForward_,
                              costs_.comm[j - 1]);
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput:
        if (!forwardDone_.has(j, i)) return kUnset;
        t = std::max(t, forwardDone_.get(j, i));
        if (j == stages_ - 1) return t;
        return neighbourReady(r, t, a, j + 1, gradDone_, sentBackward_, recvBackward_, costs_.comm[j]);
      case ActionKind::kBackwardWeight:
        if (!gradDone_.has(j, i)) return kUnset;
        return std::max(t, gradDone_.get(j, i));
      case ActionKind::kSendForward:
        if (!forwardDone_.has(j, i)) return kUnset;
        return std::max(t, forwardDone_.get(j, i));
      case ActionKind::kSendBackward:
        if (!gradDone_.has(j, i)) return kUnset;
        return std::max(t, gradDone_.get(j, i));
      case ActionKind::kRecvForward:
      case ActionKind::kRecvBackward:
        return t;  // posting takes no time; the consumer waits for the data
      case ActionKind::kUpdate:
      case ActionKind::kAllReduce:
        return t;
    }
    return kUnset;
  }

  void record(int r, const Action& a, double start, double end) {
    const int j = a.stage;
    const int i = a.microbatch;
    switch (a.kind) {
      case ActionKind::kForward: forwardDone_.set(j, i, end); break;
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput: gradDone_.set(j, i, end); break;
      case ActionKind::kSendForward: sentForward_.set(j, i, end); break;
      case ActionKind::kSendBackward: sentBackward_.set(j, i, end); break;
      case ActionKind::kRecvForward: recvForward_.set(j, i, end); break;
      case ActionKind::kRecvBackward: recvBackward_.set(j, i, end); break;
      default: break;
    }
    if (isCompute(a.kind)) result_.busyTimePerRank[r] += end - start;
    if (recording_ == Recording::kFull ||
        (recording_ == Recording::kSendsOnly &&
         (a.kind == ActionKind::kSendForward || a.kind == ActionKind::kSendBackward))) {
      result_.timeline.push_back(TimedAction{r, static_cast<int>(next_[r]), a, start, end});
    }
    freeAt_[r] = end;
    ++next_[r];
  }

  [[noreturn]] void throwDeadlock() const {
    std::ostringstream message;
    message << "deadlock: no rank can make progress;";
    int firstRank = -1;
    int firstStep = -1;
    for (int r = 0; r < ranks_; ++r) {
      const auto& list = schedule_.actions(r);
      if (next_[r] >= list.size()) continue;
      if (firstRank < 0) {
        firstRank = r;
        firstStep = static_cast<int>(next_[r]);
      }
      message << " rank " << r << " waits at step " << next_[r] << " (" << list[next_[r]].toString()
              << ");";
    }
    throw DeadlockError(message.str(), firstRank, firstStep);
  }

  // Makespan, bubble fractions and the memory figures.
  void summarize() {
    for (double end : freeAt_) result_.makespan = std::max(result_.makespan, end);
    double busy = 0.0;
    for (int r = 0; r < ranks_; ++r) {
      busy += result_.busyTimePerRank[r];
      result_.bubbleFractionPerRank.push_back(
          result_.makespan > 0 ? 1.0 - result_.busyTimePerRank[r] / result_.makespan : 0.0);
    }
    result_.bubbleFraction = result_.makespan > 0 ? 1.0 - busy / (ranks_ * result_.makespan) : 0.0;
    if (recording_ == Recording::kFull) computeMemoryFigures(schedule_, result_);
  }

  const Schedule& schedule_;
  const Layout& layout_;
  const StageCosts& costs_;
  const int stages_;
  const int ranks_;
  const int total_;
  const bool lowered_;  // RECVs are in the lists (else latencies apply directly)
  const Recording recording_;
  EventTable forwardDone_, gradDone_;
  EventTable sentForward_, sentBackward_;
  EventTable recvForward_, recvBackward_;
  std::vector<size_t> next_;     // per rank: position of its next action
  std::vector<double> freeAt_;   // per rank: when its last action ended
  SimulationResult result_;
};

}  // namespace

SimulationResult simulate(const Schedule& schedule, const StageCosts& costs) {
  return simulate(schedule, costs, Recording::kFull);
}

SimulationResult simulate(const Schedule& schedule, const StageCosts& costs, Recording recording) {
  costs.check(schedule.numStages());
  return Simulator(schedule, costs, recording).run();
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
