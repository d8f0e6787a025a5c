// AsyncActionFeed: every step and every drain, served by shifting one short
// list, equals the list generated in full, action for action (receives: in
// the same order on every channel).
#include <gtest/gtest.h>

#include <numeric>

#include "action_feed.h"
#include "channels.h"
#include "lower.h"
#include "test_helpers.h"

namespace pipedream {
namespace {

struct FeedCase {
  std::string name;
  int p, m;
  std::vector<int> replicas;
  bool verticalSync;
};

ScheduleOptions optionsOf(const FeedCase& c, int steps) {
  ScheduleOptions o;
  o.name = c.name;
  o.stages = c.p;
  o.replicas = c.replicas;
  o.verticalSync = c.verticalSync;
  if (c.name == "pipedream") {
    o.microbatches = steps;
  } else {
    o.microbatches = c.m;
    o.batches = steps;
  }
  return o;
}

TEST(AsyncActionFeed, StepsPlusDrainEqualTheFullList) {
  const std::vector<FeedCase> cases = {
      {"pipedream", 1, 1, {}, false},      {"pipedream", 2, 1, {}, false},
      {"pipedream", 4, 1, {}, false},      {"pipedream", 3, 1, {}, true},
      {"pipedream", 3, 1, {2, 1, 1}, false}, {"pipedream", 2, 1, {2, 3}, false},
      {"pipedream", 3, 1, {1, 1, 2}, false}, {"pipedream", 2, 1, {2, 2}, true},
      // Periods that do not divide 2 * ranks + 2 (planner plans such as 1-3).
      {"pipedream", 2, 1, {1, 3}, false},  {"pipedream", 2, 1, {3, 1}, false},
      {"pipedream", 1, 1, {4}, false},     {"pipedream", 3, 1, {1, 2, 3}, false},
      {"pipedream-2bw", 1, 2, {}, false},  {"pipedream-2bw", 3, 4, {}, false},
      {"pipedream-2bw", 4, 3, {}, false},  {"pipedream-2bw", 2, 4, {2, 1}, false},
  };
  for (const auto& c : cases) {
    // For pipedream with replicas, the number of minibatches must be a
    // multiple of every replica count; 2bw steps are whole batches.
    int unit = 1;
    for (int r : c.replicas) unit = c.name == "pipedream" ? std::lcm(unit, r) : unit;
    const AsyncActionFeed feed(optionsOf(c, 1));
    for (int steps : {1, 2, 3, 5, 8, 13, 21, 34, 55, 89}) {
      steps = (steps + unit - 1) / unit * unit;
      SCOPED_TRACE(c.name + " p=" + std::to_string(c.p) + " steps=" + std::to_string(steps) +
                   (c.verticalSync ? " vertical" : ""));
      const Schedule full = orderTransfers(lower(buildSchedule(optionsOf(c, steps))),
                                           c.name == "pipedream" ? 1 : c.m);
      std::vector<std::vector<Action>> served;
      for (int r = 0; r < full.numRanks(); ++r) {
        std::vector<Action> joined;
        for (int t = 0; t < steps; ++t) {
          const auto part = feed.stepActions(r, t);
          joined.insert(joined.end(), part.begin(), part.end());
        }
        const auto drain = feed.drainActions(r, steps);
        joined.insert(joined.end(), drain.begin(), drain.end());
        served.push_back(std::move(joined));
      }
      // The same actions in the same order, but for where a receive is posted
      // (a feed cut after `steps` steps may post one later than the finite
      // list does); every pair's operations come in the same order.
      const Schedule joined = full.withActions(served);
      EXPECT_EQ(stripCommunication(joined).toText(), stripCommunication(full).toText());
      for (int r = 0; r < full.numRanks(); ++r) {
        for (int q = 0; q < full.numRanks(); ++q) {
          if (q == r) continue;
          std::vector<std::string> a, b;
          for (const auto& op : channelOps(joined, r, q)) a.push_back(joined.actions(r)[op.position].toString());
          for (const auto& op : channelOps(full, r, q)) b.push_back(full.actions(r)[op.position].toString());
          ASSERT_EQ(a, b) << "rank " << r << " with rank " << q;
        }
      }
    }
  }
}

TEST(AsyncActionFeed, AStepEndsWithItsForwardAndItsSends) {
  const AsyncActionFeed feed(optionsOf({"pipedream", 3, 1, {}, false}, 1));
  // Rank 1 at step 10: the new minibatch's receive posted first (in transfer
  // order: channels.h), the backward and update of an older minibatch, then the
  // new forward and its send, so rank 2 never waits for our next step.
  EXPECT_EQ(actionsToString(feed.stepActions(1, 10)),
            "1RECV_F10 1RECV_B8 1B8v7 1SEND_B8 1U9 1F10v9 1SEND_F10");
  EXPECT_THROW(AsyncActionFeed(optionsOf({"1f1b", 2, 1, {}, false}, 1)), std::invalid_argument);
}

}  // namespace
}  // namespace pipedream
