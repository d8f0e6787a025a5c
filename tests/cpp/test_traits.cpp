// The schedule traits table: exact semantics of every schedule.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "generators.h"
#include "traits.h"

namespace pipedream {
namespace {

struct Expected {
  const char* name;
  bool asynchronous;
  UpdateRule updateRule;
  ReplicaReduction replicaReduction;
  int perStepOf4;  // microbatchesPerStep(4)
  bool multiChunk, supportsReplicas, splitBackward, stashWeights, streaming,
      supportsVerticalSync, plannerStraight, plannerTwoVersions;
};

constexpr auto kCaller = UpdateRule::kCallerPerBatch;
constexpr auto kSum = ReplicaReduction::kSum;

const Expected kTable[] = {
    // name               async  update                     reduce                  m/step chunk  repl   split  stash  stream vsync  straight 2v
    {"gpipe",             false, kCaller,                   kSum,                   4,     false, true,  false, false, false, false, false, false},
    {"1f1b",              false, kCaller,                   kSum,                   4,     false, true,  false, false, false, false, false, false},
    {"interleaved-1f1b",  false, kCaller,                   kSum,                   4,     true,  false, false, false, false, false, true,  false},
    {"zb-h1",             false, kCaller,                   kSum,                   4,     false, false, true,  false, false, false, true,  false},
    {"pipedream",         true,  UpdateRule::kPerMinibatch, ReplicaReduction::kMean, 1,    false, true,  false, true,  true,  true,  false, false},
    {"pipedream-2bw",     true,  UpdateRule::kPerBatch,     kSum,                   4,     false, true,  false, true,  true,  false, false, true},
};

TEST(ScheduleTraits, TableIsExact) {
  ASSERT_EQ(allScheduleTraits().size(), std::size(kTable));
  for (size_t k = 0; k < std::size(kTable); ++k) {
    const Expected& e = kTable[k];
    const ScheduleTraits& t = allScheduleTraits()[k];
    SCOPED_TRACE(e.name);
    EXPECT_EQ(t.name, e.name);
    EXPECT_EQ(&scheduleTraits(e.name), &t);
    EXPECT_EQ(t.asynchronous, e.asynchronous);
    EXPECT_EQ(t.updateRule, e.updateRule);
    EXPECT_EQ(t.replicaReduction, e.replicaReduction);
    EXPECT_EQ(t.microbatchesPerStep(4), e.perStepOf4);
    EXPECT_EQ(t.microbatchesPerStep(1), 1);
    EXPECT_EQ(t.multiChunk, e.multiChunk);
    EXPECT_EQ(t.supportsReplicas, e.supportsReplicas);
    EXPECT_EQ(t.splitBackward, e.splitBackward);
    EXPECT_EQ(t.stashWeights, e.stashWeights);
    EXPECT_EQ(t.streaming, e.streaming);
    EXPECT_EQ(t.supportsVerticalSync, e.supportsVerticalSync);
    EXPECT_EQ(t.plannerStraight, e.plannerStraight);
    EXPECT_EQ(t.plannerTwoVersions, e.plannerTwoVersions);
  }
}

TEST(ScheduleTraits, NamesComeFromTheTable) {
  EXPECT_EQ(scheduleNames(), (std::vector<std::string>{"gpipe", "1f1b", "interleaved-1f1b", "zb-h1",
                                                       "pipedream", "pipedream-2bw"}));
}

TEST(ScheduleTraits, EnumNames) {
  EXPECT_STREQ(updateRuleName(UpdateRule::kCallerPerBatch), "caller_per_batch");
  EXPECT_STREQ(updateRuleName(UpdateRule::kPerMinibatch), "per_minibatch");
  EXPECT_STREQ(updateRuleName(UpdateRule::kPerBatch), "per_batch");
  EXPECT_STREQ(replicaReductionName(ReplicaReduction::kSum), "sum");
  EXPECT_STREQ(replicaReductionName(ReplicaReduction::kMean), "mean");
}

TEST(ScheduleTraits, UnknownNameListsTheChoices) {
  try {
    scheduleTraits("1f1c");
    ADD_FAILURE() << "no error for '1f1c'";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "unknown schedule '1f1c'; choose one of: gpipe, 1f1b, interleaved-1f1b, zb-h1, "
              "pipedream, pipedream-2bw");
  }
}

}  // namespace
}  // namespace pipedream
