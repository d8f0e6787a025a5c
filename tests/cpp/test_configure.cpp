// The whole-configuration search: searchConfigurations against the exhaustive
// enumeration on random instances, hand-checked predictions, bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "configure.h"
#include "configure_model.h"
#include "generators.h"
#include "path_bound.h"
#include "simulate.h"
#include "test_helpers.h"
#include "traits.h"

namespace pipedream {
namespace {

using testing_helpers::errorOf;

// Four equal layers: F = 1 and B = 2 seconds per sample, 10 stashed bytes and
// 1 input byte per sample, 100 parameter bytes each.
std::vector<LayerCost> uniformLayers(int count = 4) {
  LayerCost l;
  l.forwardPerSample = 1;
  l.backwardPerSample = 2;
  l.stashBytesPerSample = 10;
  l.inputBytesPerSample = 1;
  l.parameterBytes = 100;
  return std::vector<LayerCost>(count, l);
}

Configuration twoStages(const std::string& schedule = "1f1b", int m = 4) {
  Configuration c;
  c.schedule = schedule;
  c.pp = 2;
  c.microbatches = m;
  c.balance = {2, 2};
  return c;
}

double simulatedMakespan(const std::string& name, int p, int m, double f, double b, double comm) {
  ScheduleOptions o;
  o.name = name;
  o.stages = p;
  o.microbatches = m;
  return simulate(buildSchedule(o), StageCosts::uniform(p, f, b, -1, comm)).makespan;
}

// --- hand-checked predictions ---------------------------------------------------

TEST(PredictConfiguration, OneFOneBUniformIsFillPlusSteadyState) {
  // b = 1 sample per microbatch: F = 2, B = 4 per stage; (m + p - 1)(F + B).
  const Prediction p = predictConfiguration(uniformLayers(), 4, MachineCosts{}, twoStages());
  EXPECT_DOUBLE_EQ(p.pipelineSeconds, (4 + 2 - 1) * (2.0 + 4.0));
  EXPECT_DOUBLE_EQ(p.stepSeconds, p.pipelineSeconds);
  ASSERT_EQ(p.computeSeconds.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_DOUBLE_EQ(p.computeSeconds[r], 4 * 6.0);
    EXPECT_DOUBLE_EQ(p.computeSeconds[r] + p.waitSeconds[r] + p.transferSeconds[r],
                     p.pipelineSeconds);
  }
  EXPECT_DOUBLE_EQ(p.bubbleFraction, 1.0 - 48.0 / (2 * 30.0));
}

TEST(PredictConfiguration, TransfersAreTheSimulatorsAndBatchSplitsLikeTensorSplit) {
  MachineCosts m;
  m.latencySeconds = 0.25;
  m.bandwidth = 4;  // 1 output byte per sample, b = 2 samples: 0.5 s
  auto layers = uniformLayers();
  for (auto& l : layers) l.outputBytesPerSample = 1;
  // batch 7 in 4 microbatches: torch.tensor_split's largest has 2 samples.
  const Prediction p = predictConfiguration(layers, 7, m, twoStages());
  EXPECT_DOUBLE_EQ(p.pipelineSeconds, simulatedMakespan("1f1b", 2, 4, 4.0, 8.0, 0.75));
  EXPECT_GT(p.pipelineSeconds, (4 + 2 - 1) * 12.0);
}

TEST(PredictConfiguration, RecomputeAddsTheForwardToTheBackwardAndKeepsOnlyInputs) {
  Configuration c = twoStages();
  c.recompute = {1, 1};
  const Prediction p = predictConfiguration(uniformLayers(), 4, MachineCosts{}, c);
  EXPECT_DOUBLE_EQ(p.pipelineSeconds, (4 + 2 - 1) * (2.0 + 4.0 + 2.0));
  // Rank 0: 200 weight bytes x (weights, gradients, 2 x Adam state) = 800, two
  // microbatches' inputs (1 byte) in flight and one stash (20) being rebuilt,
  // plus the backward's working memory (a layer's input gradient: 1 byte).
  EXPECT_DOUBLE_EQ(p.peakBytes[0], 800 + 2 * 1 + 20 + 1);
  EXPECT_DOUBLE_EQ(p.peakBytes[1], 800 + 1 * 1 + 20 + 1);
}

TEST(PredictConfiguration, MemoryCountsStateAndActivationsInFlight) {
  const Prediction p = predictConfiguration(uniformLayers(), 4, MachineCosts{}, twoStages(), 840.0);
  // 1F1B: rank 0 holds p = 2 microbatches' stashes (20 bytes each) and received
  // inputs (1 byte each), rank 1 one; a backward adds its working memory (1).
  EXPECT_DOUBLE_EQ(p.peakBytes[0], 800 + 2 * 21 + 1);
  EXPECT_DOUBLE_EQ(p.peakBytes[1], 800 + 1 * 21 + 1);
  EXPECT_FALSE(p.fits);  // 843 > 840
  const Prediction gpipe =
      predictConfiguration(uniformLayers(), 4, MachineCosts{}, twoStages("gpipe"), 900.0);
  EXPECT_DOUBLE_EQ(gpipe.peakBytes[0], 800 + 4 * 21 + 1);  // every microbatch in flight
  EXPECT_TRUE(gpipe.fits);
  const Prediction adamFree =
      predictConfiguration(uniformLayers(), 4, MachineCosts{}, twoStages(), 0.0, 0.0);
  EXPECT_DOUBLE_EQ(adamFree.peakBytes[1], 400 + 22);
}

TEST(PredictConfiguration, OptimizerPaysPerTensorAndItsStepIsAPeak) {
  MachineCosts m;
  m.optimizerSecondsPerByte = 0.01;   // 200 bytes per rank: 2 s
  m.optimizerSecondsPerTensor = 0.5;  // 4 tensors per rank: 2 s
  auto layers = uniformLayers();
  for (auto& l : layers) {
    l.parameterTensors = 2;
    l.largestParameterBytes = 80;
  }
  const Prediction p = predictConfiguration(layers, 4, m, twoStages());
  EXPECT_DOUBLE_EQ(p.overheadSeconds, 2.0 + 2.0);
  // Adam's step: the state (800) and two temporaries of the largest tensor
  // (960), more than the backward's 800 + 2 x 21 + (1 + a fresh 80-byte
  // gradient) = 923 on rank 0.
  EXPECT_DOUBLE_EQ(p.peakBytes[0], 800 + 2 * 80);
  EXPECT_DOUBLE_EQ(p.peakBytes[1], 800 + 2 * 80);
  for (auto& l : layers) l.stashBytesPerSample = 100;  // now the backward's peak is larger
  const Prediction stashed = predictConfiguration(layers, 4, m, twoStages());
  EXPECT_DOUBLE_EQ(stashed.peakBytes[0], 800 + 2 * 201 + 81);
  EXPECT_DOUBLE_EQ(stashed.peakBytes[1], 800 + 1 * 201 + 81);
  Configuration c = twoStages();
  c.tp = 2;  // tensor parallelism shards every tensor (the count stays)
  const Prediction tp = predictConfiguration(layers, 4, m, c);
  EXPECT_DOUBLE_EQ(tp.overheadSeconds, 1.0 + 2.0);
  EXPECT_DOUBLE_EQ(tp.peakBytes[1], 400 + 201 + 41);
}

TEST(PredictConfiguration, FsdpDividesStateAndPaysReduceScatterPlusAllGather) {
  MachineCosts m;
  m.allReduceLatencySeconds = 0.5;
  m.allReduceBandwidth = 100;
  Configuration c = twoStages();
  c.dp = 2;
  const Prediction replicated = predictConfiguration(uniformLayers(), 4, m, c);
  const Prediction sharded = predictConfiguration(uniformLayers(), 4, m, c, 0.0, 2.0, true);
  // 200 bytes per rank: ring volume 2 (dp - 1) / dp x 200 / 100 = 2 s. Replicate:
  // one flat all-reduce per stage; FSDP: an all-gather and a reduce-scatter per
  // unit (each of the rank's 2 layers has parameters), an all-reduce's latency
  // each while fsdpCallSeconds is not measured.
  EXPECT_DOUBLE_EQ(replicated.allReduceSeconds, 0.5 + 2.0);
  EXPECT_DOUBLE_EQ(sharded.allReduceSeconds, 2 * 2 * 0.5 + 2.0);
  EXPECT_DOUBLE_EQ(replicated.peakBytes[1], 800 + 22);
  EXPECT_DOUBLE_EQ(sharded.peakBytes[1], 400 + 22);
  EXPECT_DOUBLE_EQ(replicated.stepSeconds, 30 + 2.5);
}

TEST(PredictConfiguration, FsdpPaysItsMeasuredCallPerUnitWithParameters) {
  MachineCosts m;
  m.allReduceLatencySeconds = 0.5;
  m.allReduceBandwidth = 100;
  m.fsdpCallSeconds = 3;
  std::vector<LayerCost> layers = uniformLayers();
  layers[0].parameterBytes = 0;  // an activation: no unit, no call
  Configuration c = twoStages();
  c.dp = 2;
  const Prediction sharded = predictConfiguration(layers, 4, m, c, 0.0, 2.0, true);
  // Rank 1: 2 units x (all-gather + reduce-scatter) x 3 s + 200 bytes' ring volume
  // 2 s; rank 0 (1 unit, 100 bytes) is faster: the slowest rank counts.
  EXPECT_DOUBLE_EQ(sharded.allReduceSeconds, 2 * 2 * 3.0 + 2.0);
  // Replicate ignores it: one all-reduce per stage, at its own measured call.
  const Prediction replicated = predictConfiguration(layers, 4, m, c);
  EXPECT_DOUBLE_EQ(replicated.allReduceSeconds, 0.5 + 2.0);
  m.replicateCallSeconds = 1.5;
  EXPECT_DOUBLE_EQ(predictConfiguration(layers, 4, m, c).allReduceSeconds, 1.5 + 2.0);
  EXPECT_DOUBLE_EQ(predictConfiguration(layers, 4, m, c, 0.0, 2.0, true).allReduceSeconds,
                   sharded.allReduceSeconds);
  // A stage without parameters makes no call, replicated or sharded.
  for (LayerCost& l : layers) l.parameterBytes = 0;
  EXPECT_DOUBLE_EQ(predictConfiguration(layers, 4, m, c).allReduceSeconds, 0.0);
  EXPECT_DOUBLE_EQ(predictConfiguration(layers, 4, m, c, 0.0, 2.0, true).allReduceSeconds, 0.0);
  // dp = 1: nothing to synchronise.
  layers = uniformLayers();
  c.dp = 1;
  EXPECT_DOUBLE_EQ(predictConfiguration(layers, 4, m, c, 0.0, 2.0, true).allReduceSeconds, 0.0);
}

TEST(PredictConfiguration, TensorParallelCollectivesAreHalfForwardHalfBackward) {
  MachineCosts m;
  m.allReduceLatencySeconds = 0.5;
  m.allReduceBandwidth = 10;
  std::vector<LayerCost> layers = uniformLayers();
  for (LayerCost& l : layers) {
    l.tpCollectives = 2;                // a row- and a column-parallel Linear
    l.tpCollectiveBytesPerSample = 10;  // reduced per sample
  }
  Configuration c = twoStages("gpipe", 4);
  c.tp = 2;
  // b = 1: per layer and microbatch 2 x 0.5 + 2 (tp - 1) / tp x 10 / 10 = 2 s,
  // not divided by tp; a stage of 2 layers: F = 2 / 2 + 2 = 3, B = 4 / 2 + 2 = 4.
  const Prediction p = predictConfiguration(layers, 4, m, c);
  EXPECT_DOUBLE_EQ(p.pipelineSeconds, simulatedMakespan("gpipe", 2, 4, 3.0, 4.0, 0.0));
  // tp = 1 leaves them out: F = 2, B = 4.
  c.tp = 1;
  const Prediction whole = predictConfiguration(layers, 4, m, c);
  EXPECT_DOUBLE_EQ(whole.pipelineSeconds, simulatedMakespan("gpipe", 2, 4, 2.0, 4.0, 0.0));
  // Recompute repeats the forward's collective: B = 4 + 3.
  c.tp = 2;
  c.recompute = {1, 1};
  const Prediction again = predictConfiguration(layers, 4, m, c);
  EXPECT_DOUBLE_EQ(again.pipelineSeconds, simulatedMakespan("gpipe", 2, 4, 3.0, 7.0, 0.0));
  // A measured in-step call prices each: 2 x 1.5 + 1 = 4 s per layer; F = 1 + 4, B = 2 + 4.
  c.recompute = {};
  m.replicateCallSeconds = 1.5;
  const Prediction measured = predictConfiguration(layers, 4, m, c);
  EXPECT_DOUBLE_EQ(measured.pipelineSeconds, simulatedMakespan("gpipe", 2, 4, 5.0, 6.0, 0.0));
}

TEST(PredictConfiguration, ExpertParallelHoldsShardsReducesThemOverTheirCopiesAndPaysAllToAll) {
  MachineCosts m;
  m.allReduceLatencySeconds = 0.5;
  m.allReduceBandwidth = 10;
  std::vector<LayerCost> layers = uniformLayers();
  for (LayerCost& l : layers) {
    l.expertParameterBytes = 60;   // of its 100 parameter bytes
    l.allToAllCalls = 2;           // per microbatch, forward and backward
    l.allToAllBytesPerSample = 10; // routed rows per sample and exchange
  }
  Configuration c = twoStages("gpipe", 4);
  c.dp = 2;  // two copies, which share their experts
  c.ep = 2;
  // b = 1: per layer and microbatch 2 x 0.5 + 4 x (ep - 1) / ep x 10 / 10 = 3 s, half
  // each way; a stage of 2 layers: F = 2 + 3, B = 4 + 3.
  const Prediction p = predictConfiguration(layers, 4, m, c);
  EXPECT_DOUBLE_EQ(p.pipelineSeconds, simulatedMakespan("gpipe", 2, 4, 5.0, 7.0, 0.0));
  // A rank holds its stage's dense 2 x 40 bytes and half its 2 x 60 expert bytes:
  // 140 x (weights, gradients, 2 x Adam state) + gpipe's activations: 4 microbatches
  // x (20 stashed + 1 input) + 1 of backward working memory.
  const double activations = 4 * 21 + 1;
  EXPECT_DOUBLE_EQ(p.peakBytes[1], 140 * 4 + activations);
  // Dense gradients over both copies (ring: 2 (2 - 1) / 2 x 80 / 10 = 8 s); the expert
  // shards are held by one copy each: nothing to reduce. One call per stage.
  EXPECT_DOUBLE_EQ(p.allReduceSeconds, 0.5 + 8.0);
  // FSDP shards everything over the copies (the experts over (dp / ep) x ep): 200 / 2.
  const Prediction sharded = predictConfiguration(layers, 4, m, c, 0.0, 2.0, true);
  EXPECT_DOUBLE_EQ(sharded.peakBytes[1], 100 * 4 + activations);
  EXPECT_DOUBLE_EQ(sharded.allReduceSeconds, 2 * 2 * 0.5 + 8.0);
  // Four copies, two per expert shard: the shards' 60 bytes reduce over 2 (6 s more).
  c.dp = 4;
  EXPECT_DOUBLE_EQ(predictConfiguration(layers, 4, m, c).allReduceSeconds,
                   0.5 + 2.0 * 3 / 4 * 80 / 10 + 6.0);
  // ep = 1: the experts are dense parameters and nothing is exchanged.
  c.dp = 2;
  c.ep = 1;
  const Prediction whole = predictConfiguration(layers, 4, m, c);
  EXPECT_DOUBLE_EQ(whole.pipelineSeconds, simulatedMakespan("gpipe", 2, 4, 2.0, 4.0, 0.0));
  EXPECT_DOUBLE_EQ(whole.peakBytes[1], 200 * 4 + activations);
  EXPECT_DOUBLE_EQ(whole.allReduceSeconds, 0.5 + 20.0);
  // ep must divide the copies, and is not modelled with tp.
  c.ep = 3;
  EXPECT_NE(errorOf([&] { predictConfiguration(layers, 4, m, c); }).find("ep must be >= 1 and divide dp"),
            std::string::npos);
  c.ep = 2;
  c.tp = 2;
  EXPECT_NE(errorOf([&] { predictConfiguration(layers, 4, m, c); }).find("ep > 1 with tp > 1"),
            std::string::npos);
  layers[0].expertParameterBytes = 101;
  c.tp = 1;
  EXPECT_NE(errorOf([&] { predictConfiguration(layers, 4, m, c); }).find("must be part of parameter_bytes"),
            std::string::npos);
}

TEST(PredictConfiguration, RanksSharingCoresStretchThePipeline) {
  MachineCosts m;
  m.cores = 1;
  // Two ranks busy 24 s each on one core: 48 s, more than the 30 s makespan.
  const Prediction shared = predictConfiguration(uniformLayers(), 4, m, twoStages());
  EXPECT_DOUBLE_EQ(shared.pipelineSeconds, 48.0);
  EXPECT_DOUBLE_EQ(shared.computeSeconds[0], 24.0 * 48.0 / 30.0);  // every rank slowed alike
  m.cores = 2;
  EXPECT_DOUBLE_EQ(predictConfiguration(uniformLayers(), 4, m, twoStages()).pipelineSeconds, 30.0);
  m.cores = 1;
  m.ranksPerNode = 1;  // one rank per node: nothing shared
  EXPECT_DOUBLE_EQ(predictConfiguration(uniformLayers(), 4, m, twoStages()).pipelineSeconds, 30.0);
}

TEST(PredictConfiguration, PerStepTermsAndOverheads) {
  MachineCosts m;
  m.stepSeconds = 1;
  m.optimizerSecondsPerByte = 0.01;  // 200 bytes per rank: 2 s
  m.actionSeconds = 0.5;
  m.sendSeconds = 0.25;
  const Prediction p = predictConfiguration(uniformLayers(), 4, m, twoStages());
  EXPECT_DOUBLE_EQ(p.overheadSeconds, 3.0);
  // F = 2 + 0.5 + 0.25 (rank 0 sends forward), B = 4 + 0.5 (+ 0.25 on rank 1).
  EXPECT_DOUBLE_EQ(p.transferSeconds[0], 4 * 0.25);
  EXPECT_DOUBLE_EQ(p.transferSeconds[1], 4 * 0.25);
  EXPECT_DOUBLE_EQ(p.computeSeconds[0], 4 * 7.0);
  EXPECT_DOUBLE_EQ(p.stepSeconds, p.pipelineSeconds + 3.0);
}

TEST(PredictConfiguration, SendsPayPerByteAndLayersCarryTheirOptimizerStep) {
  MachineCosts m;
  m.sendSeconds = 0.25;
  m.sendSecondsPerByte = 0.5;
  m.optimizerSecondsPerByte = 0.01;  // 200 bytes per rank: 2 s, on top of the layers' own
  auto layers = uniformLayers();
  for (auto& l : layers) {
    l.outputBytesPerSample = 2;
    l.optimizerSeconds = 0.5;
  }
  const Prediction p = predictConfiguration(layers, 4, m, twoStages());
  // Rank 0 posts 2 bytes forward (0.25 + 1), rank 1 a 1-byte input gradient (0.25 + 0.5).
  EXPECT_DOUBLE_EQ(p.transferSeconds[0], 4 * 1.25);
  EXPECT_DOUBLE_EQ(p.transferSeconds[1], 4 * 0.75);
  EXPECT_DOUBLE_EQ(p.computeSeconds[0], 4 * (2 + 1.25 + 4) - 4 * 1.25);
  EXPECT_DOUBLE_EQ(p.overheadSeconds, 2 * 0.5 + 2.0);
  Configuration c = twoStages();
  c.tp = 2;  // each rank steps half of every tensor
  EXPECT_DOUBLE_EQ(predictConfiguration(layers, 4, m, c).overheadSeconds, 0.5 + 1.0);
}

TEST(PredictConfiguration, RanksSharingCoresShareTheirOptimizerStepsToo) {
  MachineCosts m;
  m.cores = 1;
  auto layers = uniformLayers();
  for (auto& l : layers) l.optimizerSeconds = 3;
  // Two ranks, one core: busy 24 s + optimizer 6 s each, 60 s of demand, more
  // than the stretched pipeline (48 s) + the slowest optimizer (6 s).
  const Prediction p = predictConfiguration(layers, 4, m, twoStages());
  EXPECT_DOUBLE_EQ(p.pipelineSeconds, 48.0);
  EXPECT_DOUBLE_EQ(p.stepSeconds, 60.0);
  EXPECT_DOUBLE_EQ(p.overheadSeconds, 12.0);
  m.cores = 2;  // nothing shared: the slowest rank's optimizer after the pipeline
  EXPECT_DOUBLE_EQ(predictConfiguration(layers, 4, m, twoStages()).stepSeconds, 30.0 + 6.0);
}

TEST(PredictConfiguration, AsynchronousStepIsTheSteadyState) {
  // pipedream: one minibatch (the whole batch of 4) per step; stage busy
  // F + B = 8 + 16 per minibatch is the steady state.
  const Prediction p =
      predictConfiguration(uniformLayers(), 4, MachineCosts{}, twoStages("pipedream", 4));
  EXPECT_NEAR(p.pipelineSeconds, 24.0, 1e-9);
  // pipedream-2bw: a batch of 4 microbatches per step, no flush: 4 x 6.
  const Prediction twoBw =
      predictConfiguration(uniformLayers(), 4, MachineCosts{}, twoStages("pipedream-2bw", 4));
  EXPECT_NEAR(twoBw.pipelineSeconds, 24.0, 1e-9);
  // Two weight versions of every stage (2BW) in the memory.
  EXPECT_GT(twoBw.peakBytes[1], 800 + 20);
}

TEST(PredictConfiguration, ReplicasAreScoredInPredict) {
  // Three layers on stage 0: busy 4 x 9 = 36 alone, 2 x 9 = 18 per replica.
  Configuration c = twoStages("1f1b", 4);
  c.balance = {3, 1};
  const Prediction straight = predictConfiguration(uniformLayers(), 4, MachineCosts{}, c);
  c.pp = 3;
  c.replicas = {2, 1};
  const Prediction p = predictConfiguration(uniformLayers(), 4, MachineCosts{}, c);
  ASSERT_EQ(p.peakBytes.size(), 3u);
  EXPECT_GE(straight.pipelineSeconds, 36.0);
  EXPECT_LT(p.pipelineSeconds, 36.0);
}

// --- bad input --------------------------------------------------------------------

TEST(PredictConfiguration, BadInputNamesTheValue) {
  const auto layers = uniformLayers();
  Configuration c = twoStages();
  c.schedule = "nope";
  EXPECT_NE(errorOf([&] { predictConfiguration(layers, 4, MachineCosts{}, c); }).find("'nope'"),
            std::string::npos);
  c = twoStages();
  c.balance = {1, 2};
  EXPECT_NE(errorOf([&] { predictConfiguration(layers, 4, MachineCosts{}, c); }).find("[1, 2]"),
            std::string::npos);
  c = twoStages("1f1b", 5);
  EXPECT_NE(errorOf([&] { predictConfiguration(layers, 4, MachineCosts{}, c); }).find("got 5"),
            std::string::npos);
  auto bad = layers;
  bad[2].forwardPerSample = -1;
  EXPECT_NE(errorOf([&] { predictConfiguration(bad, 4, MachineCosts{}, twoStages()); })
                .find("layer 2: forward_per_sample"),
            std::string::npos);
  c = twoStages("dualpipev", 2);  // dualpipev needs m >= 2p
  c.chunks = 2;
  c.balance = {1, 1, 1, 1};
  EXPECT_NE(errorOf([&] { predictConfiguration(layers, 4, MachineCosts{}, c); }).find("dualpipev"),
            std::string::npos);
}

TEST(SearchConfigurations, BadSpaceNamesTheValue) {
  const auto layers = uniformLayers();
  SearchSpace s;
  s.worldSize = 4;
  s.batchSize = 8;
  s.schedules = {"1f1b"};
  s.microbatches = {4};
  s.meshes = {{2, 1, 1}};
  EXPECT_NE(errorOf([&] { searchConfigurations(layers, MachineCosts{}, s); }).find("(2, 1, 1)"),
            std::string::npos);
  s.meshes = {};
  s.microbatches = {16};
  EXPECT_NE(errorOf([&] { searchConfigurations(layers, MachineCosts{}, s); }).find("16"),
            std::string::npos);
  s.microbatches = {4};
  s.schedules = {};
  EXPECT_NE(errorOf([&] { searchConfigurations(layers, MachineCosts{}, s); }).find("schedules"),
            std::string::npos);
  s.schedules = {"1f1b"};
  s.worldSize = 8;  // 8 stages of 4 layers
  EXPECT_NE(errorOf([&] { enumerateConfigurations(layers, MachineCosts{}, s); })
                .find("no configuration"),
            std::string::npos);
}

// --- the search against the enumeration -------------------------------------------

TEST(SearchConfigurations, PicksTheBetterScheduleAndRecomputesOnlyWhereMemoryNeedsIt) {
  SearchSpace s;
  s.worldSize = 2;
  s.batchSize = 8;
  s.schedules = {"gpipe", "1f1b"};
  s.microbatches = {8};
  s.recompute = RecomputeChoice::kSearch;
  // 1F1B keeps 2 stashes of 20 bytes and received inputs of 1 on rank 0 (843
  // bytes with the state and a backward's 1 byte of working memory), 1 on
  // rank 1 (822); GPipe all 8 on both (969). With 835 bytes 1F1B recomputes
  // on rank 0 only (823), GPipe on both (829).
  s.memoryBytes = 835;
  const SearchResult r = searchConfigurations(uniformLayers(), MachineCosts{}, s);
  ASSERT_TRUE(r.feasible);
  EXPECT_EQ(r.best.schedule, "1f1b");
  EXPECT_EQ(r.best.balance, (std::vector<int>{2, 2}));
  EXPECT_EQ(r.best.recompute, (std::vector<int>{1, 0}));
  ASSERT_FALSE(r.candidates.empty());
  EXPECT_EQ(r.candidates[0].schedule, "gpipe");
  EXPECT_EQ(r.candidates[0].recompute, (std::vector<int>{1, 1}));
  s.memoryBytes = 0;  // unlimited: no recomputation, the same makespan, the earlier schedule
  const SearchResult unlimited = searchConfigurations(uniformLayers(), MachineCosts{}, s);
  EXPECT_EQ(unlimited.best.schedule, "gpipe");
  EXPECT_EQ(unlimited.best.recompute, (std::vector<int>{0, 0}));
  s.memoryBytes = 700;  // below the weights and optimizer state of any split
  EXPECT_FALSE(searchConfigurations(uniformLayers(), MachineCosts{}, s).feasible);
  EXPECT_FALSE(enumerateConfigurations(uniformLayers(), MachineCosts{}, s).feasible);
}

struct Instance {
  std::vector<LayerCost> layers;
  MachineCosts machine;
  SearchSpace space;
};

std::vector<std::array<int, 3>> meshesOf(int world, std::mt19937& rng) {
  std::vector<std::array<int, 3>> all;
  for (int pp = 1; pp <= world; ++pp) {
    for (int tp = 1; pp * tp <= world; ++tp) {
      if (world % (pp * tp) == 0) all.push_back({pp, world / (pp * tp), tp});
    }
  }
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(1 + rng() % all.size());
  return all;
}

Instance randomInstance(std::mt19937& rng) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  Instance x;
  const int layers = 3 + static_cast<int>(rng() % 5);
  for (int l = 0; l < layers; ++l) {
    LayerCost c;
    c.forwardFixed = 0.2 * u(rng);
    c.forwardPerSample = u(rng);
    c.backwardFixed = 0.4 * u(rng);
    c.backwardPerSample = 2 * u(rng);
    c.weightShare = u(rng);
    c.outputBytesPerSample = 1e3 * u(rng);
    c.stashBytesPerSample = 1e4 * u(rng);
    c.inputBytesPerSample = c.outputBytesPerSample;
    c.parameterBytes = rng() % 3 == 0 ? 0.0 : 1e5 * u(rng);
    c.parameterTensors = c.parameterBytes > 0 ? 1.0 + rng() % 4 : 0.0;
    c.largestParameterBytes = c.parameterBytes * (0.25 + 0.75 * u(rng));
    c.optimizerSeconds = 1e-6 * c.largestParameterBytes;  // no draw: instances stay as they were
    c.tpCollectives = rng() % 2 == 0 ? 0.0 : 1.0 + rng() % 3;
    c.tpCollectiveBytesPerSample = c.tpCollectives * 1e3 * u(rng);
    x.layers.push_back(c);
  }
  MachineCosts& m = x.machine;
  m.actionSeconds = 0.05 * u(rng);
  m.sendSeconds = 0.02 * u(rng);
  m.sendSecondsPerByte = 1e-5 * m.sendSeconds;
  m.stepSeconds = u(rng);
  m.latencySeconds = 0.1 * u(rng);
  m.bandwidth = 1e4 + 1e5 * u(rng);
  m.allReduceLatencySeconds = 0.1 * u(rng);
  m.allReduceBandwidth = 1e5 + 1e6 * u(rng);
  m.optimizerSecondsPerByte = 1e-6 * u(rng);
  m.optimizerSecondsPerTensor = 0.01 * u(rng);
  m.fsdpCallSeconds = rng() % 2 == 0 ? 0.0 : 0.2 * u(rng);
  m.replicateCallSeconds = rng() % 2 == 0 ? 0.0 : 0.2 * u(rng);
  m.cores = static_cast<int>(rng() % 3);
  m.ranksPerNode = rng() % 2 == 0 ? 0 : 2;
  SearchSpace& s = x.space;
  s.worldSize = 2 + static_cast<int>(rng() % 3);
  s.batchSize = 4 + static_cast<int>(rng() % 9);
  s.meshes = meshesOf(s.worldSize, rng);
  std::vector<std::string> names = scheduleNames();
  std::shuffle(names.begin(), names.end(), rng);
  s.schedules.assign(names.begin(), names.begin() + 2 + rng() % 3);
  for (int k = 0; k < 3; ++k) s.microbatches.push_back(1 + static_cast<int>(rng() % s.batchSize));
  std::sort(s.microbatches.begin(), s.microbatches.end());
  s.microbatches.erase(std::unique(s.microbatches.begin(), s.microbatches.end()),
                       s.microbatches.end());
  s.interleavedChunks = rng() % 2 ? std::vector<int>{2} : std::vector<int>{2, 3};
  const RecomputeChoice choices[] = {RecomputeChoice::kNever, RecomputeChoice::kAlways,
                                     RecomputeChoice::kSearch, RecomputeChoice::kSearch};
  s.recompute = choices[rng() % 4];
  s.fsdp = rng() % 4 == 0;
  s.candidates = 3;
  return x;
}

std::string describe(const Configuration& c) {
  std::string out = c.schedule + " v=" + std::to_string(c.chunks) + " m=" +
                    std::to_string(c.microbatches) + " mesh=" + std::to_string(c.pp) + "x" +
                    std::to_string(c.dp) + "x" + std::to_string(c.tp) + " balance=";
  for (int b : c.balance) out += std::to_string(b) + ",";
  out += " recompute=";
  for (int r : c.recompute) out += std::to_string(r);
  return out + " step=" + std::to_string(c.prediction.stepSeconds);
}

void expectSameResult(const SearchResult& found, const SearchResult& all, const Instance& x,
                      std::string what) {
  const auto& layers = x.layers;
  const auto& machine = x.machine;
  const auto& space = x.space;
  what += ": found " + describe(found.best) + ", enumerated " + describe(all.best);
  ASSERT_EQ(found.feasible, all.feasible) << what;
  if (!all.feasible) return;
  const double expected = all.best.prediction.stepSeconds;
  EXPECT_NEAR(found.best.prediction.stepSeconds, expected, 1e-9 * expected) << what;
  const Configuration& f = found.best;
  const Configuration& e = all.best;
  const bool same = f.schedule == e.schedule && f.microbatches == e.microbatches &&
                    f.chunks == e.chunks && f.pp == e.pp && f.dp == e.dp && f.tp == e.tp &&
                    f.balance == e.balance && f.recompute == e.recompute;
  if (!same) {
    // Only a tie may differ: the configuration found, predicted on its own,
    // scores what the enumeration's best does.
    const Prediction again = predictConfiguration(layers, space.batchSize, machine, f,
                                                  space.memoryBytes, space.optimizerStateFactor,
                                                  space.fsdp);
    EXPECT_TRUE(again.fits) << what;
    EXPECT_NEAR(again.stepSeconds, expected, 1e-9 * expected) << what;
  }
  ASSERT_EQ(found.candidates.size(), all.candidates.size()) << what;
  for (size_t k = 0; k < all.candidates.size(); ++k) {
    const double step = all.candidates[k].prediction.stepSeconds;
    EXPECT_NEAR(found.candidates[k].prediction.stepSeconds, step, 1e-9 * step) << what << " #" << k;
  }
}

// Every balance of `layers` layers into `stages` stages, as first layers (stages + 1 entries).
void forEachStarts(int layers, int stages, std::vector<int>& start, int j,
                   const std::function<void(const std::vector<int>&)>& visit) {
  if (j == stages) {
    visit(start);
    return;
  }
  const int last = j + 1 == stages ? layers : layers - (stages - 1 - j);
  for (int e = j + 1 == stages ? layers : start[j] + 1; e <= last; ++e) {
    start[j + 1] = e;
    forEachStarts(layers, stages, start, j + 1, visit);
  }
}

// A random instance of at least 7 layers (its own layers repeated): enough
// balances for a bound to be checked against every completion.
Instance randomInstanceOfSevenLayers(std::mt19937& rng) {
  Instance x = randomInstance(rng);
  while (x.layers.size() < 7) x.layers.push_back(x.layers[rng() % x.layers.size()]);
  return x;
}

// The point's model, or null where its schedule refuses the point (e.g. too
// few microbatches).
std::unique_ptr<PointModel> modelOrNull(const Instance& x, int batch, const PointOptions& options) {
  try {
    return std::make_unique<PointModel>(x.layers, batch, x.machine, options);
  } catch (const std::invalid_argument&) {
    return nullptr;
  }
}

// The search collects critical paths of simulations at other costs (its
// simulated bound's) and bounds a prefix by each path's length over the stages
// cut plus the least, over the cuts of the rest, of its length over the rest
// (PathBound). That bound must never exceed the makespan of any completion of
// the prefix, and a path must be as long as the makespan at the costs it came from.
TEST(SearchConfigurations, CollectedPathBoundNeverExceedsAnyCompletion) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<std::string> flush;
  for (const std::string& name : scheduleNames()) {
    if (!scheduleTraits(name).asynchronous) flush.push_back(name);
  }
  int checked = 0, tight = 0;
  for (int trial = 0; trial < 40; ++trial) {
    Instance x = randomInstanceOfSevenLayers(rng);
    const int layers = static_cast<int>(x.layers.size());
    PointOptions options;
    options.schedule = flush[trial % flush.size()];
    options.chunks = scheduleTraits(options.schedule).multiChunk ? 2 : 1;
    options.pp = options.chunks == 2 ? 2 + static_cast<int>(rng() % 2) : 3 + static_cast<int>(rng() % 2);
    options.microbatches = 1 + static_cast<int>(rng() % 6);
    const std::unique_ptr<PointModel> model = modelOrNull(x, 8, options);
    if (!model) continue;
    const int stages = model->stages();
    if (stages > layers) continue;
    // A path from random costs of the schedule's shape (as the simulated
    // bound's: any costs), and one from a balance's own costs.
    std::vector<int> source(stages + 1, 0);
    for (int j = 1; j < stages; ++j) source[j] = j;
    source[stages] = layers;
    StageCosts random = model->stageCosts(source, {});
    for (double& c : random.forward) c *= 0.2 + u(rng);
    for (double& c : random.backward) c *= 0.2 + u(rng);
    for (double& c : random.weight) c *= 0.2 + u(rng);
    for (double& c : random.comm) c *= u(rng);
    const StageCosts own = model->stageCosts(source, {});
    for (const StageCosts* costs : std::vector<const StageCosts*>{&random, &own}) {
      const PathBound bound(*model, model->criticalPath(*costs), layers);
      std::vector<int> start(stages + 1, 0);
      forEachStarts(layers, stages, start, 0, [&](const std::vector<int>& s) {
        const double makespan = model->makespan(model->stageCosts(s, {}));
        double prefix = 0.0;
        for (int j = 0; j < stages; ++j) {
          const double boundary = j + 1 < stages ? model->commSeconds(s[j + 1]) : 0.0;
          prefix += bound.stage(j, model->stageCost(j, s[j], s[j + 1], false), boundary);
          const double least = prefix + bound.rest(j + 1, s[j + 1]);
          EXPECT_LE(least, makespan * (1 + 1e-12))
              << options.schedule << " trial " << trial << " prefix " << j;
          ++checked;
        }
        if (costs == &own && s == source) {
          EXPECT_NEAR(prefix, makespan, 1e-9 * makespan) << options.schedule;
          ++tight;
        }
      });
    }
  }
  EXPECT_GE(checked, 1000);
  EXPECT_GE(tight, 20);
}

