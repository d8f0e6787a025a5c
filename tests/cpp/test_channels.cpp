// Point-to-point channels (csrc/core/channels.h): the order both ends of a pair
// issue their transfers in, mirrored and deadlock-free under NCCL's rules, over
// the whole validity grid and the asynchronous action feeds.
#include <gtest/gtest.h>

#include <numeric>

#include "action_feed.h"
#include "channels.h"
#include "lower.h"
#include "simulate.h"
#include "test_helpers.h"
#include "traits.h"
#include "validate.h"

namespace pipedream {
namespace {

using testing_helpers::Case;
using testing_helpers::describe;
using testing_helpers::errorOf;
using testing_helpers::expectActions;
using testing_helpers::expectedToFail;
using testing_helpers::gridCases;
using testing_helpers::make;

TEST(Channels, PlainLoweringCrossesInOneFOneB) {
  // RECV right before its consumer: rank 0 sends F1 where rank 1 sends B0.
  const Schedule lowered = lower(make("1f1b", 2, 4));
  const std::string error = errorOf([&] { validateChannels(lowered); });
  EXPECT_NE(error.find("ranks 0 and 1 do not mirror at operation 1: rank 0 issues 0SEND_F1, "
                       "rank 1 issues 1SEND_B0"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("rank 0 -> 1: 0SEND_F0 0SEND_F1 0RECV_B0"), std::string::npos) << error;
}

TEST(Channels, OneFOneBTwoRanksExact) {
  const Schedule ordered = orderTransfers(lower(make("1f1b", 2, 4)));
  // Rank 1 posts RECV_F1 before it sends B0 (rank 0 sends F1 first), and each
  // later forward right after the gradient that precedes it in the pair order.
  expectActions(ordered, {
      "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0F3 0SEND_F3 0RECV_B2 "
      "0RECV_B3 0B2 0B3 0U1",
      "1RECV_F0 1RECV_F1 1F0 1B0 1SEND_B0 1RECV_F2 1F1 1B1 1SEND_B1 1RECV_F3 1F2 1B2 1SEND_B2 1F3 "
      "1B3 1SEND_B3 1U1",
  });
  EXPECT_EQ(channelsToText(ordered),
            "rank 0 -> 1: 0SEND_F0 0SEND_F1 0RECV_B0 0SEND_F2 0RECV_B1 0SEND_F3 0RECV_B2 0RECV_B3\n"
            "rank 1 -> 0: 1RECV_F0 1RECV_F1 1SEND_B0 1RECV_F2 1SEND_B1 1RECV_F3 1SEND_B2 1SEND_B3\n");
  EXPECT_NO_THROW(validateChannels(ordered));
  EXPECT_NO_THROW(validate(ordered));
  // Idempotent, and the compute order is the lowered one's.
  EXPECT_EQ(orderTransfers(ordered).toText(), ordered.toText());
  EXPECT_EQ(stripCommunication(ordered).toText(), make("1f1b", 2, 4).toText());
}

TEST(Channels, TransferKeysNameBothEnds) {
  const Action send = Action::comm(1, ActionKind::kSendForward, 3);
  const Action recv = Action::comm(2, ActionKind::kRecvForward, 3);
  EXPECT_EQ(TransferKey::of(send), TransferKey::of(recv));
  EXPECT_EQ(TransferKey::of(send).toString(), "F1:3");
  EXPECT_EQ(TransferKey::of(Action::comm(2, ActionKind::kSendBackward, 0)),
            TransferKey::of(Action::comm(1, ActionKind::kRecvBackward, 0)));
  EXPECT_THROW(TransferKey::of(Action::compute(0, ActionKind::kForward, 0)), std::invalid_argument);
}

TEST(Channels, AMirroredOrderCanStillDeadlockAndIsNamed) {
  // Stage 1 replicated on ranks 1 and 2 (microbatch i on rank 1 + i % 2). Rank 0
  // waits for B0 before it sends F1; rank 1 waits at the ALLREDUCE for rank 2,
  // which waits for F1: every pair mirrors, nothing moves.
  const Schedule s = make("gpipe", 2, 2, 1, {1, 2});
  const Schedule hand = lower(s).withActionsFromText(
      "rank 0: 0F0 0SEND_F0 0RECV_B0 0B0 0F1 0SEND_F1 0RECV_B1 0B1 0U1\n"
      "rank 1: 1RECV_F0 1F0 1B0 1ALLREDUCE1 1SEND_B0 1U1\n"
      "rank 2: 1RECV_F1 1F1 1B1 1ALLREDUCE1 1SEND_B1 1U1\n");
  const std::string error = errorOf([&] { validateChannels(hand); });
  EXPECT_NE(error.find("deadlock under NCCL's rules"), std::string::npos) << error;
  EXPECT_NE(error.find("rank 0 at step 3 (0B0): waits for its input"), std::string::npos) << error;
  EXPECT_NE(error.find("rank 1 at step 3 (1ALLREDUCE1): waits for the other replicas"),
            std::string::npos)
      << error;
}

TEST(Channels, EveryGeneratorOfTheGridOrdersAndProvesItsTransfers) {
  int checked = 0;
  for (const Case& c : gridCases()) {
    if (expectedToFail(c)) continue;
    SCOPED_TRACE(describe(c));
    const bool vs = c.name == "pipedream-vs";
    const Schedule lowered = lower(make(vs ? "pipedream" : c.name, c.p, c.m, c.v, c.replicas, c.batches, vs));
    Schedule ordered;
    ASSERT_NO_THROW(ordered = orderTransfers(lowered));
    ASSERT_NO_THROW(validate(ordered));
    ASSERT_NO_THROW(validateChannels(ordered));
    ASSERT_NO_THROW(validateChannels(ordered, /*forwardOnly=*/true));
    // Only RECVs moved: the rest of every list is the lowered one's, in order.
    EXPECT_EQ(stripCommunication(ordered).toText(), stripCommunication(lowered).toText());
    for (int r = 0; r < lowered.numRanks(); ++r) {
      std::vector<Action> a, b;
      for (const Action& x : lowered.actions(r)) {
        if (x.kind != ActionKind::kRecvForward && x.kind != ActionKind::kRecvBackward) a.push_back(x);
      }
      for (const Action& x : ordered.actions(r)) {
        if (x.kind != ActionKind::kRecvForward && x.kind != ActionKind::kRecvBackward) b.push_back(x);
      }
      ASSERT_EQ(actionsToString(a), actionsToString(b)) << "rank " << r;
    }
    ++checked;
  }
  EXPECT_GT(checked, 4000);
}

TEST(Channels, ValidationWorkGrowsLinearlyWithTheActions) {
  // validateChannels() looks each input, receipt point and send up by key, so
  // its work per action stays flat as the microbatches grow; a scan of a
  // rank's list per compute action (what it did before) grows with m.
  for (const std::string& name : scheduleNames()) {
    SCOPED_TRACE(name);
    const ScheduleTraits& traits = scheduleTraits(name);
    const int chunks = traits.multiChunk ? std::max(2, traits.fixedChunks) : 1;
    double perAction[2] = {0.0, 0.0};
    const int microbatches[2] = {32, 256};
    for (int x = 0; x < 2; ++x) {
      const int m = microbatches[x];
      const int perStep = traits.streaming ? traits.microbatchesPerStep(m) : 0;
      const Schedule ordered = orderTransfers(lower(make(name, 4, m, chunks)), perStep);
      ChannelCheckStats stats;
      validateChannels(ordered, false, &stats);
      ASSERT_GT(stats.actions, 0);
      perAction[x] = static_cast<double>(stats.steps + stats.lookups) / stats.actions;
      // A sweep tries every rank: the sweeps cost no more than the actions.
      EXPECT_LE(stats.sweeps * ordered.numRanks(), stats.actions);
    }
    // About 2 here (a step and a lookup per action); 40 to 100 at m = 32 and
    // 8x that at m = 256 with the scan.
    EXPECT_LT(perAction[0], 3.0);
    EXPECT_LT(perAction[1], perAction[0] * 1.1);
  }
}

struct FeedCase {
  std::string name;
  int p, m;
  std::vector<int> replicas;
  bool verticalSync;
};

TEST(Channels, AsyncActionFeedsMirrorStepByStepAndInTheirDrains) {
  const std::vector<FeedCase> cases = {
      {"pipedream", 2, 1, {}, false},       {"pipedream", 4, 1, {}, false},
      {"pipedream", 3, 1, {}, true},        {"pipedream", 3, 1, {2, 1, 1}, false},
      {"pipedream", 2, 1, {2, 3}, false},   {"pipedream", 3, 1, {1, 2, 3}, false},
      {"pipedream", 2, 1, {1, 3}, false},   {"pipedream", 2, 1, {3, 1}, false},
      {"pipedream", 1, 1, {4}, false},      {"pipedream", 2, 1, {2, 2}, true},
      {"pipedream", 3, 1, {1, 1, 2}, false}, {"pipedream-2bw", 1, 2, {}, false},
      {"pipedream-2bw", 3, 4, {}, false},
      {"pipedream-2bw", 4, 3, {}, false},   {"pipedream-2bw", 2, 4, {2, 1}, false},
  };
  for (const auto& c : cases) {
    ScheduleOptions o;
    o.name = c.name;
    o.stages = c.p;
    o.replicas = c.replicas;
    o.verticalSync = c.verticalSync;
    o.microbatches = c.m;
    const AsyncActionFeed feed(o);
    int unit = 1;
    for (int r : c.replicas) unit = c.name == "pipedream" ? std::lcm(unit, r) : unit;
    for (int steps : {1, 2, 5, 13, 34}) {
      steps = (steps + unit - 1) / unit * unit;
      SCOPED_TRACE(c.name + " p=" + std::to_string(c.p) + " steps=" + std::to_string(steps));
      // What the executor runs: the steps' slices, then the drain.
      std::vector<std::vector<Action>> lists;
      for (int r = 0; r < feed.base().numRanks(); ++r) {
        std::vector<Action> joined;
        for (int t = 0; t < steps; ++t) {
          const auto part = feed.stepActions(r, t);
          joined.insert(joined.end(), part.begin(), part.end());
        }
        const auto drain = feed.drainActions(r, steps);
        joined.insert(joined.end(), drain.begin(), drain.end());
        lists.push_back(std::move(joined));
      }
      ScheduleOptions full = o;
      if (c.name == "pipedream") {
        full.microbatches = steps;
      } else {
        full.batches = steps;
      }
      const Schedule served = lower(buildSchedule(full)).withActions(lists);
      ASSERT_NO_THROW(validate(served));
      ASSERT_NO_THROW(validateChannels(served));
    }
  }
}

// A (pp, dp, tp) mesh: one pipeline per (dp, tp) coordinate on its own pp group,
// the tp (and with FSDP the dp) collectives inside every compute action. Every
// flush schedule the runtime runs with tensor parallelism, on pp 2 and 4 and the
// meshes of tests/test_tensor_parallel.py (dp x tp = 1 x 2, 2 x 2, 2 x 1), proves.
TEST(MeshChannels, EveryFlushScheduleOnPpDpTpMeshes) {
  int checked = 0;
  for (const Case& c : gridCases()) {
    const bool flush = c.name == "gpipe" || c.name == "1f1b" || c.name == "zb-h1" ||
                       c.name == "interleaved-1f1b" || c.name == "zbv" || c.name == "dualpipev" ||
                       c.name == "interleaved-zb";
    if (!flush || (c.p != 2 && c.p != 4) || c.m > 8 || c.v > 2 || c.batches != 1 ||
        !c.replicas.empty() || expectedToFail(c)) {
      continue;
    }
    const Schedule ordered = orderTransfers(lower(make(c.name, c.p, c.m, c.v)));
    for (const auto& [dp, tp] : std::vector<std::pair<int, int>>{{1, 2}, {2, 2}, {2, 1}}) {
      for (bool fsdp : {false, true}) {
        SCOPED_TRACE(describe(c) + " dp=" + std::to_string(dp) + " tp=" + std::to_string(tp) +
                     (fsdp ? " fsdp" : " replicate"));
        const std::vector<Schedule> pipelines(dp * tp, ordered);
        ASSERT_NO_THROW(validateMeshChannels(pipelines, MeshShape{dp, tp, fsdp}));
        ASSERT_NO_THROW(validateMeshChannels(pipelines, MeshShape{dp, tp, fsdp}, /*forwardOnly=*/true));
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 300);
}

// A crossing order fails on the mesh as on one pipeline, naming the coordinate.
TEST(MeshChannels, ACrossingOrderNamesTheMeshCoordinate) {
  const Schedule crossing = lower(make("1f1b", 2, 4));  // not ordered: rank 0 sends F1, rank 1 B0
  const std::string error =
      errorOf([&] { validateMeshChannels({crossing, crossing}, MeshShape{1, 2, false}); });
  EXPECT_NE(error.find("the pipeline of mesh coordinate (dp 0, tp 0): transfer order of schedule "),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("ranks 0 and 1 do not mirror at operation 1"), std::string::npos) << error;
}

// The tp ranks of a stage must issue their collectives in one order: two tp
// coordinates running their microbatches in other orders (ranks that disagree on
// the schedule, which the runtime's agreement refuses) deadlock in the first
// collective, and the error says where each member of the group is. Each
// pipeline alone is fine.
TEST(MeshChannels, TpRanksRunningAnotherOrderDeadlockInTheirCollective) {
  const Schedule oneFOneB = orderTransfers(lower(make("1f1b", 2, 4)));
  const Schedule gpipe = orderTransfers(lower(make("gpipe", 2, 4)));
  ASSERT_NO_THROW(validateChannels(oneFOneB));
  ASSERT_NO_THROW(validateChannels(gpipe));
  ASSERT_NO_THROW(validateMeshChannels({gpipe, gpipe}, MeshShape{1, 2, false}));
  // Global ranks 0 and 1 are stage 0 of tp coordinates 0 and 1; 2 and 3 stage 1.
  const std::string error =
      errorOf([&] { validateMeshChannels({oneFOneB, gpipe}, MeshShape{1, 2, false}); });
  EXPECT_NE(error.find("deadlock under NCCL's rules"), std::string::npos) << error;
  EXPECT_NE(error.find("or for its tp/dp group's collective (rank 3 at 1F1)"), std::string::npos)
      << error;
  // The same pair as dp coordinates: replicas with no collective inside compute
  // (data_parallel="replicate") do not meet; FSDP's all-gathers do.
  EXPECT_NO_THROW(validateMeshChannels({oneFOneB, gpipe}, MeshShape{2, 1, false}));
  EXPECT_NE(errorOf([&] { validateMeshChannels({oneFOneB, gpipe}, MeshShape{2, 1, true}); })
                .find("deadlock under NCCL's rules"),
            std::string::npos);
  EXPECT_NE(errorOf([&] { validateMeshChannels({gpipe}, MeshShape{1, 2, false}); })
                .find("a (pp, dp=1, tp=2) mesh runs 2 pipelines (one per (dp, tp) coordinate), got 1"),
            std::string::npos);
}

}  // namespace
}  // namespace pipedream
