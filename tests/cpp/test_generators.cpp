// Golden action lists: every generator, small cases, exact equality.
#include <gtest/gtest.h>

#include <functional>

#include "lower.h"
#include "test_helpers.h"

namespace pipedream {
namespace {

using testing_helpers::expectActions;
using testing_helpers::make;

TEST(GeneratorGolden, GPipe) {
  expectActions(make("gpipe", 4, 8), {
      "0F0 0F1 0F2 0F3 0F4 0F5 0F6 0F7 0B0 0B1 0B2 0B3 0B4 0B5 0B6 0B7 0U1",
      "1F0 1F1 1F2 1F3 1F4 1F5 1F6 1F7 1B0 1B1 1B2 1B3 1B4 1B5 1B6 1B7 1U1",
      "2F0 2F1 2F2 2F3 2F4 2F5 2F6 2F7 2B0 2B1 2B2 2B3 2B4 2B5 2B6 2B7 2U1",
      "3F0 3F1 3F2 3F3 3F4 3F5 3F6 3F7 3B0 3B1 3B2 3B3 3B4 3B5 3B6 3B7 3U1",
  });
}

TEST(GeneratorGolden, OneFOneB) {
  expectActions(make("1f1b", 4, 8), {
      "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7 0U1",
      "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7 1U1",
      "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7 2U1",
      "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7 3U1",
  });
}

TEST(GeneratorGolden, OneFOneBTwoBatches) {
  expectActions(make("1f1b", 2, 2, 1, {}, 2), {
      "0F0 0F1 0B0 0B1 0U1 0F2v1 0F3v1 0B2v1 0B3v1 0U2",
      "1F0 1B0 1F1 1B1 1U1 1F2v1 1B2v1 1F3v1 1B3v1 1U2",
  });
}

TEST(GeneratorGolden, Interleaved) {
  // Megatron-LM order: rank r warms up with (p-r-1)*2 + (v-1)*p forwards.
  expectActions(make("interleaved-1f1b", 4, 8, 2), {
      "0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 0F6 4B0 0F7 4B1 4F4 4B2 4F5 4B3 4F6 0B0 4F7 0B1 "
      "0B2 0B3 4B4 4B5 4B6 4B7 0B4 0B5 0B6 0B7 0U1 4U1",
      "1F0 1F1 1F2 1F3 5F0 5F1 5F2 5F3 1F4 5B0 1F5 5B1 1F6 5B2 1F7 5B3 5F4 1B0 5F5 1B1 5F6 1B2 "
      "5F7 1B3 5B4 5B5 5B6 5B7 1B4 1B5 1B6 1B7 1U1 5U1",
      "2F0 2F1 2F2 2F3 6F0 6F1 6F2 6B0 6F3 6B1 2F4 6B2 2F5 6B3 2F6 2B0 2F7 2B1 6F4 2B2 6F5 2B3 "
      "6F6 6B4 6F7 6B5 6B6 6B7 2B4 2B5 2B6 2B7 2U1 6U1",
      "3F0 3F1 3F2 3F3 7F0 7B0 7F1 7B1 7F2 7B2 7F3 7B3 3F4 3B0 3F5 3B1 3F6 3B2 3F7 3B3 7F4 7B4 "
      "7F5 7B5 7F6 7B6 7F7 7B7 3B4 3B5 3B6 3B7 3U1 7U1",
  });
}

TEST(GeneratorGolden, ZeroBubbleH1) {
  expectActions(make("zb-h1", 4, 8), {
      "0F0 0F1 0F2 0F3 0I0 0F4 0I1 0F5 0I2 0F6 0I3 0W0 0F7 0I4 0W1 0W2 0I5 0W3 0W4 0I6 0W5 0W6 "
      "0I7 0W7 0U1",
      "1F0 1F1 1F2 1I0 1F3 1I1 1F4 1I2 1F5 1I3 1W0 1F6 1I4 1W1 1F7 1I5 1W2 1W3 1I6 1W4 1W5 1I7 "
      "1W6 1W7 1U1",
      "2F0 2F1 2I0 2F2 2I1 2F3 2I2 2F4 2I3 2W0 2F5 2I4 2W1 2F6 2I5 2W2 2F7 2I6 2W3 2W4 2I7 2W5 "
      "2W6 2W7 2U1",
      "3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4 3I4 3W1 3F5 3I5 3W2 3F6 3I6 3W3 3F7 3I7 3W4 3W5 "
      "3W6 3W7 3U1",
  });
}

// The zero-bubble schedules with two chunks per rank follow
// torch.distributed.pipelining's generators (torch 2.13) action for action
// (tests/test_schedules.py compares every p <= 6, m <= 24 with torch's own
// code); these small cases were also walked through by hand from the phase
// rules in generators.cpp. Chunk 0 of rank r is stage r; chunk 1 is stage
// 2p-1-r (zbv, dualpipev) or r+p (interleaved-zb).
TEST(GeneratorGolden, ZeroBubbleV) {
  // p = 2 (stages 0,3 on rank 0; 1,2 on rank 1), m = 4. Rank 0: warm-up 3 x F0, 2 x (F1 I1
  // W1); steady F0 I0 W0 F1 I1 W1; drain I0 W0. Rank 1: F0, (F1 F0), (F1 I1 W1), steady,
  // then I0 I1, I0 W0, the W1 left, the W0 left. The turn (1F0 -> 2F0) is on rank 1.
  expectActions(make("zbv", 2, 4, 2), {
      "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 "
      "0I3 0W3 0U1 3U1",
      "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 "
      "2W3 1W3 1U1 2U1",
  });
}

TEST(GeneratorGolden, ZeroBubbleVFewerMicrobatchesThanRanks) {
  // m = 2 < p = 3: the order of max(m, 2p-1) = 5 microbatches with microbatches >= 2 dropped.
  expectActions(make("zbv", 3, 2, 2), {
      "0F0 0F1 5F0 5I0 5W0 5F1 5I1 5W1 0I0 0W0 0I1 0W1 0U1 5U1",
      "1F0 1F1 4F0 4F1 4I0 4W0 4I1 4W1 1I0 1W0 1I1 1W1 1U1 4U1",
      "2F0 3F0 2F1 3F1 3I0 3W0 2I0 2W0 3I1 3W1 2I1 2W1 2U1 3U1",
  });
}

TEST(GeneratorGolden, DualPipeV) {
  // p = 2, m = 4 (= 2p, the fewest). "F&B" pairs are an F and a full B of the other chunk,
  // adjacent (rank 0: 0F3 3B1, 3F2 0B0, ...); the drain splits the second half into I and W.
  expectActions(make("dualpipev", 2, 4, 2), {
      "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3 0U1 3U1",
      "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3 1U1 2U1",
  });
  expectActions(make("dualpipev", 3, 6, 2), {
      "0F0 0F1 0F2 0F3 0F4 5F0 5I0 5W0 5F1 5I1 5W1 5F2 0F5 5B2 5F3 0B0 5B3 5F4 0B1 5B4 5F5 0B2 "
      "5B5 0I3 0W3 0I4 0W4 0I5 0W5 0U1 5U1",
      "1F0 1F1 1F2 4F0 1F3 4F1 4I0 4W0 4F2 1F4 4B1 4F3 1B0 1F5 4B2 4F4 1B1 4B3 4F5 1B2 4B4 1B3 "
      "4I5 1I4 4W5 1I5 1W4 1W5 1U1 4U1",
      "2F0 3F0 2F1 3F1 2F2 3F2 2F3 3B0 3F3 2B0 2F4 3B1 3F4 2B1 2F5 3B2 3F5 2B2 3B3 2B3 3B4 2I4 "
      "3I5 2I5 2W4 3W5 2W5 2U1 3U1",
  });
}

TEST(GeneratorGolden, InterleavedZeroBubble) {
  // p = 2, v = 2 (stages 0,2 on rank 0; 1,3 on rank 1), m = 4: rounds of 2; rank r warms up
  // with (v-1)*2 + (p-1-r) forwards and defers its W's by r backwards.
  expectActions(make("interleaved-zb", 2, 4, 2), {
      "0F0 0F1 2F0 2F1 2I0 2W0 0F2 2I1 2W1 0F3 0I0 0W0 2F2 0I1 0W1 2F3 2I2 2W2 2I3 2W3 0I2 0W2 "
      "0I3 0W3 0U1 2U1",
      "1F0 1F1 3F0 3I0 3F1 3I1 3W0 1F2 1I0 3W1 1F3 1I1 1W0 3F2 3I2 1W1 3F3 3I3 3W2 1I2 3W3 1I3 "
      "1W2 1W3 1U1 3U1",
  });
}

TEST(GeneratorGolden, VLayoutTwoBatches) {
  // The second batch reads version 1, after each local stage's U1.
  const Schedule s = make("zbv", 1, 1, 2, {}, 2);
  expectActions(s, {"0F0 1F0 1I0 1W0 0I0 0W0 0U1 1U1 0F1v1 1F1v1 1I1v1 1W1v1 0I1v1 0W1v1 0U2 1U2"});
}

TEST(Layout, VPlacementAndItsLowering) {
  const Layout v = Layout::chunked(3, 2, ChunkPlacement::kV);
  std::vector<int> ranks;
  for (int j = 0; j < v.numStages(); ++j) ranks.push_back(v.stageRanks(j)[0]);
  EXPECT_EQ(ranks, (std::vector<int>{0, 1, 2, 2, 1, 0}));
  EXPECT_EQ(v.stagesOfRank(0), (std::vector<int>{0, 5}));
  EXPECT_EQ(v.stagesOfRank(2), (std::vector<int>{2, 3}));
  const Layout w = Layout::chunked(2, 3, ChunkPlacement::kV);  // more chunks zigzag
  ranks.clear();
  for (int j = 0; j < w.numStages(); ++j) ranks.push_back(w.stageRanks(j)[0]);
  EXPECT_EQ(ranks, (std::vector<int>{0, 1, 1, 0, 0, 1}));
  EXPECT_EQ(Layout::chunked(3, 2, ChunkPlacement::kRoundRobin), Layout::interleaved(3, 2));
  // The turn of the V (stage p-1 -> p, both on rank p-1) and the last stage on rank 0
  // exchange nothing; every other boundary sends. p = 2, m = 1:
  expectActions(lower(make("zbv", 2, 1, 2)), {
      "0F0 0SEND_F0 3RECV_F0 3F0 3I0 3SEND_B0 3W0 0RECV_B0 0I0 0W0 0U1 3U1",
      "1RECV_F0 1F0 2F0 2SEND_F0 2RECV_B0 2I0 2W0 1I0 1SEND_B0 1W0 1U1 2U1",
  });
}

TEST(GeneratorGolden, PipeDream) {
  // F(i) on stage j reads version max(0, i - (p-1-j)); an update after every B.
  expectActions(make("pipedream", 4, 8), {
      "0F0 0F1 0F2 0F3 0B0 0U1 0F4v1 0B1 0U2 0F5v2 0B2 0U3 0F6v3 0B3 0U4 0F7v4 0B4v1 0U5 0B5v2 "
      "0U6 0B6v3 0U7 0B7v4 0U8",
      "1F0 1F1 1F2 1B0 1U1 1F3v1 1B1 1U2 1F4v2 1B2 1U3 1F5v3 1B3v1 1U4 1F6v4 1B4v2 1U5 1F7v5 "
      "1B5v3 1U6 1B6v4 1U7 1B7v5 1U8",
      "2F0 2F1 2B0 2U1 2F2v1 2B1 2U2 2F3v2 2B2v1 2U3 2F4v3 2B3v2 2U4 2F5v4 2B4v3 2U5 2F6v5 "
      "2B5v4 2U6 2F7v6 2B6v5 2U7 2B7v6 2U8",
      "3F0 3B0 3U1 3F1v1 3B1v1 3U2 3F2v2 3B2v2 3U3 3F3v3 3B3v3 3U4 3F4v4 3B4v4 3U5 3F5v5 3B5v5 "
      "3U6 3F6v6 3B6v6 3U7 3F7v7 3B7v7 3U8",
  });
}

TEST(GeneratorGolden, PipeDreamVerticalSync) {
  // Every stage reads stage 0's version of the minibatch: max(0, i - (p-1)).
  expectActions(make("pipedream", 3, 5, 1, {}, 1, /*verticalSync=*/true), {
      "0F0 0F1 0F2 0B0 0U1 0F3v1 0B1 0U2 0F4v2 0B2 0U3 0B3v1 0U4 0B4v2 0U5",
      "1F0 1F1 1B0 1U1 1F2 1B1 1U2 1F3v1 1B2 1U3 1F4v2 1B3v1 1U4 1B4v2 1U5",
      "2F0 2B0 2U1 2F1 2B1 2U2 2F2 2B2 2U3 2F3v1 2B3v1 2U4 2F4v2 2B4v2 2U5",
  });
}

TEST(GeneratorGolden, PipeDreamReplicated) {
  // 2-1-1: minibatch i runs on replica i % 2 of stage 0; NOAM = ceil(4/2) = 2.
  expectActions(make("pipedream", 3, 8, 1, {2, 1, 1}), {
      "0F0 0F2 0B0 0ALLREDUCE1 0U1 0F4v1 0B2 0ALLREDUCE2 0U2 0F6v2 0B4v1 0ALLREDUCE3 0U3 0B6v2 "
      "0ALLREDUCE4 0U4",
      "0F1 0F3 0B1 0ALLREDUCE1 0U1 0F5v1 0B3 0ALLREDUCE2 0U2 0F7v2 0B5v1 0ALLREDUCE3 0U3 0B7v2 "
      "0ALLREDUCE4 0U4",
      "1F0 1F1 1B0 1U1 1F2v1 1B1 1U2 1F3v2 1B2v1 1U3 1F4v3 1B3v2 1U4 1F5v4 1B4v3 1U5 1F6v5 "
      "1B5v4 1U6 1F7v6 1B6v5 1U7 1B7v6 1U8",
      "2F0 2B0 2U1 2F1v1 2B1v1 2U2 2F2v2 2B2v2 2U3 2F3v3 2B3v3 2U4 2F4v4 2B4v4 2U5 2F5v5 2B5v5 "
      "2U6 2F6v6 2B6v6 2U7 2F7v7 2B7v7 2U8",
  });
}

TEST(GeneratorGolden, PipeDream2BW) {
  // Batch t (microbatches 4t..4t+3) reads version max(0, t-1).
  expectActions(make("pipedream-2bw", 4, 4, 1, {}, 3), {
      "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0U1 0F7 0B4 0F8v1 0B5 0F9v1 0B6 0F10v1 0B7 "
      "0U2 0F11v1 0B8v1 0B9v1 0B10v1 0B11v1 0U3",
      "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1U1 1F6 1B4 1F7 1B5 1F8v1 1B6 1F9v1 1B7 1U2 "
      "1F10v1 1B8v1 1F11v1 1B9v1 1B10v1 1B11v1 1U3",
      "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2U1 2F5 2B4 2F6 2B5 2F7 2B6 2F8v1 2B7 2U2 2F9v1 "
      "2B8v1 2F10v1 2B9v1 2F11v1 2B10v1 2B11v1 2U3",
      "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3U1 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7 3U2 3F8v1 3B8v1 "
      "3F9v1 3B9v1 3F10v1 3B10v1 3F11v1 3B11v1 3U3",
  });
}

TEST(GeneratorGolden, OneFOneBReplicatedLastStage) {
  expectActions(make("1f1b", 2, 4, 1, {1, 2}), {
      "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3 0U1",
      "1F0 1B0 1F2 1B2 1ALLREDUCE1 1U1",
      "1F1 1B1 1F3 1B3 1ALLREDUCE1 1U1",
  });
}

TEST(GeneratorGolden, LoweredOneFOneB) {
  // SEND right after the producer, RECV right before the consumer.
  const Schedule s = make("1f1b", 2, 2);
  expectActions(lower(s), {
      "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0U1",
      "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1U1",
  });
}

TEST(GeneratorErrors, NamesTheBadValue) {
  auto expectError = [](const std::function<void()>& fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expectError([] { make("1f1c", 4, 8); }, "unknown schedule '1f1c'");
  expectError([] { make("1f1b", 0, 8); }, "stages must be >= 1 (got 0)");
  expectError([] { make("gpipe", 4, 0); }, "microbatches must be >= 1 (got 0)");
  expectError([] { make("interleaved-1f1b", 3, 7, 2); }, "got m=7, p=3: rounds of 3 leave 1 over); use m=8");
  expectError([] { make("interleaved-1f1b", 4, 8, 0); }, "chunks must be >= 1 (got 0)");
  expectError([] { make("1f1b", 4, 8, 2); }, "got chunks=2");
  expectError([] { make("zbv", 4, 8); }, "exactly 2 chunks per rank in a V (rank r holds stages r "
                                         "and 2p-1-r; got chunks=1); use chunks=2");
  expectError([] { make("dualpipev", 4, 8, 3); }, "got chunks=3); use chunks=2");
  expectError([] { make("dualpipev", 4, 7, 2); }, "(2p = 8 for p=4 ranks, got m=7); use m=8");
  expectError([] { make("interleaved-zb", 3, 7, 2); }, "got m=7, p=3: rounds of 3 leave 1 over); use m=8");
  expectError([] { make("zbv", 2, 4, 2, {2, 1, 1, 1}); }, "does not support replicated stages");
  expectError([] { make("interleaved-zb", 2, 4, 2, {2, 1, 1, 1}); }, "does not support replicated stages");
  expectError([] { make("zb-h1", 2, 1, 1, {2, 1}); }, "needs microbatches >= 2");
  expectError([] { make("pipedream", 2, 5, 1, {2, 1}); }, "multiple of 2");
  expectError([] { make("pipedream", 2, 4, 1, {2}); }, "1 counts for 2 stages");
  expectError([] { make("pipedream", 2, 4, 1, {0, 1}); }, "replica count of stage 0 must be >= 1");
  expectError([] { make("pipedream-2bw", 4, 2); }, "needs at least 3 microbatches");
  expectError([] { make("pipedream", 2, 4, 1, {}, 2); }, "batches does not apply");
  expectError([] { make("1f1b", 2, 4, 1, {}, 1, true); }, "vertical sync applies to schedule 'pipedream' only");
  expectError([] { make("pipedream", 2, 4, 1, {1, 2}, 1, true); }, "same replica count on every stage");
}

}  // namespace
}  // namespace pipedream
