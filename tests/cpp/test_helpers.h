// Shared helpers for the schedule engine's GoogleTest suite.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <stdexcept>
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

// The validity grid: every generator over stages, microbatches, chunks,
// replicas and batches (tests/cpp/test_validate.cpp, test_channels.cpp).
struct Case {
  std::string name;
  int p, m, v;
  std::vector<int> replicas;
  int batches;
};

inline std::string describe(const Case& c) {
  std::string out = c.name + " p=" + std::to_string(c.p) + " m=" + std::to_string(c.m) +
                    " v=" + std::to_string(c.v) + " batches=" + std::to_string(c.batches) +
                    " replicas=";
  for (int r : c.replicas) out += std::to_string(r) + ",";
  return out;
}

// Whether the generator documents `c` as impossible.
inline bool expectedToFail(const Case& c) {
  const bool vShape = c.name == "zbv" || c.name == "dualpipev";
  if (vShape && c.v != 2) return true;                  // exactly two chunks, in a V
  if (c.name == "dualpipev") return c.m < 2 * c.p;      // at least one microbatch per stage
  if (c.name == "interleaved-1f1b" || c.name == "interleaved-zb") {
    return c.m % (c.m / std::max(1, c.m / c.p)) != 0;  // equal rounds of >= p microbatches
  }
  std::vector<int> replicas = c.replicas.empty() ? std::vector<int>(c.p, 1) : c.replicas;
  if (c.name == "pipedream-vs" &&
      std::adjacent_find(replicas.begin(), replicas.end(), std::not_equal_to<int>()) != replicas.end()) {
    return true;  // vertical sync needs equal replica counts
  }
  const bool async = c.name.rfind("pipedream", 0) == 0;
  for (int j = 0; j < c.p; ++j) {
    if (async ? c.m % replicas[j] != 0 : c.m < replicas[j]) return true;
    if (c.name == "pipedream-2bw" &&
        c.m < (numOptimalActiveMinibatches(replicas, j) - 1) * replicas[j]) {
      return true;
    }
  }
  return false;
}

inline std::vector<Case> gridCases() {
  std::vector<Case> cases;
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 32; ++m) {
      for (const std::string name : {"gpipe", "1f1b", "zb-h1", "pipedream"}) {
        cases.push_back({name, p, m, 1, {}, 1});
      }
      cases.push_back({"pipedream-vs", p, m, 1, {}, 1});
      cases.push_back({"pipedream-2bw", p, m, 1, {}, 3});
      for (int v = 1; v <= 4; ++v) cases.push_back({"interleaved-1f1b", p, m, v, {}, 1});
      // Zero bubble with several chunks per rank (zbv, dualpipev: exactly 2 in a V).
      for (int v = 1; v <= 3; ++v) {
        cases.push_back({"zbv", p, m, v, {}, 1});
        cases.push_back({"dualpipev", p, m, v, {}, 1});
      }
      for (int v = 1; v <= 4; ++v) cases.push_back({"interleaved-zb", p, m, v, {}, 1});
      if (m <= 8) {
        for (const std::string name : {"zbv", "dualpipev", "interleaved-zb"}) {
          cases.push_back({name, p, m, 2, {}, 2});
        }
      }
    }
  }
  const std::vector<std::vector<int>> layouts = {
      {2, 1}, {1, 2}, {3, 1}, {2, 3}, {2, 1, 1}, {1, 1, 2}, {1, 2, 3}, {2, 1, 1, 1}, {1, 2, 2, 1},
      {3, 3}, {4}};
  for (const auto& layout : layouts) {
    const int p = static_cast<int>(layout.size());
    for (int m = 1; m <= 24; ++m) {
      for (const std::string name : {"gpipe", "1f1b", "zb-h1", "pipedream", "pipedream-vs"}) {
        cases.push_back({name, p, m, 1, layout, 1});
      }
      cases.push_back({"1f1b", p, m, 1, layout, 2});
      cases.push_back({"zb-h1", p, m, 1, layout, 2});
      cases.push_back({"pipedream-2bw", p, m, 1, layout, 3});
    }
  }
  return cases;
}

// Compares every rank's list with the expected text, rank by rank.
inline void expectActions(const Schedule& s, const std::vector<std::string>& expected) {
  ASSERT_EQ(s.numRanks(), static_cast<int>(expected.size()));
  for (int r = 0; r < s.numRanks(); ++r) {
    EXPECT_EQ(actionsToString(s.actions(r)), expected[r]) << "rank " << r;
  }
}

// The message of the invalid_argument `fn` throws ("" if none).
template <typename Fn>
std::string errorOf(Fn fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

}  // namespace testing_helpers
}  // namespace pipedream
