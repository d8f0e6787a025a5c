// Shared helpers for the schedule engine's GoogleTest suite.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "generators.h"
#include "schedule.h"

namespace pipedream {
namespace testing_helpers {

inline Schedule make(const std::string& name, int p, int m, int v = 1,
                     std::vector<int> replicas = {}, int batches = 1, bool verticalSync = false) {
  ScheduleOptions o;
  o.name = name;
  o.stages = p;
  o.microbatches = m;
  o.chunks = v;
  o.replicas = std::move(replicas);
  o.batches = batches;
  o.verticalSync = verticalSync;
  return buildSchedule(o);
}

// Compares every rank's list with the expected text, rank by rank.
inline void expectActions(const Schedule& s, const std::vector<std::string>& expected) {
  ASSERT_EQ(s.numRanks(), static_cast<int>(expected.size()));
  for (int r = 0; r < s.numRanks(); ++r) {
    EXPECT_EQ(actionsToString(s.actions(r)), expected[r]) << "rank " << r;
  }
}

}  // namespace testing_helpers
}  // namespace pipedream
