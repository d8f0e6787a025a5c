#include "validate.h"

#include <map>
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

void checkRank(const Schedule& schedule, int r, std::vector<std::vector<MicrobatchRecord>>& records) {
  const Layout& layout = schedule.layout();
  const int stages = schedule.numStages();
  const int total = schedule.totalMicrobatches();
  const bool lowered = schedule.isLowered();
  const auto& list = schedule.actions(r);

  // State of this rank, per (stage, microbatch): the step of each event.
  std::map<std::pair<int, int>, int> forwardVersion, inputVersion;
  std::map<std::pair<int, int>, bool> gradDone, recvF, recvB;
  std::vector<int> updates(stages, 0), gradientsSinceUpdate(stages, 0);
  std::vector<int> pendingAllReduce(stages, 0), lastGradientStep(stages, -1);

  for (int k = 0; k < static_cast<int>(list.size()); ++k) {
    const Action& a = list[k];
    const int j = a.stage;
    const int i = a.microbatch;
    auto fail = [&](const std::string& what) { problem(schedule, r, k, what); };
    if (j < 0 || j >= stages) fail("stage " + str(j) + " is out of range [0, " + str(stages) + ")");
    if (isVersionOnly(a.kind)) {
      if (layout.replicaIndex(j, r) < 0) fail("rank " + str(r) + " does not hold stage " + str(j));
    } else {
      if (i < 0 || i >= total) {
        fail("microbatch " + str(i) + " is out of range [0, " + str(total) + ")");
      }
      const int owner = layout.rankFor(j, i);
      if (owner != r) {
        fail("microbatch " + str(i) + " of stage " + str(j) + " belongs on rank " + str(owner));
      }
    }
    const auto key = std::make_pair(j, i);
    auto& record = isVersionOnly(a.kind) ? records[0][0] : records[j][i];
    auto remote = [&](int stage) { return layout.rankFor(stage, i) != r; };
    switch (a.kind) {
      case ActionKind::kForward:
        if (forwardVersion.count(key)) fail("microbatch " + str(i) + " has a second forward");
        if (lowered && j > 0 && remote(j - 1) && !recvF.count(key)) {
          fail("forward before its RECV_F (its input comes from rank " +
               str(layout.rankFor(j - 1, i)) + ")");
        }
        if (a.version > updates[j]) {
          fail("reads version " + str(a.version) + " but only " + str(updates[j]) +
               " updates of stage " + str(j) + " came before it");
        }
        forwardVersion[key] = a.version;
        ++record.forwards;
        break;
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput: {
        if (!forwardVersion.count(key)) fail("backward before its forward");
        if (gradDone.count(key)) fail("microbatch " + str(i) + " has a second backward");
        if (lowered && j < stages - 1 && remote(j + 1) && !recvB.count(key)) {
          fail("backward before its RECV_B (its gradient comes from rank " +
               str(layout.rankFor(j + 1, i)) + ")");
        }
        if (a.version != forwardVersion[key]) {
          fail("backward reads version " + str(a.version) + " but its forward read version " +
               str(forwardVersion[key]) + " (weight stashing needs the same version)");
        }
        gradDone[key] = true;
        if (a.kind == ActionKind::kBackward) {
          ++record.backwards;
          ++gradientsSinceUpdate[j];
          lastGradientStep[j] = k;
          if (pendingAllReduce[j]) fail("gradient computed after the ALLREDUCE of its update");
        } else {
          ++record.inputs;
          inputVersion[key] = a.version;
        }
        break;
      }
      case ActionKind::kBackwardWeight:
        if (!inputVersion.count(key)) fail("W before its I (input gradient)");
        if (a.version != inputVersion[key]) {
          fail("W reads version " + str(a.version) + " but its I read version " +
               str(inputVersion[key]));
        }
        inputVersion.erase(key);
        ++record.weights;
        ++gradientsSinceUpdate[j];
        lastGradientStep[j] = k;
        if (pendingAllReduce[j]) fail("gradient computed after the ALLREDUCE of its update");
        break;
      case ActionKind::kSendForward:
        if (j == stages - 1 || !remote(j + 1)) fail("nothing to send: stage " + str(j + 1) +
                                                    " of this microbatch is not on another rank");
        if (!forwardVersion.count(key)) fail("SEND_F before its forward");
        ++record.sendF;
        break;
      case ActionKind::kSendBackward:
        if (j == 0 || !remote(j - 1)) fail("nothing to send: stage " + str(j - 1) +
                                           " of this microbatch is not on another rank");
        if (!gradDone.count(key)) fail("SEND_B before its backward");
        ++record.sendB;
        break;
      case ActionKind::kRecvForward:
        if (j == 0 || !remote(j - 1)) fail("nothing to receive: stage " + str(j - 1) +
                                           " of this microbatch is not on another rank");
        if (forwardVersion.count(key)) fail("RECV_F after its forward");
        if (recvF.count(key)) fail("second RECV_F");
        recvF[key] = true;
        ++record.recvF;
        break;
      case ActionKind::kRecvBackward:
        if (j == stages - 1 || !remote(j + 1)) fail("nothing to receive: stage " + str(j + 1) +
                                                    " of this microbatch is not on another rank");
        if (gradDone.count(key)) fail("RECV_B after its backward");
        if (recvB.count(key)) fail("second RECV_B");
        recvB[key] = true;
        ++record.recvB;
        break;
      case ActionKind::kAllReduce:
        if (layout.replicas(j) < 2) fail("stage " + str(j) + " has one replica: nothing to all-reduce");
        if (a.version != updates[j] + 1) {
          fail("ALLREDUCE for version " + str(a.version) + " but the next update of stage " +
               str(j) + " creates version " + str(updates[j] + 1));
        }
        if (gradientsSinceUpdate[j] == 0) fail("ALLREDUCE with no gradient since the last update");
        if (pendingAllReduce[j]) fail("second ALLREDUCE for the same update");
        pendingAllReduce[j] = a.version;
        break;
      case ActionKind::kUpdate:
        if (a.version != updates[j] + 1) {
          fail("UPDATE creates version " + str(a.version) + " but stage " + str(j) +
               " is at version " + str(updates[j]) + " (updates number 1, 2, 3, ...)");
        }
        if (gradientsSinceUpdate[j] == 0) fail("UPDATE with no gradient (B or W) since the last update");
        if (layout.replicas(j) > 1 && pendingAllReduce[j] != a.version) {
          fail("stage " + str(j) + " has " + str(layout.replicas(j)) +
               " replicas but no ALLREDUCE precedes this update");
        }
        updates[j] = a.version;
        gradientsSinceUpdate[j] = 0;
        pendingAllReduce[j] = 0;
        break;
    }
  }
  for (int j = 0; j < stages; ++j) {
    if (gradientsSinceUpdate[j] > 0) {
      problem(schedule, r, lastGradientStep[j],
              "gradient of stage " + str(j) + " is never applied (no UPDATE after it)");
    }
  }
}

}  // namespace

void validate(const Schedule& schedule) {
  const int stages = schedule.numStages();
  const int total = schedule.totalMicrobatches();
  std::vector<std::vector<MicrobatchRecord>> records(
      std::max(1, stages), std::vector<MicrobatchRecord>(std::max(1, total)));
  for (int r = 0; r < schedule.numRanks(); ++r) checkRank(schedule, r, records);

  const Layout& layout = schedule.layout();
  const bool lowered = schedule.isLowered();
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
    simulate(schedule, StageCosts::uniform(stages, 0.0, 0.0, -1.0, 0.0));
  } catch (const DeadlockError& e) {
    problem(schedule, e.rank(), e.step(),
            std::string(e.what()) +
                " (an upstream F must come before the downstream F, a downstream B/I before the "
                "upstream B/I, and all replicas must reach each ALLREDUCE)");
  }
}

}  // namespace pipedream
