// Simulated figures against the known closed forms.
#include <gtest/gtest.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "lower.h"
#include "simulate.h"
#include "test_helpers.h"

namespace pipedream {
namespace {

using testing_helpers::make;

SimulationResult run(const Schedule& s, double tF, double tB, double tW, double tComm = 0.0) {
  return simulate(lower(s), StageCosts::uniform(s.numStages(), tF, tB, tW, tComm));
}

double bubbleTime(const SimulationResult& r) {
  // Idle time of rank 0 (every rank has the same total work here).
  return r.makespan - r.busyTimePerRank[0];
}

TEST(SimulatorFormula, GPipeAndOneFOneBBubbleIsPMinusOneOverMPlusPMinusOne) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 32; ++m) {
      const double expected = static_cast<double>(p - 1) / (m + p - 1);
      for (const std::string name : {"gpipe", "1f1b"}) {
        SCOPED_TRACE(name + " p=" + std::to_string(p) + " m=" + std::to_string(m));
        const auto r = run(make(name, p, m), 1.0, 1.0, 0.0);
        EXPECT_NEAR(r.bubbleFraction, expected, 1e-12);
        EXPECT_DOUBLE_EQ(r.makespan, 2.0 * (m + p - 1));
      }
    }
  }
}

TEST(SimulatorFormula, OneFOneBKeepsPMinusSActivationsGPipeKeepsM) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 32; ++m) {
      const auto oneF = run(make("1f1b", p, m), 1.0, 2.0, -1.0);
      const auto gpipe = run(make("gpipe", p, m), 1.0, 2.0, -1.0);
      for (int s = 0; s < p; ++s) {
        EXPECT_EQ(oneF.peakActivations[s], std::min(p - s, m)) << "p=" << p << " m=" << m;
        EXPECT_EQ(gpipe.peakActivations[s], m);
        EXPECT_EQ(oneF.peakWeightVersions[s], 1);
      }
    }
  }
}

TEST(SimulatorFormula, CommunicationAddsLatencyPerBoundary) {
  // GPipe with unit F and B and latency c: the forward and the backward wave
  // each cross p-1 boundaries.
  for (int p = 2; p <= 6; ++p) {
    const int m = 5;
    const double c = 0.25;
    const auto r = run(make("gpipe", p, m), 1.0, 1.0, 0.0, c);
    EXPECT_DOUBLE_EQ(r.makespan, 2.0 * m + 2.0 * (p - 1) * (1.0 + c)) << "p=" << p;
  }
}

TEST(SimulatorFormula, InterleavedBubbleIsSmallerByAboutV) {
  // Same model: each of the v chunks costs 1/v of a 1f1b stage.
  for (int p : {2, 4, 8}) {
    for (int v : {2, 3, 4}) {
      const int m = 4 * p;
      const double oneF = bubbleTime(run(make("1f1b", p, m), 1.0, 2.0, -1.0));
      const double inter =
          bubbleTime(run(make("interleaved-1f1b", p, m, v), 1.0 / v, 2.0 / v, -1.0));
      SCOPED_TRACE("p=" + std::to_string(p) + " v=" + std::to_string(v));
      EXPECT_NEAR(oneF, 3.0 * (p - 1), 1e-9);
      // Megatron's interleaved bubble: (p-1)(tF+tB)/v.
      EXPECT_NEAR(inter, oneF / v, 1e-9);
    }
  }
}

TEST(SimulatorFormula, ZeroBubbleH1HasAThirdOfOneFOneBsBubble) {
  // tF = tI = tW: 1f1b idles (p-1)(tF+tI+tW) per rank, zb-h1 (p-1)(tF+tI-tW).
  for (int p = 2; p <= 8; ++p) {
    for (int m = p; m <= 32; m += 3) {
      SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m));
      const auto oneF = run(make("1f1b", p, m), 1.0, 1.0, 1.0);
      const auto zb = run(make("zb-h1", p, m), 1.0, 1.0, 1.0);
      EXPECT_NEAR(bubbleTime(oneF), 3.0 * (p - 1), 1e-9);
      EXPECT_NEAR(bubbleTime(zb), 1.0 * (p - 1), 1e-9);
      EXPECT_NEAR(zb.makespan, 3.0 * m + p - 1, 1e-9);
      // 1F1B's activation memory; at most p weight gradients wait.
      for (int s = 0; s < p; ++s) {
        EXPECT_EQ(zb.peakActivations[s], p - s);
        EXPECT_LE(zb.peakDeferredWeightGrads[s], p);
      }
    }
  }
}

// The schedules with two chunks per rank below: every chunk costs 1 per F, I
// and W (tF = tI = tW, the zero-bubble paper's design point), so a rank's
// work per microbatch is 6 and a whole-rank stage costs T = 2 per pass.

