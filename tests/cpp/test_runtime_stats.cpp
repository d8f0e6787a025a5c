// RuntimeStats::merge: sums, maxima for peaks, per-key kinds and stages.
#include <gtest/gtest.h>

#include "runtime_stats.h"

namespace pipedream {
namespace {

TEST(RuntimeStats, EmptyHasNoBubble) {
  const RuntimeStats s;
  EXPECT_EQ(s.bubbleFraction(), 0.0);
  EXPECT_EQ(s.merge(s).steps, 0);
}

TEST(RuntimeStats, BubbleFraction) {
  RuntimeStats s;
  s.computeSeconds = 1.5;
  s.busySeconds = 2.0;
  EXPECT_DOUBLE_EQ(s.bubbleFraction(), 0.25);
}

TEST(RuntimeStats, MergeSumsCountersAndTakesPeakMaxima) {
  RuntimeStats a, b;
  a.computeSeconds = 1; a.waitSeconds = 2; a.busySeconds = 4; a.actions = 10; a.steps = 1;
  a.secondsByKind = {{"F", 1.0}, {"RECV_B", 0.5}};
  a.bytesSent = 100; a.bytesReceived = 50; a.sends = 3; a.receives = 2;
  a.prePostedReceives = 1; a.redirectedSends = 0;
  a.peakActivations = 2; a.peakSendsInFlight = 5; a.peakWeightVersions = {{0, 3}, {1, 1}};
  a.weightBytesCopied = 64;
  a.overlapYields = 3;
  b.computeSeconds = 0.5; b.waitSeconds = 1; b.busySeconds = 2; b.actions = 4; b.steps = 2;
  b.secondsByKind = {{"F", 2.0}, {"B", 3.0}};
  b.bytesSent = 1; b.bytesReceived = 2; b.sends = 1; b.receives = 1;
  b.prePostedReceives = 1; b.redirectedSends = 1;
  b.peakActivations = 4; b.peakSendsInFlight = 1; b.peakWeightVersions = {{1, 2}, {2, 1}};
  b.weightBytesCopied = 32;
  b.overlapYields = 4;

  const RuntimeStats m = a.merge(b);
  EXPECT_DOUBLE_EQ(m.computeSeconds, 1.5);
  EXPECT_DOUBLE_EQ(m.waitSeconds, 3);
  EXPECT_DOUBLE_EQ(m.busySeconds, 6);
  EXPECT_EQ(m.actions, 14);
  EXPECT_EQ(m.steps, 3);
  EXPECT_EQ(m.secondsByKind, (std::map<std::string, double>{{"B", 3.0}, {"F", 3.0}, {"RECV_B", 0.5}}));
  EXPECT_EQ(m.bytesSent, 101);
  EXPECT_EQ(m.bytesReceived, 52);
  EXPECT_EQ(m.sends, 4);
  EXPECT_EQ(m.receives, 3);
  EXPECT_EQ(m.prePostedReceives, 2);
  EXPECT_EQ(m.redirectedSends, 1);
  EXPECT_EQ(m.peakActivations, 4);
  EXPECT_EQ(m.peakSendsInFlight, 5);
  EXPECT_EQ(m.peakWeightVersions, (std::map<int, int64_t>{{0, 3}, {1, 2}, {2, 1}}));
  EXPECT_EQ(m.weightBytesCopied, 96);
  EXPECT_EQ(m.overlapYields, 7);
  EXPECT_DOUBLE_EQ(m.bubbleFraction(), 0.75);
  // The operands are unchanged.
  EXPECT_EQ(a.steps, 1);
  EXPECT_EQ(b.peakWeightVersions.size(), 2u);
}

TEST(RuntimeStats, AWaitOutsideTheExecutorIsBusyAndIdle) {
  RuntimeStats s;
  s.computeSeconds = 1;
  s.waitSeconds = 1;
  s.busySeconds = 2;
  s.secondsByKind = {{"F", 1.0}, {"RECV_F", 1.0}};
  const RuntimeStats w = s.withWait("TIED_ALLREDUCE", 2.0).withWait("TIED_ALLREDUCE", 1.0);
  EXPECT_DOUBLE_EQ(w.waitSeconds, 4);
  EXPECT_DOUBLE_EQ(w.busySeconds, 5);
  EXPECT_DOUBLE_EQ(w.computeSeconds, 1);
  EXPECT_EQ(w.secondsByKind,
            (std::map<std::string, double>{{"F", 1.0}, {"RECV_F", 1.0}, {"TIED_ALLREDUCE", 3.0}}));
  EXPECT_DOUBLE_EQ(w.bubbleFraction(), 0.8);
  EXPECT_DOUBLE_EQ(s.busySeconds, 2);  // unchanged
}

}  // namespace
}  // namespace pipedream
