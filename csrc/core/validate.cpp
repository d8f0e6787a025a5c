#include "validate.h"

#include <map>
#include <unordered_map>
#include <stdexcept>
#include <tuple>

#include "simulate.h"

namespace pipedream {

namespace {

std::string str(int value) { return std::to_string(value); }

[[noreturn]] void problem(const Schedule& schedule, int rank, int step, const std::string& what) {
  std::string where;
  if (rank >= 0) {
    where = "rank " + str(rank) + " step " + str(step) + " (" +
            schedule.actions(rank)[step].toString() + "): ";
  }
  throw std::invalid_argument("invalid schedule '" + schedule.name() + "': " + where + what +
                              "\n" + schedule.grid(rank, step));
}

// Per-(stage, microbatch) facts gathered over all ranks.
struct MicrobatchRecord {
  int forwards = 0, backwards = 0, inputs = 0, weights = 0;
  int sendF = 0, recvF = 0, sendB = 0, recvB = 0;
};

// Checks one rank's list in order, filling the per-(stage, microbatch)
// records shared by all ranks; the first broken rule throws (problem()).
class RankChecker {
 public:
  // `lowered`: schedule.isLowered(), found once for all ranks.
  RankChecker(const Schedule& schedule, int rank, bool lowered,
              std::vector<std::vector<MicrobatchRecord>>& records)
      : schedule_(schedule),
        layout_(schedule.layout()),
        rank_(rank),
        stages_(schedule.numStages()),
        total_(schedule.totalMicrobatches()),
        lowered_(lowered),
        records_(records),
        updates_(stages_, 0),
        gradientsSinceUpdate_(stages_, 0),
        pendingAllReduce_(stages_, 0),
        lastGradientStep_(stages_, -1) {}

  void run() {
    const auto& list = schedule_.actions(rank_);
    state_.reserve(list.size());
    for (step_ = 0; step_ < static_cast<int>(list.size()); ++step_) {
      const Action& a = list[step_];
      checkPlacement(a);
      auto& record = isVersionOnly(a.kind) ? records_[0][0] : records_[a.stage][a.microbatch];
      checkAction(a, record);
    }
    for (int j = 0; j < stages_; ++j) {
      if (gradientsSinceUpdate_[j] > 0) {
        problem(schedule_, rank_, lastGradientStep_[j],
                "gradient of stage " + str(j) + " is never applied (no UPDATE after it)");
      }
    }
  }

 private:
  using Key = std::pair<int, int>;  // (stage, microbatch)

  [[noreturn]] void fail(const std::string& what) const { problem(schedule_, rank_, step_, what); }
  // Whether `stage`'s part of `a`'s microbatch runs on another rank.
  bool remote(const Action& a, int stage) const { return layout_.rankFor(stage, a.microbatch) != rank_; }

  // Stage and microbatch in range, and on this rank.
  void checkPlacement(const Action& a) const {
    const int j = a.stage;
    const int i = a.microbatch;
    if (j < 0 || j >= stages_) fail("stage " + str(j) + " is out of range [0, " + str(stages_) + ")");
    if (isVersionOnly(a.kind)) {
      if (layout_.replicaIndex(j, rank_) < 0) fail("rank " + str(rank_) + " does not hold stage " + str(j));
      return;
    }
    if (i < 0 || i >= total_) {
      fail("microbatch " + str(i) + " is out of range [0, " + str(total_) + ")");
    }
    const int owner = layout_.rankFor(j, i);
    if (owner != rank_) {
      fail("microbatch " + str(i) + " of stage " + str(j) + " belongs on rank " + str(owner));
    }
  }

  void checkAction(const Action& a, MicrobatchRecord& record) {
    switch (a.kind) {
      case ActionKind::kForward: checkForward(a, record); break;
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput: checkBackward(a, record); break;
      case ActionKind::kBackwardWeight: checkWeightGradient(a, record); break;
      case ActionKind::kSendForward:
      case ActionKind::kSendBackward: checkSend(a, record); break;
      case ActionKind::kRecvForward:
      case ActionKind::kRecvBackward: checkRecv(a, record); break;
      case ActionKind::kAllReduce: checkAllReduce(a); break;
      case ActionKind::kUpdate: checkUpdate(a); break;
    }
  }