// Each rank's first compute start and last compute end.
std::vector<std::pair<double, double>> spans(const SimulationResult& r, int ranks) {
  std::vector<std::pair<double, double>> out(ranks, {1e300, 0.0});
  for (const auto& e : r.timeline) {
    if (!isCompute(e.action.kind)) continue;
    out[e.rank].first = std::min(out[e.rank].first, e.start);
    out[e.rank].second = std::max(out[e.rank].second, e.end);
  }
  return out;
}

TEST(SimulatorFormula, ZeroBubbleVHasNoBubbleAtOneFOneBActivationMemory) {
  // Published (zero-bubble paper, ZB-V): no bubble when T_F = T_B = T_W. Simulated: rank r
  // computes without a gap from r to 6m + r (the parallelogram); the only idle time is the
  // fill of a flushed batch, r before and p-1-r after, p-1 per rank. Activations: 2p chunks
  // per rank, i.e. p whole-rank microbatches like 1F1B's first stage.
  for (int p = 1; p <= 6; ++p) {
    for (int m = std::max(1, 2 * p - 1); m <= 24; ++m) {
      SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m));
      const auto r = run(make("zbv", p, m, 2), 1.0, 1.0, 1.0);
      const auto span = spans(r, p);
      for (int rank = 0; rank < p; ++rank) {
        EXPECT_DOUBLE_EQ(span[rank].first, rank);
        EXPECT_DOUBLE_EQ(span[rank].second, 6.0 * m + rank);
        EXPECT_DOUBLE_EQ(r.busyTimePerRank[rank], 6.0 * m);
        EXPECT_EQ(r.peakActivationsPerRank[rank], 2 * p);
      }
      EXPECT_DOUBLE_EQ(r.makespan, 6.0 * m + p - 1);
      EXPECT_NEAR(bubbleTime(r), p - 1.0, 1e-9);
    }
  }
}

TEST(SimulatorFormula, DualPipeVBubbleAgainstDeepSeeksFormula) {
  // Published (DualPipe README, PP = 2p stages): (PP/2-1)(F&B + B - 3W) per rank, F&B the
  // time of an overlapped forward/backward pair, B = I + W. Our executor runs the pair's F
  // and B one after the other, so F&B = F + B = 3 and the formula gives 2(p-1). Simulated:
  // p-1 (the pair's F need not wait for the B's gradient and its output leaves first),
  // from m = 2p on; activations 2p + 1 chunks per rank (published: PP + 1).
  for (int p = 1; p <= 6; ++p) {
    for (int m = 2 * p; m <= 24; ++m) {
      SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m));
      const auto r = run(make("dualpipev", p, m, 2), 1.0, 1.0, 1.0);
      const double F = 1, B = 2, W = 1, FandB = F + B;
      const double published = (p - 1) * (FandB + B - 3 * W);
      for (int rank = 0; rank < p; ++rank) {
        EXPECT_NEAR(r.makespan - r.busyTimePerRank[rank], p - 1.0, 1e-9);
        EXPECT_LE(r.makespan - r.busyTimePerRank[rank], published + 1e-9);
        EXPECT_EQ(r.peakActivationsPerRank[rank], 2 * p + 1);
      }
    }
  }
}

TEST(SimulatorFormula, InterleavedZeroBubbleHasZB1PsBubblePerChunk) {
  // Published ZB1P (zero-bubble paper's ZB-H1; DualPipe README): (p-1)(F + B - 2W) per rank,
  // here with chunk times (B = I + W): p-1 at unit costs, a third of interleaved-1f1b's
  // (p-1)(F + B) on the same chunks, and 2(p-1) with F = 2.
  for (int p = 2; p <= 6; ++p) {
    for (int v : {1, 2, 3}) {
      for (int m = p; m <= 24; m += p) {
        SCOPED_TRACE("p=" + std::to_string(p) + " v=" + std::to_string(v) + " m=" + std::to_string(m));
        const auto zb = run(make("interleaved-zb", p, m, v), 1.0, 1.0, 1.0);
        const auto inter = run(make("interleaved-1f1b", p, m, v), 1.0, 1.0, 1.0);
        for (int rank = 0; rank < p; ++rank) {
          EXPECT_NEAR(zb.makespan - zb.busyTimePerRank[rank], (p - 1) * (1.0 + 2.0 - 2.0), 1e-9);
        }
        EXPECT_NEAR(bubbleTime(inter), (p - 1) * (1.0 + 2.0), 1e-9);
        EXPECT_NEAR(bubbleTime(run(make("interleaved-zb", p, m, v), 2.0, 1.0, 1.0)),
                    (p - 1) * (2.0 + 2.0 - 2.0), 1e-9);
      }
    }
  }
}

