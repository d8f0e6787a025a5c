// Forward/backward pairs (csrc/core/pairs.h): dualpipev's F&B made adjacent,
// the compute order unchanged, the transfers still mirrored and deadlock-free.
#include <gtest/gtest.h>

#include "channels.h"
#include "lower.h"
#include "pairs.h"
#include "test_helpers.h"

namespace pipedream {
namespace {

using testing_helpers::errorOf;
using testing_helpers::make;

Schedule ordered(const std::string& name, int p, int m, int v) {
  return orderTransfers(lower(make(name, p, m, v)));
}

// The generator's steady state on rank r: m-2p+r+1 rounds of two pairs, then
// p-r-1 single pairs (csrc/core/generators.cpp, dualPipeVRank steps 4 and 5).
size_t expectedPairs(int p, int m, int r) { return 2 * (m - 2 * p + r + 1) + (p - r - 1); }

TEST(Pairs, TwoRanksExact) {
  // 0F3 3B1: 3RECV_F2 (for 3F2, later) moves behind the pair with 0SEND_F3.
  const Schedule paired = pairForwardBackward(ordered("dualpipev", 2, 4, 2));
  EXPECT_EQ(actionsToString(paired.actions(0)),
            "0F0 0SEND_F0 0F1 0SEND_F1 3RECV_F0 0F2 0SEND_F2 3RECV_F1 3F0 3I0 3SEND_B0 3W0 3F1 "
            "0F3 3B1 0SEND_F3 3RECV_F2 3SEND_B1 0RECV_B0 3RECV_F3 3F2 0B0 3B2 3SEND_B2 0RECV_B1 "
            "0RECV_B2 3F3 0B1 3B3 3SEND_B3 0RECV_B3 0I2 0W2 0I3 0W3 0U1 3U1");
  EXPECT_EQ(pairStarts(paired.actions(0)), (std::vector<size_t>{13, 20, 26}));
}

TEST(Pairs, DualPipeVKeepsComputeOrderAndIsSafe) {
  int checked = 0;
  for (int p : {2, 3, 4}) {
    for (int m = 2 * p; m <= 2 * p + 5; ++m) {
      SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m));
      const Schedule before = ordered("dualpipev", p, m, 2);
      Schedule paired = before;
      ASSERT_NO_THROW(paired = pairForwardBackward(before));
      ASSERT_NO_THROW(validateChannels(paired));
      for (int r = 0; r < p; ++r) {
        EXPECT_EQ(actionsToString(stripCommunication(paired).actions(r)),
                  actionsToString(stripCommunication(before).actions(r)));
        EXPECT_EQ(pairStarts(paired.actions(r)).size(), expectedPairs(p, m, r));
        // Every transfer is still there (only moved).
        EXPECT_EQ(paired.actions(r).size(), before.actions(r).size());
      }
      ++checked;
    }
  }
  EXPECT_EQ(checked, 18);
}

TEST(Pairs, OnlyAcrossStages) {
  // 1f1b's F and B of one stage are never a pair; nothing moves.
  const Schedule before = ordered("1f1b", 2, 4, 1);
  const Schedule paired = pairForwardBackward(before);
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(pairStarts(paired.actions(r)).empty());
    EXPECT_EQ(actionsToString(paired.actions(r)), actionsToString(before.actions(r)));
  }
}

TEST(Pairs, RefusesComputeOnly) {
  const std::string error = errorOf([] { pairForwardBackward(make("dualpipev", 2, 4, 2)); });
  EXPECT_NE(error.find("is not lowered"), std::string::npos) << error;
}

}  // namespace
}  // namespace pipedream