  void checkForward(const Action& a, MicrobatchRecord& record) {
    const int j = a.stage;
    const int i = a.microbatch;
    KeyState& st = state_[Key{j, i}];
    if (st.forward) fail("microbatch " + str(i) + " has a second forward");
    if (lowered_ && j > 0 && remote(a, j - 1) && !st.recvF) {
      fail("forward before its RECV_F (its input comes from rank " + str(layout_.rankFor(j - 1, i)) +
           ")");
    }
    if (a.version > updates_[j]) {
      fail("reads version " + str(a.version) + " but only " + str(updates_[j]) +
           " updates of stage " + str(j) + " came before it");
    }
    st.forward = true;
    st.forwardVersion = a.version;
    ++record.forwards;
  }

  // B or I.
  void checkBackward(const Action& a, MicrobatchRecord& record) {
    const int j = a.stage;
    const int i = a.microbatch;
    KeyState& st = state_[Key{j, i}];
    if (!st.forward) fail("backward before its forward");
    if (st.grad) fail("microbatch " + str(i) + " has a second backward");
    if (lowered_ && j < stages_ - 1 && remote(a, j + 1) && !st.recvB) {
      fail("backward before its RECV_B (its gradient comes from rank " +
           str(layout_.rankFor(j + 1, i)) + ")");
    }
    if (a.version != st.forwardVersion) {
      fail("backward reads version " + str(a.version) + " but its forward read version " +
           str(st.forwardVersion) + " (weight stashing needs the same version)");
    }
    st.grad = true;
    if (a.kind == ActionKind::kBackward) {
      ++record.backwards;
      countGradient(j);
    } else {
      ++record.inputs;
      st.input = true;
      st.inputVersion = a.version;
    }
  }

  void checkWeightGradient(const Action& a, MicrobatchRecord& record) {
    KeyState& st = state_[Key{a.stage, a.microbatch}];
    if (!st.input) fail("W before its I (input gradient)");
    if (a.version != st.inputVersion) {
      fail("W reads version " + str(a.version) + " but its I read version " + str(st.inputVersion));
    }
    st.input = false;
    ++record.weights;
    countGradient(a.stage);
  }

  // A gradient (B or W) of `stage` at this step: it must precede the
  // ALLREDUCE of the next update.
  void countGradient(int stage) {
    ++gradientsSinceUpdate_[stage];
    lastGradientStep_[stage] = step_;
    if (pendingAllReduce_[stage]) fail("gradient computed after the ALLREDUCE of its update");
  }

  // SEND_F or SEND_B.
  void checkSend(const Action& a, MicrobatchRecord& record) {
    const int j = a.stage;
    const KeyState& st = state_[Key{j, a.microbatch}];
    if (a.kind == ActionKind::kSendForward) {
      if (j == stages_ - 1 || !remote(a, j + 1)) {
        fail("nothing to send: stage " + str(j + 1) + " of this microbatch is not on another rank");
      }
      if (!st.forward) fail("SEND_F before its forward");
      ++record.sendF;
    } else {
      if (j == 0 || !remote(a, j - 1)) {
        fail("nothing to send: stage " + str(j - 1) + " of this microbatch is not on another rank");
      }
      if (!st.grad) fail("SEND_B before its backward");
      ++record.sendB;
    }
  }

  // RECV_F or RECV_B.
  void checkRecv(const Action& a, MicrobatchRecord& record) {
    const int j = a.stage;
    KeyState& st = state_[Key{j, a.microbatch}];
    if (a.kind == ActionKind::kRecvForward) {
      if (j == 0 || !remote(a, j - 1)) {
        fail("nothing to receive: stage " + str(j - 1) + " of this microbatch is not on another rank");
      }
      if (st.forward) fail("RECV_F after its forward");
      if (st.recvF) fail("second RECV_F");
      st.recvF = true;
      ++record.recvF;
    } else {
      if (j == stages_ - 1 || !remote(a, j + 1)) {
        fail("nothing to receive: stage " + str(j + 1) + " of this microbatch is not on another rank");
      }
      if (st.grad) fail("RECV_B after its backward");
      if (st.recvB) fail("second RECV_B");
      st.recvB = true;
      ++record.recvB;
    }
  }

  void checkAllReduce(const Action& a) {
    const int j = a.stage;
    if (layout_.replicas(j) < 2) fail("stage " + str(j) + " has one replica: nothing to all-reduce");
    if (a.version != updates_[j] + 1) {
      fail("ALLREDUCE for version " + str(a.version) + " but the next update of stage " + str(j) +
           " creates version " + str(updates_[j] + 1));
    }
    if (gradientsSinceUpdate_[j] == 0) fail("ALLREDUCE with no gradient since the last update");
    if (pendingAllReduce_[j]) fail("second ALLREDUCE for the same update");
    pendingAllReduce_[j] = a.version;
  }

