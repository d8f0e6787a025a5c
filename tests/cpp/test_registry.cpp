// The schedule registry (generators.h): one row per schedule, traits plus
// generator. Every schedule in traits has a generator, and every generator's
// output, over the shapes its traits allow, validates (compute-only and
// lowered). The shapes come from the traits, so a new row is tested here
// without editing this file.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "generators.h"
#include "lower.h"
#include "test_helpers.h"
#include "traits.h"
#include "validate.h"

namespace pipedream {
namespace {

TEST(ScheduleRegistry, CoversEveryScheduleInTraits) {
  const auto& rows = scheduleRegistry();
  const auto& traits = allScheduleTraits();
  const auto names = scheduleNames();
  ASSERT_EQ(rows.size(), traits.size());
  ASSERT_EQ(rows.size(), names.size());
  std::set<std::string> seen;
  for (size_t k = 0; k < rows.size(); ++k) {
    SCOPED_TRACE(traits[k].name);
    EXPECT_NE(rows[k].generate, nullptr);
    EXPECT_EQ(rows[k].traits.name, traits[k].name);
    EXPECT_EQ(names[k], traits[k].name);
    EXPECT_EQ(&scheduleTraits(traits[k].name), &traits[k]);
    EXPECT_TRUE(seen.insert(traits[k].name).second) << "registered twice";
  }
  // The schedules the rest of the package documents (test_traits.cpp's table).
  for (const char* name : {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev",
                           "interleaved-zb", "pipedream", "pipedream-2bw"}) {
    EXPECT_EQ(seen.count(name), 1u) << name << " has no registry row";
  }
}

TEST(ScheduleRegistry, UnknownNameListsTheChoices) {
  ScheduleOptions o;
  o.name = "1f1c";
  try {
    buildSchedule(o);
    ADD_FAILURE() << "no error for '1f1c'";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "unknown schedule '1f1c'; choose one of: gpipe, 1f1b, interleaved-1f1b, zb-h1, "
              "zbv, dualpipev, interleaved-zb, pipedream, pipedream-2bw");
  }
}

// The options a row's traits allow: chunks, replicas and batches as the
// traits say, over small pipelines and microbatch counts.
std::vector<ScheduleOptions> shapesFor(const ScheduleTraits& traits) {
  std::vector<int> chunkCounts{1};
  if (traits.fixedChunks > 0) {
    chunkCounts = {traits.fixedChunks};
  } else if (traits.multiChunk) {
    chunkCounts = {1, 2, 3};
  }
  const std::vector<int> batchCounts =
      traits.updateRule == UpdateRule::kPerMinibatch ? std::vector<int>{1} : std::vector<int>{1, 2};
  std::vector<ScheduleOptions> shapes;
  for (int p = 1; p <= 4; ++p) {
    std::vector<std::vector<int>> replicaSets{{}};
    if (traits.supportsReplicas) replicaSets.push_back(std::vector<int>(p, 1));
    if (traits.supportsReplicas) replicaSets.back()[0] = 2;
    for (int m = 1; m <= 12; ++m) {
      for (int v : chunkCounts) {
        for (const auto& replicas : replicaSets) {
          for (int batches : batchCounts) {
            ScheduleOptions o;
            o.name = traits.name;
            o.stages = p;
            o.microbatches = m;
            o.chunks = v;
            o.replicas = replicas;
            o.batches = batches;
            shapes.push_back(o);
          }
        }
      }
    }
  }
  return shapes;
}

TEST(ScheduleRegistry, EveryGeneratorsOutputValidates) {
  for (const auto& row : scheduleRegistry()) {
    int built = 0;
    for (const ScheduleOptions& o : shapesFor(row.traits)) {
      SCOPED_TRACE(testing_helpers::describe(
          {o.name, o.stages, o.microbatches, o.chunks, o.replicas, o.batches}));
      Schedule s;
      try {
        s = buildSchedule(o);
      } catch (const std::invalid_argument&) {
        continue;  // a documented refusal (m < 2p for dualpipev, unequal rounds, ...)
      }
      ASSERT_EQ(s.name(), row.traits.name);
      ASSERT_NO_THROW(validate(s));
      ASSERT_NO_THROW(validate(lower(s)));
      ++built;
    }
    // Most shapes build: a generator that refused everything would pass above.
    EXPECT_GT(built, 40) << row.traits.name;
  }
}

TEST(ScheduleRegistry, ValidityGridNamesEverySchedule) {
  std::set<std::string> inGrid;
  for (const auto& c : testing_helpers::gridCases()) inGrid.insert(c.name);
  for (const auto& name : scheduleNames()) {
    EXPECT_EQ(inGrid.count(name), 1u) << name << " is missing from gridCases() (test_helpers.h)";
  }
}

}  // namespace
}  // namespace pipedream