// RoundTripBound: for one-stage-per-rank flush schedules, each stage's chains
// (head, its list, its microbatches' round trips through the later stages,
// tail) at the least costs its layers allow, as a min-max over the cuts. It
// must never exceed the makespan of any balance (with or without
// recomputation), over a prefix or at the root, and it must be tight enough
// to prune (close to the makespan of some balance of every point).
TEST(SearchConfigurations, RoundTripBoundNeverExceedsAnyCompletion) {
  std::mt19937 rng(11);
  const std::vector<std::string> names = {"gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zbv"};
  int checked = 0, close = 0, enabled = 0;
  for (int trial = 0; trial < 40; ++trial) {
    Instance x = randomInstanceOfSevenLayers(rng);
    const int layers = static_cast<int>(x.layers.size());
    PointOptions options;
    options.schedule = names[trial % names.size()];
    options.chunks = scheduleTraits(options.schedule).multiChunk ? 2 : 1;
    options.pp = options.chunks == 2 ? 2 : 3 + static_cast<int>(rng() % 3);
    options.tp = 1 + static_cast<int>(rng() % 2);
    options.microbatches = 1 + static_cast<int>(rng() % 8);
    const std::unique_ptr<PointModel> model = modelOrNull(x, 8, options);
    if (!model) continue;
    const int stages = model->stages();
    RoundTripBound bound(*model, x.layers, x.machine.actionSeconds, options.tp);
    // Several stages on a rank: its chains are not one stage's.
    EXPECT_EQ(bound.enabled(), options.chunks == 1) << options.schedule;
    if (!bound.enabled() || stages > layers) continue;
    ++enabled;
    double least = std::numeric_limits<double>::infinity();
    double tightest = 0.0;
    std::vector<int> start(stages + 1, 0);
    forEachStarts(layers, stages, start, 0, [&](const std::vector<int>& s) {
      const double makespan = model->makespan(model->stageCosts(s, {}));
      const double recomputed = model->makespan(model->stageCosts(s, std::vector<int>(stages, 1)));
      least = std::min(least, makespan);
      double prefix = 0.0;
      for (int j = 0; j < stages; ++j) {
        prefix = std::max(prefix, bound.stage(j, s[j], s[j + 1]));
        const double node = std::max(prefix, bound.rest(stages - 1 - j, s[j + 1]));
        EXPECT_LE(node, makespan * (1 + 1e-12)) << options.schedule << " trial " << trial << " prefix " << j;
        EXPECT_LE(node, recomputed * (1 + 1e-12)) << options.schedule << " trial " << trial;
        ++checked;
      }
      tightest = std::max(tightest, prefix / makespan);
    });
    EXPECT_LE(bound.rest(stages, 0), least * (1 + 1e-12)) << options.schedule << " trial " << trial;
    close += tightest > 0.9 ? 1 : 0;
  }
  EXPECT_GE(enabled, 15);
  EXPECT_GE(checked, 1000);
  EXPECT_GE(close, enabled * 3 / 4);
}

