// sendReleasePoints: exact release points for a small 1F1B, soundness against
// an adversarial execution (every send is released only after its receiver
// consumed it, even when the releasing rank runs ahead of all others), and the
// bound it buys: a stage's unreleased sends stay O(p), not O(m).
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <tuple>

#include "lower.h"
#include "receipt.h"
#include "test_helpers.h"

namespace pipedream {
namespace {

using testing_helpers::make;

// "consumer <- send, send" for every release point of a rank, in list order.
std::string render(const Schedule& lowered, int rank) {
  const auto& list = lowered.actions(rank);
  const auto release = sendReleasePoints(lowered, rank);
  std::string out;
  for (size_t k = 0; k < release.size(); ++k) {
    if (release[k].empty()) continue;
    if (!out.empty()) out += "; ";
    out += list[k].toString() + " <-";
    for (int s : release[k]) out += " " + list[s].toString();
  }
  return out;
}

TEST(Receipt, OneFOneBTwoRanksExact) {
  // rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0F3 ...
  // rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F2 1F2 ...
  const Schedule s = lower(make("1f1b", 2, 4));
  // A forward output is known received when its gradient comes back.
  EXPECT_EQ(render(s, 0), "0B0 <- 0SEND_F0; 0B1 <- 0SEND_F1; 0B2 <- 0SEND_F2; 0B3 <- 0SEND_F3");
  // Stage 1's gradient of microbatch i: when stage 0's next forward (sent
  // after its B(i)) arrives; the last two have no later message: end of step.
  EXPECT_EQ(render(s, 1), "1F2 <- 1SEND_B0; 1F3 <- 1SEND_B1");
}

TEST(Receipt, GPipeHoldsBackwardSendsToTheEnd) {
  // After the forwards nothing flows from stage j-1 to j: no SEND_B is released early.
  const Schedule s = lower(make("gpipe", 3, 4));
  for (int r = 0; r < 3; ++r) {
    const auto& list = s.actions(r);
    const auto release = sendReleasePoints(s, r);
    for (const auto& sends : release) {
      for (int k : sends) EXPECT_EQ(list[k].kind, ActionKind::kSendForward) << r;
    }
  }
}

// Executes every rank's list one action at a time: a compute action that
// consumes a RECV waits until its peer ran the matching SEND. `ahead` runs as
// far as it can before any other rank moves one action. Whenever `ahead` passes
// a release point, every send released there must have been consumed.
void expectSoundRunningAhead(const Schedule& lowered, int ahead, const std::string& what) {
  const int ranks = lowered.numRanks();
  const Layout& layout = lowered.layout();
  using Key = std::tuple<int, ActionKind, int, int>;  // rank, kind, stage, microbatch
  std::set<Key> done;
  std::vector<size_t> next(ranks, 0);
  const auto release = sendReleasePoints(lowered, ahead);

  // The peer SEND a compute action waits for, if its input is received.
  auto dependency = [&](int r, const Action& a, Key* needed) {
    const auto& list = lowered.actions(r);
    auto has = [&](ActionKind kind) {
      return std::any_of(list.begin(), list.end(), [&](const Action& b) {
        return b.kind == kind && b.stage == a.stage && b.microbatch == a.microbatch;
      });
    };
    if (a.kind == ActionKind::kForward && has(ActionKind::kRecvForward)) {
      *needed = Key{layout.rankFor(a.stage - 1, a.microbatch), ActionKind::kSendForward,
                    a.stage - 1, a.microbatch};
      return true;
    }
    if ((a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) &&
        has(ActionKind::kRecvBackward)) {
      *needed = Key{layout.rankFor(a.stage + 1, a.microbatch), ActionKind::kSendBackward,
                    a.stage + 1, a.microbatch};
      return true;
    }
    return false;
  };
  auto step = [&](int r) {
    const auto& list = lowered.actions(r);
    if (next[r] >= list.size()) return false;
    const Action& a = list[next[r]];
    Key needed;
    if (isCompute(a.kind) && dependency(r, a, &needed) && !done.count(needed)) return false;
    if (r == ahead) {
      for (int s : release[next[r]]) {
        const Action& send = list[s];
        const bool forward = send.kind == ActionKind::kSendForward;
        const int stage = forward ? send.stage + 1 : send.stage - 1;
        const int q = layout.rankFor(stage, send.microbatch);
        const bool consumed =
            forward ? done.count(Key{q, ActionKind::kForward, stage, send.microbatch}) > 0
                    : done.count(Key{q, ActionKind::kBackward, stage, send.microbatch}) > 0 ||
                          done.count(Key{q, ActionKind::kBackwardInput, stage, send.microbatch}) > 0;
        EXPECT_TRUE(consumed) << what << ": rank " << ahead << " releases " << send.toString()
                              << " at " << a.toString() << " before rank " << q << " consumed it";
      }
    }
    done.insert(Key{r, a.kind, a.stage, a.microbatch});
    ++next[r];
    return true;
  };
  for (;;) {
    while (step(ahead)) {
    }
    bool moved = false;
    for (int r = 0; r < ranks && !moved; ++r) moved = r != ahead && step(r);
    if (!moved) break;
  }
  for (int r = 0; r < ranks; ++r) {
    EXPECT_EQ(next[r], lowered.actions(r).size()) << what << ": rank " << r << " stuck";
  }
}

TEST(Receipt, SoundForEveryFlushScheduleEvenWhenOneRankRunsAhead) {
  struct Case {
    std::string name;
    int p, m, v;
    std::vector<int> replicas;
  };
  const std::vector<Case> cases = {
      {"gpipe", 2, 4, 1, {}},   {"gpipe", 4, 8, 1, {}},   {"1f1b", 2, 8, 1, {}},
      {"1f1b", 4, 8, 1, {}},    {"1f1b", 3, 5, 1, {}},    {"1f1b", 3, 6, 1, {2, 1, 1}},
      {"1f1b", 3, 6, 1, {1, 2, 1}}, {"zb-h1", 2, 4, 1, {}}, {"zb-h1", 4, 8, 1, {}},
      {"interleaved-1f1b", 2, 4, 2, {}}, {"interleaved-1f1b", 4, 8, 2, {}},
  };
  for (const auto& c : cases) {
    const Schedule lowered = lower(make(c.name, c.p, c.m, c.v, c.replicas));
    for (int r = 0; r < lowered.numRanks(); ++r) {
      const std::string what = c.name + " p=" + std::to_string(c.p) + " m=" + std::to_string(c.m);
      expectSoundRunningAhead(lowered, r, what);
      // Each send listed at most once, after its own position.
      const auto release = sendReleasePoints(lowered, r);
      std::set<int> seen;
      for (size_t k = 0; k < release.size(); ++k) {
        for (int s : release[k]) {
          EXPECT_LT(s, static_cast<int>(k)) << what;
          EXPECT_TRUE(seen.insert(s).second) << what << ": send " << s << " twice";
          EXPECT_TRUE(isComm(lowered.actions(r)[s].kind)) << what;
        }
      }
    }
  }
}

// The most sends a rank holds at once (sent, not yet released), releasing at
// the points, everything else at the end.
int peakHeld(const Schedule& lowered, int rank) {
  const auto& list = lowered.actions(rank);
  const auto release = sendReleasePoints(lowered, rank);
  int held = 0, peak = 0;
  for (size_t k = 0; k < list.size(); ++k) {
    held -= static_cast<int>(release[k].size());
    if (list[k].kind == ActionKind::kSendForward || list[k].kind == ActionKind::kSendBackward) {
      peak = std::max(peak, ++held);
    }
  }
  return peak;
}

TEST(Receipt, OneFOneBHoldsSendsIndependentOfMicrobatches) {
  for (int p : {2, 4}) {
    for (int m : {8, 32}) {
      const Schedule lowered = lower(make("1f1b", p, m));
      for (int r = 0; r < p; ++r) {
        // Forward sends wait for their gradients (up to p - r in flight), plus
        // a few gradient sends in the cool-down: bounded by 2p whatever m is.
        EXPECT_LE(peakHeld(lowered, r), 2 * p) << "p=" << p << " m=" << m << " rank " << r;
      }
    }
  }
}

TEST(Receipt, RankOutOfRangeThrows) {
  const Schedule lowered = lower(make("1f1b", 2, 2));
  EXPECT_THROW(sendReleasePoints(lowered, 2), std::out_of_range);
}

}  // namespace
}  // namespace pipedream
