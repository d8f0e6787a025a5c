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
  int fixedChunks;
  ChunkPlacement placement;
};

constexpr auto kCaller = UpdateRule::kCallerPerBatch;
constexpr auto kSum = ReplicaReduction::kSum;
constexpr auto kRR = ChunkPlacement::kRoundRobin;
constexpr auto kV = ChunkPlacement::kV;

const Expected kTable[] = {
    // name               async  update                     reduce                  m/step chunk  repl   split  stash  stream vsync  straight 2v    fixed place
    {"gpipe",             false, kCaller,                   kSum,                   4,     false, true,  false, false, false, false, false, false, 0,    kRR},
    {"1f1b",              false, kCaller,                   kSum,                   4,     false, true,  false, false, false, false, false, false, 0,    kRR},
    {"interleaved-1f1b",  false, kCaller,                   kSum,                   4,     true,  false, false, false, false, false, true,  false, 0,    kRR},
    {"zb-h1",             false, kCaller,                   kSum,                   4,     false, true,  true,  false, false, false, true,  false, 0,    kRR},
    {"zbv",               false, kCaller,                   kSum,                   4,     true,  false, true,  false, false, false, true,  false, 2,    kV},
    {"dualpipev",         false, kCaller,                   kSum,                   4,     true,  false, true,  false, false, false, true,  false, 2,    kV},
    {"interleaved-zb",    false, kCaller,                   kSum,                   4,     true,  false, true,  false, false, false, true,  false, 0,    kRR},
    {"pipedream",         true,  UpdateRule::kPerMinibatch, ReplicaReduction::kMean, 1,    false, true,  false, true,  true,  true,  false, false, 0,    kRR},
    {"pipedream-2bw",     true,  UpdateRule::kPerBatch,     kSum,                   4,     false, true,  false, true,  true,  false, false, true,  0,    kRR},
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
    EXPECT_EQ(t.fixedChunks, e.fixedChunks);
    EXPECT_EQ(t.chunkPlacement, e.placement);
  }
}

TEST(ScheduleTraits, NamesComeFromTheTable) {
  EXPECT_EQ(scheduleNames(), (std::vector<std::string>{"gpipe", "1f1b", "interleaved-1f1b", "zb-h1",
                                                       "zbv", "dualpipev", "interleaved-zb",
                                                       "pipedream", "pipedream-2bw"}));
}

TEST(ScheduleTraits, EnumNames) {
  EXPECT_STREQ(updateRuleName(UpdateRule::kCallerPerBatch), "caller_per_batch");
  EXPECT_STREQ(updateRuleName(UpdateRule::kPerMinibatch), "per_minibatch");
  EXPECT_STREQ(updateRuleName(UpdateRule::kPerBatch), "per_batch");
  EXPECT_STREQ(replicaReductionName(ReplicaReduction::kSum), "sum");
  EXPECT_STREQ(replicaReductionName(ReplicaReduction::kMean), "mean");
  EXPECT_STREQ(chunkPlacementName(ChunkPlacement::kRoundRobin), "round_robin");
  EXPECT_STREQ(chunkPlacementName(ChunkPlacement::kV), "v");
}

TEST(ScheduleTraits, UnknownNameListsTheChoices) {
  try {
    scheduleTraits("1f1c");
    ADD_FAILURE() << "no error for '1f1c'";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "unknown schedule '1f1c'; choose one of: gpipe, 1f1b, interleaved-1f1b, zb-h1, "
              "zbv, dualpipev, interleaved-zb, pipedream, pipedream-2bw");
  }
}

}  // namespace
}  // namespace pipedream