TEST(SearchConfigurations, EqualsTheEnumerationOnRandomInstances) {
  std::mt19937 rng(39);
  int compared = 0, infeasible = 0, recomputing = 0, pruning = 0;
  for (int trial = 0; trial < 80; ++trial) {
    Instance x = randomInstance(rng);
    const std::string what = "instance " + std::to_string(trial);
    SearchResult unlimited;
    try {
      unlimited = enumerateConfigurations(x.layers, x.machine, x.space);
    } catch (const std::invalid_argument&) {
      continue;  // no point of this space can run (stages > layers, schedules refusing m)
    }
    // A memory limit between 60% and 110% of the unlimited best's peak: some
    // instances fit as they are, some need recomputation, some nothing fits.
    double peak = 0.0;
    for (double bytes : unlimited.best.prediction.peakBytes) peak = std::max(peak, bytes);
    x.space.memoryBytes = peak * (0.6 + 0.5 * std::uniform_real_distribution<double>()(rng));
    const SearchResult all = enumerateConfigurations(x.layers, x.machine, x.space);
    const SearchResult found = searchConfigurations(x.layers, x.machine, x.space);
    expectSameResult(found, all, x, what);
    ++compared;
    infeasible += all.feasible ? 0 : 1;
    const auto& rc = all.best.recompute;
    recomputing += all.feasible && std::count(rc.begin(), rc.end(), 1) > 0 ? 1 : 0;
    pruning += found.pruned > 0 ? 1 : 0;
  }
  // The instances cover what they are meant to.
  EXPECT_GE(compared, 50);
  EXPECT_GE(infeasible, 3);
  EXPECT_GE(recomputing, 3);
  EXPECT_GE(pruning, 10);
}