TEST(SimulatorFormula, PipeDreamNeverIdlesBetweenWarmupAndDrain) {
  for (int p = 1; p <= 6; ++p) {
    const int m = 4 * p + 3;
    const Schedule s = make("pipedream", p, m);
    const auto r = run(s, 1.0, 2.0, -1.0);
    for (int rank = 0; rank < p; ++rank) {
      std::vector<TimedAction> compute;
      for (const auto& e : r.timeline) {
        if (e.rank == rank && isCompute(e.action.kind)) compute.push_back(e);
      }
      // Steady state: from the first B to the last F.
      size_t firstB = 0, lastF = 0;
      for (size_t k = 0; k < compute.size(); ++k) {
        if (compute[k].action.kind == ActionKind::kForward) lastF = k;
      }
      while (compute[firstB].action.kind != ActionKind::kBackward) ++firstB;
      for (size_t k = firstB + 1; k <= lastF; ++k) {
        EXPECT_DOUBLE_EQ(compute[k].start, compute[k - 1].end)
            << "rank " << rank << " idles before " << compute[k].action.toString();
      }
    }
  }
}

TEST(SimulatorFormula, PipeDreamKeepsPMinusSVersionsTwoBWAtMostTwo) {
  for (int p = 1; p <= 8; ++p) {
    const auto pd = run(make("pipedream", p, 3 * p), 1.0, 2.0, -1.0);
    const auto twoBw = run(make("pipedream-2bw", p, std::max(1, p), 1, {}, 4), 1.0, 2.0, -1.0);
    for (int s = 0; s < p; ++s) {
      EXPECT_EQ(pd.peakWeightVersions[s], p - s) << "p=" << p << " s=" << s;
      EXPECT_EQ(pd.peakActivations[s], p - s);
      // Batch t reads W(t-1) while W(t) is current, even for p = 1.
      EXPECT_EQ(twoBw.peakWeightVersions[s], 2) << "p=" << p << " s=" << s;
    }
  }
}

TEST(SimulatorFormula, VerticalSyncKeepsPVersionsOnEveryStage) {
  // Stage s reads version b - (p-1) for minibatch b while its own newest is
  // b - (p-1-s): it keeps versions b-(p-1) .. b-(p-1-s) and the in-flight ones.
  for (int p = 1; p <= 6; ++p) {
    const auto r = run(make("pipedream", p, 3 * p, 1, {}, 1, /*verticalSync=*/true), 1.0, 2.0, -1.0);
    for (int s = 0; s < p; ++s) EXPECT_EQ(r.peakWeightVersions[s], p) << "p=" << p << " s=" << s;
  }
}

TEST(SimulatorFormula, ReplicatedStageNoamAndVersions) {
  // 2-1-1 on 4 workers: every stage admits 2, 2, 1 minibatches.
  const auto r = run(make("pipedream", 3, 12, 1, {2, 1, 1}), 1.0, 2.0, -1.0);
  EXPECT_EQ(r.peakActivations, (std::vector<int>{2, 2, 1}));
  EXPECT_EQ(r.peakWeightVersions, (std::vector<int>{2, 2, 1}));
}

TEST(SimulatorErrors, RejectsBadCosts) {
  const Schedule s = make("1f1b", 2, 2);
  StageCosts costs = StageCosts::uniform(2, 1.0, 1.0, -1.0, 0.0);
  costs.forward = {1.0};
  EXPECT_THROW(simulate(s, costs), std::invalid_argument);
  EXPECT_THROW(simulate(s, StageCosts::uniform(2, -1.0, 1.0, -1.0, 0.0)), std::invalid_argument);
}

TEST(SimulatorErrors, DeadlockNamesTheBlockedRank) {
  const Schedule s = make("1f1b", 2, 2).withActionsFromText(
      "rank 0: 0F0 0B0 0F1 0B1 0U1\nrank 1: 1F1 1B1 1F0 1B0 1U1\n");
  try {
    simulate(s, StageCosts::uniform(2, 1.0, 1.0, -1.0, 0.0));
    FAIL() << "no deadlock reported";
  } catch (const DeadlockError& e) {
    EXPECT_EQ(e.rank(), 0);
    EXPECT_EQ(e.step(), 1);
    EXPECT_NE(std::string(e.what()).find("rank 1 waits at step 0 (1F1)"), std::string::npos)
        << e.what();
  }
}

TEST(ChromeTrace, HasOneEventPerComputeAction) {
  const Schedule s = make("zb-h1", 3, 4);
  const auto r = run(s, 1.0, 1.0, 1.0);
  const std::string trace = toChromeTrace(lower(s), r);
  size_t events = 0;
  for (size_t pos = trace.find("\"ph\": \"X\""); pos != std::string::npos;
       pos = trace.find("\"ph\": \"X\"", pos + 1)) {
    ++events;
  }
  EXPECT_EQ(events, 3u * 4u * 3u);  // F, I, W per microbatch and stage
  EXPECT_NE(trace.find("\"traceEvents\""), std::string::npos);
}

}  // namespace
}  // namespace pipedream