  void checkUpdate(const Action& a) {
    const int j = a.stage;
    if (a.version != updates_[j] + 1) {
      fail("UPDATE creates version " + str(a.version) + " but stage " + str(j) + " is at version " +
           str(updates_[j]) + " (updates number 1, 2, 3, ...)");
    }
    if (gradientsSinceUpdate_[j] == 0) fail("UPDATE with no gradient (B or W) since the last update");
    if (layout_.replicas(j) > 1 && pendingAllReduce_[j] != a.version) {
      fail("stage " + str(j) + " has " + str(layout_.replicas(j)) +
           " replicas but no ALLREDUCE precedes this update");
    }
    updates_[j] = a.version;
    gradientsSinceUpdate_[j] = 0;
    pendingAllReduce_[j] = 0;
  }

  const Schedule& schedule_;
  const Layout& layout_;
  const int rank_;
  const int stages_;
  const int total_;
  const bool lowered_;
  std::vector<std::vector<MicrobatchRecord>>& records_;
  int step_ = 0;  // position of the action being checked
  // Per (stage, microbatch) on this rank: whether its F (I) happened and the
  // version it read, and whether its gradient, RECV_F, RECV_B happened.
  struct KeyState {
    bool forward = false, input = false, grad = false, recvF = false, recvB = false;
    int forwardVersion = 0, inputVersion = 0;
  };
  struct KeyHash {
    size_t operator()(const Key& key) const { return hashInts(0, key.first, key.second); }
  };
  std::unordered_map<Key, KeyState, KeyHash> state_;
  // Per stage.
  std::vector<int> updates_, gradientsSinceUpdate_;
  std::vector<int> pendingAllReduce_, lastGradientStep_;
};

}  // namespace

void validate(const Schedule& schedule) {
  const int stages = schedule.numStages();
  const int total = schedule.totalMicrobatches();
  std::vector<std::vector<MicrobatchRecord>> records(
      std::max(1, stages), std::vector<MicrobatchRecord>(std::max(1, total)));
  const bool lowered = schedule.isLowered();
  for (int r = 0; r < schedule.numRanks(); ++r) RankChecker(schedule, r, lowered, records).run();

  const Layout& layout = schedule.layout();
  for (int j = 0; j < stages; ++j) {
    for (int i = 0; i < total; ++i) {
      const auto& rec = records[j][i];
      const std::string what = "microbatch " + str(i) + " of stage " + str(j) + " (rank " +
                               str(layout.rankFor(j, i)) + ")";
      if (rec.forwards != 1) problem(schedule, -1, -1, what + " has no forward");
      const bool full = rec.backwards == 1 && rec.inputs == 0 && rec.weights == 0;
      const bool split = rec.backwards == 0 && rec.inputs == 1 && rec.weights == 1;
      if (!full && !split) {
        problem(schedule, -1, -1,
                what + " needs one B, or one I and one W (has " + str(rec.backwards) + " B, " +
                    str(rec.inputs) + " I, " + str(rec.weights) + " W)");
      }
      if (!lowered) continue;
      if (j + 1 < stages && layout.rankFor(j + 1, i) != layout.rankFor(j, i)) {
        if (rec.sendF != 1 || records[j + 1][i].recvF != 1) {
          problem(schedule, -1, -1, what + " needs one SEND_F and stage " + str(j + 1) +
                                        " one RECV_F (have " + str(rec.sendF) + " and " +
                                        str(records[j + 1][i].recvF) + ")");
        }
        if (rec.recvB != 1 || records[j + 1][i].sendB != 1) {
          problem(schedule, -1, -1, what + " needs one RECV_B and stage " + str(j + 1) +
                                        " one SEND_B (have " + str(rec.recvB) + " and " +
                                        str(records[j + 1][i].sendB) + ")");
        }
      }
    }
  }

  try {
    simulate(schedule, StageCosts::uniform(stages, 0.0, 0.0, -1.0, 0.0), Recording::kNone);
  } catch (const DeadlockError& e) {
    problem(schedule, e.rank(), e.step(),
            std::string(e.what()) +
                " (an upstream F must come before the downstream F, a downstream B/I before the "
                "upstream B/I, and all replicas must reach each ALLREDUCE)");
  }
}

}  // namespace pipedream