// Expert parallelism: the same random instances on their meshes whose copies ep = 2
// divides (tp 1), with expert bytes and all_to_all traffic on some layers. The
// search's bounds stay bounds (the all-reduce's, whose expert part reduces over
// fewer copies, is left out): still the enumeration's result.
TEST(SearchConfigurations, EqualsTheEnumerationWithExpertParallelism) {
  std::mt19937 rng(41), extra(7);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  int compared = 0;
  for (int trial = 0; trial < 60; ++trial) {
    Instance x = randomInstance(rng);
    auto& meshes = x.space.meshes;
    meshes.erase(std::remove_if(meshes.begin(), meshes.end(),
                                [](const auto& mesh) { return mesh[1] % 2 != 0 || mesh[2] != 1; }),
                 meshes.end());
    if (meshes.empty()) continue;
    x.space.ep = 2;
    for (LayerCost& c : x.layers) {
      c.tpCollectives = 0;
      if (extra() % 2 == 0) continue;
      c.expertParameterBytes = c.parameterBytes * u(extra);
      c.allToAllCalls = 5;
      c.allToAllBytesPerSample = 1e3 * u(extra);
    }
    const std::string what = "ep instance " + std::to_string(trial);
    SearchResult all;
    try {
      all = enumerateConfigurations(x.layers, x.machine, x.space);
    } catch (const std::invalid_argument&) {
      continue;
    }
    const SearchResult found = searchConfigurations(x.layers, x.machine, x.space);
    expectSameResult(found, all, x, what);
    EXPECT_EQ(found.best.ep, 2) << what;
    ++compared;
  }
  EXPECT_GE(compared, 15);
}

// Longer chains than the random instances' (13 layers, up to 6 stages, every
// flush schedule, 16 microbatches): trees deep and wide enough that the
// simulated bound runs on a sample of the nodes at some depths. Still the
// enumeration's result.
TEST(SearchConfigurations, EqualsTheEnumerationOnLongerChains) {
  std::mt19937 rng(13);
  std::vector<std::string> flush;
  for (const std::string& name : scheduleNames()) {
    if (!scheduleTraits(name).asynchronous) flush.push_back(name);
  }
  for (int trial = 0; trial < 3; ++trial) {
    Instance x = randomInstance(rng);
    while (x.layers.size() < 13) x.layers.push_back(x.layers[rng() % x.layers.size()]);
    x.layers.resize(13);
    x.space.worldSize = 6;
    x.space.batchSize = 16;
    x.space.meshes = {{6, 1, 1}, {3, 2, 1}};
    x.space.schedules = flush;
    x.space.microbatches = {8, 16};
    x.space.recompute = RecomputeChoice::kNever;
    x.space.memoryBytes = 0.0;
    const SearchResult all = enumerateConfigurations(x.layers, x.machine, x.space);
    const SearchResult found = searchConfigurations(x.layers, x.machine, x.space);
    expectSameResult(found, all, x, "instance " + std::to_string(trial));
    EXPECT_GT(found.pruned, 0);
  }
}

// RoundTripBound counts the sends each stage posts: on the middle stage of
// three (1f1b, 4 microbatches) every chain holds at least its 4 forwards'
// (or backwards') posts, the one of the forward before it and the one of the
// backward after it, so posting sendSeconds raises every Q by at least 6 of them.
TEST(SearchConfigurations, RoundTripBoundCountsTheSendsPosted) {
  std::mt19937 rng(5);
  int checked = 0;
  for (int trial = 0; trial < 10; ++trial) {
    Instance x = randomInstanceOfSevenLayers(rng);
    const int layers = static_cast<int>(x.layers.size());
    PointOptions options;
    options.schedule = "1f1b";
    options.pp = 3;
    options.microbatches = 4;
    x.machine.sendSecondsPerByte = 0.0;
    x.machine.sendSeconds = 0.0;
    const std::unique_ptr<PointModel> silent = modelOrNull(x, 8, options);
    const double post = 0.01;
    x.machine.sendSeconds = post;
    const std::unique_ptr<PointModel> posting = modelOrNull(x, 8, options);
    ASSERT_TRUE(silent && posting);
    const RoundTripBound without(*silent, x.layers, x.machine.actionSeconds, 1);
    const RoundTripBound with(*posting, x.layers, x.machine.actionSeconds, 1);
    ASSERT_TRUE(without.enabled() && with.enabled());
    for (int a = 1; a < layers - 1; ++a) {
      for (int e = a + 1; e < layers; ++e) {
        EXPECT_GE(with.stage(1, a, e) - without.stage(1, a, e), 6 * post * (1 - 1e-9))
            << "trial " << trial << " layers [" << a << ", " << e << ")";
        ++checked;
      }
    }
  }
  EXPECT_GE(checked, 100);
}

// Nearly as many stages as layers, every flush schedule: the space where
// near-equal balances abound, and where the points' seeds bound the runners-up,
// the later stages' windows bound their costs, the simulation is replayed at
// every node and RoundTripBound prunes whole points. Still the enumeration's result.
TEST(SearchConfigurations, EqualsTheEnumerationWhenStagesNearlyMatchLayers) {
  std::mt19937 rng(96);
  std::vector<std::string> flush;
  for (const std::string& name : scheduleNames()) {
    if (!scheduleTraits(name).asynchronous) flush.push_back(name);
  }
  long long searched = 0, enumerated = 0;
  int pruning = 0, tripPrunes = 0;
  for (int trial = 0; trial < 12; ++trial) {
    Instance x = randomInstance(rng);
    while (x.layers.size() < 9) {
      const Instance more = randomInstance(rng);
      x.layers.insert(x.layers.end(), more.layers.begin(), more.layers.end());
    }
    x.layers.resize(9 + trial % 2);
    x.space.worldSize = 8;
    x.space.meshes = {{8, 1, 1}, {4, 2, 1}};
    x.space.schedules = flush;
    x.space.interleavedChunks = {2};
    x.space.recompute = RecomputeChoice::kNever;
    x.space.memoryBytes = 0.0;
    const SearchResult all = enumerateConfigurations(x.layers, x.machine, x.space);
    const SearchResult found = searchConfigurations(x.layers, x.machine, x.space);
    expectSameResult(found, all, x, "instance " + std::to_string(trial));
    searched += found.evaluated;
    enumerated += all.evaluated;
    pruning += found.pruned > 0 ? 1 : 0;
    // Points whose RoundTripBound alone (the pipeline, no per-step terms)
    // exceeds the best step: the search drops them before their seed.
    for (const auto& mesh : x.space.meshes) {
      for (const char* name : {"gpipe", "1f1b", "zb-h1"}) {
        for (int m : x.space.microbatches) {
          PointOptions options;
          options.schedule = name;
          options.microbatches = m;
          options.pp = mesh[0];
          options.dp = mesh[1];
          const std::unique_ptr<PointModel> model = modelOrNull(x, x.space.batchSize, options);
          if (!model) continue;
          RoundTripBound bound(*model, x.layers, x.machine.actionSeconds, 1);
          ASSERT_TRUE(bound.enabled()) << name;
          tripPrunes += bound.rest(model->stages(), 0) > all.best.prediction.stepSeconds ? 1 : 0;
        }
      }
    }
  }
  EXPECT_EQ(pruning, 12);
  EXPECT_LT(searched * 10, enumerated);  // the bounds do prune
  EXPECT_GE(tripPrunes, 50) << tripPrunes;
}

}  // namespace
}  // namespace pipedream
