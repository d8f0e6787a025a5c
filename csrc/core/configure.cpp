#include "configure.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <set>
#include <stdexcept>
#include <utility>

#include "configure_model.h"
#include "generators.h"
#include "simulate.h"
#include "traits.h"

namespace pipedream {

namespace {

std::string str(int value) { return std::to_string(value); }
std::string str(double value) { return std::to_string(value); }

using configure_detail::fail;
using configure_detail::joined;

void checkNonNegative(double value, const std::string& name) {
  if (!std::isfinite(value) || value < 0) {
    fail(name + " must be finite and >= 0 (got " + str(value) + ")");
  }
}

}  // namespace

// --- checks --------------------------------------------------------------------

void checkLayers(const std::vector<LayerCost>& layers) {
  if (layers.empty()) fail("layers is empty; give one LayerCost per layer of the chain");
  for (size_t l = 0; l < layers.size(); ++l) {
    const LayerCost& c = layers[l];
    const std::string at = "layer " + str(static_cast<int>(l)) + ": ";
    checkNonNegative(c.forwardFixed, at + "forward_fixed");
    checkNonNegative(c.forwardPerSample, at + "forward_per_sample");
    checkNonNegative(c.backwardFixed, at + "backward_fixed");
    checkNonNegative(c.backwardPerSample, at + "backward_per_sample");
    checkNonNegative(c.outputBytesPerSample, at + "output_bytes_per_sample");
    checkNonNegative(c.stashBytesPerSample, at + "stash_bytes_per_sample");
    checkNonNegative(c.inputBytesPerSample, at + "input_bytes_per_sample");
    checkNonNegative(c.parameterBytes, at + "parameter_bytes");
    checkNonNegative(c.parameterTensors, at + "parameter_tensors");
    checkNonNegative(c.largestParameterBytes, at + "largest_parameter_bytes");
    checkNonNegative(c.optimizerSeconds, at + "optimizer_seconds");
    checkNonNegative(c.tpCollectives, at + "tp_collectives");
    checkNonNegative(c.tpCollectiveBytesPerSample, at + "tp_collective_bytes_per_sample");
    checkNonNegative(c.expertParameterBytes, at + "expert_parameter_bytes");
    checkNonNegative(c.allToAllCalls, at + "all_to_all_calls");
    checkNonNegative(c.allToAllBytesPerSample, at + "all_to_all_bytes_per_sample");
    if (c.expertParameterBytes > c.parameterBytes) {
      fail(at + "expert_parameter_bytes (" + str(c.expertParameterBytes) + ") must be part of "
           "parameter_bytes (" + str(c.parameterBytes) + ")");
    }
    if (!(c.weightShare >= 0 && c.weightShare <= 1)) {
      fail(at + "weight_share must be in [0, 1] (got " + str(c.weightShare) + ")");
    }
  }
}

double estimatedOptimizerSeconds(const MachineCosts& machine, double bytes, double tensors,
                                 int tp, int dp, bool fsdp) {
  const double held = bytes / tp;
  return machine.optimizerSecondsPerByte * (fsdp ? held / dp : held) +
         machine.optimizerSecondsPerTensor * tensors;
}

void checkMachine(const MachineCosts& m) {
  checkNonNegative(m.actionSeconds, "action_seconds");
  checkNonNegative(m.sendSeconds, "send_seconds");
  checkNonNegative(m.sendSecondsPerByte, "send_seconds_per_byte");
  checkNonNegative(m.stepSeconds, "step_seconds");
  checkNonNegative(m.latencySeconds, "latency_seconds");
  checkNonNegative(m.allReduceLatencySeconds, "all_reduce_latency_seconds");
  checkNonNegative(m.optimizerSecondsPerByte, "optimizer_seconds_per_byte");
  checkNonNegative(m.optimizerSecondsPerTensor, "optimizer_seconds_per_tensor");
  checkNonNegative(m.fsdpCallSeconds, "fsdp_call_seconds");
  checkNonNegative(m.replicateCallSeconds, "replicate_call_seconds");
  if (!std::isfinite(m.bandwidth) || m.bandwidth <= 0) {
    fail("bandwidth must be finite and > 0 bytes/s (got " + str(m.bandwidth) + ")");
  }
  if (!std::isfinite(m.allReduceBandwidth) || m.allReduceBandwidth <= 0) {
    fail("all_reduce_bandwidth must be finite and > 0 bytes/s (got " + str(m.allReduceBandwidth) +
         ")");
  }
  if (m.cores < 0) fail("cores must be >= 0 (0: one core per rank; got " + str(m.cores) + ")");
  if (m.ranksPerNode < 0) {
    fail("ranks_per_node must be >= 0 (0: every rank on one node; got " + str(m.ranksPerNode) + ")");
  }
}

void checkExpertParallel(int ep, int dp, int tp) {
  if (ep < 1 || dp % ep != 0) {
    fail("ep must be >= 1 and divide dp, which counts every copy (got ep=" + str(ep) + ", dp=" +
         str(dp) + ")");
  }
  if (ep > 1 && tp > 1) fail("ep > 1 with tp > 1 is not modelled (got ep=" + str(ep) + ", tp=" + str(tp) + ")");
}

void checkMemoryArguments(double memoryBytes, double optimizerStateFactor) {
  checkNonNegative(memoryBytes, "memory_bytes");
  checkNonNegative(optimizerStateFactor, "optimizer_state_factor");
}

// --- one point of the space ------------------------------------------------------

namespace {

// Sums of a per-layer quantity over [begin, end) in O(1).
class PrefixSums {
 public:
  PrefixSums() = default;
  template <typename F>
  PrefixSums(const std::vector<LayerCost>& layers, F value) : sums_(layers.size() + 1, 0.0) {
    for (size_t l = 0; l < layers.size(); ++l) sums_[l + 1] = sums_[l] + value(layers[l]);
  }
  double over(int begin, int end) const { return sums_[end] - sums_[begin]; }

 private:
  std::vector<double> sums_;
};

}  // namespace

namespace {

// One collective call inside a step: what an all-reduce there was measured to
// cost (replicateCallSeconds), else an all-reduce's latency.
double inStepCallSeconds(const MachineCosts& machine) {
  return machine.replicateCallSeconds > 0 ? machine.replicateCallSeconds
                                          : machine.allReduceLatencySeconds;
}

// A layer's tensor-parallel all-reduces of one microbatch of b samples (ring:
// 2 (tp - 1) / tp of the bytes each way); none at tp = 1.
double tpCollectiveSeconds(const LayerCost& c, const MachineCosts& machine, int tp, double b) {
  if (tp <= 1) return 0.0;
  return c.tpCollectives * inStepCallSeconds(machine) +
         2.0 * (tp - 1) / tp * c.tpCollectiveBytesPerSample * b / machine.allReduceBandwidth;
}

// A layer's expert-parallel all_to_all of one microbatch of b samples: its
// calls, and 4 exchanges of its routed rows (dispatch and combine, forward and
// backward), (ep - 1) / ep of them to other ranks; none at ep = 1.
double allToAllSeconds(const LayerCost& c, const MachineCosts& machine, int ep, double b) {
  if (ep <= 1) return 0.0;
  return c.allToAllCalls * inStepCallSeconds(machine) +
         4.0 * (ep - 1) / ep * c.allToAllBytesPerSample * b / machine.allReduceBandwidth;
}

}  // namespace

double heldParameterBytes(const LayerCost& c, int ep, bool fsdp) {
  // FSDP shards experts over the dp / ep copies holding the same ones: 1 / dp in all, as the rest.
  return c.parameterBytes - c.expertParameterBytes + c.expertParameterBytes / (fsdp ? 1 : ep);
}

struct PointModel::Sums {
  PrefixSums forward, backward, weight, stash, deferred, parameters, tensors, optimizer;
  PrefixSums units;    // FSDP units: layers with parameters
  PrefixSums tpComm;   // tensor parallelism's all-reduces per microbatch (F + B)
  PrefixSums experts;  // expert bytes (whole: every ep rank's shards)
  PrefixSums epComm;   // expert parallelism's all_to_all per microbatch (F + B)
};

PointModel::PointModel(const std::vector<LayerCost>& layers, int batchSize,
                       const MachineCosts& machine, const PointOptions& options)
    : layers_(layers), machine_(machine), options_(options), sums_(std::make_shared<Sums>()) {
  const ScheduleTraits& traits = scheduleTraits(options.schedule);
  asynchronous_ = traits.asynchronous;
  split_ = traits.splitBackward;
  // A step's batch is split into its microbatches with torch.tensor_split: the
  // first ones are the largest (pipedream: one minibatch, the whole batch).
  const int perStep = traits.microbatchesPerStep(options.microbatches);
  samples_ = (batchSize + perStep - 1) / perStep;
  const double b = samples_;
  sums_->forward = PrefixSums(layers, [b](const LayerCost& c) {
    return c.forwardFixed + c.forwardPerSample * b;
  });
  sums_->backward = PrefixSums(layers, [b](const LayerCost& c) {
    return c.backwardFixed + c.backwardPerSample * b;
  });
  sums_->weight = PrefixSums(layers, [b](const LayerCost& c) {
    return c.weightShare * (c.backwardFixed + c.backwardPerSample * b);
  });
  sums_->stash = PrefixSums(layers, [b](const LayerCost& c) { return c.stashBytesPerSample * b; });
  // A deferred weight gradient keeps each layer's input and output gradient.
  sums_->deferred = PrefixSums(layers, [b](const LayerCost& c) {
    return std::min(c.stashBytesPerSample, c.inputBytesPerSample + c.outputBytesPerSample) * b;
  });
  // What a rank holds of a layer's parameters (its experts' shards: 1 / ep), times
  // the layer's copies on it; FSDP's and tp's division come later, as for any tensor.
  sums_->parameters = PrefixSums(layers, [&options](const LayerCost& c) {
    return heldParameterBytes(c, options.ep, options.fsdp);
  });
  sums_->experts = PrefixSums(layers, [](const LayerCost& c) { return c.expertParameterBytes; });
  sums_->epComm = PrefixSums(layers, [&](const LayerCost& c) {
    return allToAllSeconds(c, machine, options.ep, b);
  });
  sums_->tensors = PrefixSums(layers, [](const LayerCost& c) { return c.parameterTensors; });
  sums_->optimizer = PrefixSums(layers, [](const LayerCost& c) { return c.optimizerSeconds; });
  sums_->units = PrefixSums(layers, [](const LayerCost& c) { return c.parameterBytes > 0 ? 1.0 : 0.0; });
  sums_->tpComm = PrefixSums(layers, [&](const LayerCost& c) {
    return tpCollectiveSeconds(c, machine, options.tp, b);
  });
  buildSchedules(traits);
}

void PointModel::buildSchedules(const ScheduleTraits& traits) {
  ScheduleOptions o;
  o.name = options_.schedule;
  o.chunks = options_.chunks;
  o.microbatches = options_.microbatches;
  o.replicas = options_.replicas;
  o.stages = traits.multiChunk ? options_.pp
                               : (options_.replicas.empty() ? options_.pp
                                                            : static_cast<int>(options_.replicas.size()));
  // An asynchronous schedule never drains: one step is the difference between
  // a window of two and one (the fill and drain cancel).
  schedules_.push_back(buildSchedule(o));
  if (asynchronous_) {
    if (traits.updateRule == UpdateRule::kPerMinibatch) {
      o.microbatches *= 2;
      stepScale_ = 1.0 / options_.microbatches;
    } else {
      o.batches = 2;
    }
    schedules_.push_back(buildSchedule(o));
  }
  const Schedule& shape = schedules_.back();
  const Layout& layout = shape.layout();
  stages_ = layout.numStages();
  ranks_ = layout.numRanks();
  firstRank_.resize(stages_);
  for (int j = 0; j < stages_; ++j) firstRank_[j] = layout.stageRanks(j).front();
  replicaCounts_ = layout.replicaCounts();
  versions_.assign(stages_, 1);
  if (traits.stashWeights) {
    SimulationResult figures;
    computeMemoryFigures(shape, figures);
    versions_ = figures.peakWeightVersions;
  }
  buildMemoryShapes(shape);
  countSends();
}

// For every rank: the distinct count vectors (in-flight and deferred
// microbatches per stage it holds) its list passes through, and the ones
// just before each backward (where a recomputing stage rebuilds its stash).
void PointModel::buildMemoryShapes(const Schedule& schedule) {
  const Layout& layout = schedule.layout();
  rankStages_.assign(ranks_, {});
  shapes_.assign(ranks_, {});
  for (int r = 0; r < ranks_; ++r) {
    rankStages_[r] = layout.stagesOfRank(r);
    const int k = static_cast<int>(rankStages_[r].size());
    std::vector<int> count(2 * k, 0);
    std::set<std::pair<int, std::vector<int>>> seen;
    auto local = [&](int stage) {
      return static_cast<int>(std::find(rankStages_[r].begin(), rankStages_[r].end(), stage) -
                              rankStages_[r].begin());
    };
    for (const Action& a : schedule.actions(r)) {
      if (!isCompute(a.kind)) continue;
      const int s = local(a.stage);
      if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) {
        seen.insert({s, count});
      }
      if (a.kind == ActionKind::kForward) {
        ++count[2 * s];
      } else if (a.kind == ActionKind::kBackward) {
        --count[2 * s];
      } else if (a.kind == ActionKind::kBackwardInput) {
        --count[2 * s];
        ++count[2 * s + 1];
      } else if (a.kind == ActionKind::kBackwardWeight) {
        --count[2 * s + 1];
      }
      seen.insert({-1, count});
    }
    for (const auto& entry : seen) shapes_[r].push_back({entry.first, entry.second});
  }
}

std::vector<int> PointModel::starts(const std::vector<int>& balance) const {
  std::vector<int> out(balance.size() + 1, 0);
  for (size_t j = 0; j < balance.size(); ++j) out[j + 1] = out[j] + balance[j];
  return out;
}

bool PointModel::sendsForward(int j) const {
  return j + 1 < stages_ && firstRank_[j + 1] != firstRank_[j];
}

bool PointModel::sendsBackward(int j) const { return j > 0 && firstRank_[j - 1] != firstRank_[j]; }

StageCost PointModel::stageCost(int j, int a, int e, bool recompute) const {
  const double tp = options_.tp;
  const double act = machine_.actionSeconds;
  const double forward = sums_->forward.over(a, e) / tp;
  const double full = sums_->backward.over(a, e) / tp;
  const double weight = split_ ? sums_->weight.over(a, e) / tp : 0.0;
  // tp's collectives are not divided by tp; half each way (row- and
  // column-parallel layers pair up), the backward's in I (input gradients);
  // ep's all_to_all likewise (dispatch and combine each way).
  const double collective = (sums_->tpComm.over(a, e) + sums_->epComm.over(a, e)) / 2.0;
  StageCost c;
  c.forward = forward + collective + act + (sendsForward(j) ? postSeconds(e - 1, true) : 0.0);
  c.backward = full - weight + collective + (recompute ? forward + collective : 0.0) + act +
               (sendsBackward(j) ? postSeconds(a, false) : 0.0);
  c.weight = split_ ? weight + act : 0.0;
  return c;
}

double PointModel::makespan(const StageCosts& costs) const {
  return simulate(schedules_.front(), costs, Recording::kNone).makespan;
}

// The sender's time to post the activation after layer l (forward) or the
// gradient of layer l's input (backward).
double PointModel::postSeconds(int l, bool forward) const {
  const LayerCost& c = layers_[l];
  const double bytes = (forward ? c.outputBytesPerSample : c.inputBytesPerSample) * samples_;
  return machine_.sendSeconds + machine_.sendSecondsPerByte * bytes;
}

double PointModel::commSeconds(int e) const {
  return machine_.latencySeconds + layers_[e - 1].outputBytesPerSample * samples_ / machine_.bandwidth;
}

StageCosts PointModel::stageCosts(const std::vector<int>& start,
                                  const std::vector<int>& recompute) const {
  StageCosts c;
  c.forward.resize(stages_);
  c.backward.resize(stages_);
  if (split_) c.weight.resize(stages_);
  c.comm.resize(std::max(0, stages_ - 1));
  c.allReduce.assign(stages_, 0.0);
  for (int j = 0; j < stages_; ++j) {
    const int a = start[j], e = start[j + 1];
    const StageCost cost = stageCost(j, a, e, !recompute.empty() && recompute[j] != 0);
    c.forward[j] = cost.forward;
    c.backward[j] = cost.backward;
    if (split_) c.weight[j] = cost.weight;
    if (j + 1 < stages_) c.comm[j] = commSeconds(e);
    const int r = replicaCounts_[j];
    if (r > 1) {
      c.allReduce[j] = machine_.allReduceLatencySeconds +
                       2.0 * (r - 1) / r * sums_->parameters.over(a, e) / machine_.allReduceBandwidth;
    }
  }
  return c;
}

double PointModel::parameterBytes(int a, int e) const { return sums_->parameters.over(a, e); }
double PointModel::parameterTensors(int a, int e) const { return sums_->tensors.over(a, e); }

double PointModel::stateBytes(int rank, const std::vector<int>& start) const {
  const double shards = options_.tp * (options_.fsdp ? options_.dp : 1);
  double bytes = 0.0;
  for (int j : rankStages_[rank]) {
    const double weights = sums_->parameters.over(start[j], start[j + 1]);
    bytes += weights * (versions_[j] + 1.0 + options_.optimizerStateFactor) / shards;
  }
  return bytes;
}

// Transients of layers [a, e): the backward's working memory (one layer's
// output and input gradients, and a fresh parameter gradient before it is
// accumulated) and the largest parameter tensor. Maxima over the layers, so
// both only grow as a stage takes more layers (the search prunes on that).
PointModel::Transients PointModel::transients(int a, int e) const {
  Transients t;
  for (int l = a; l < e; ++l) {
    const LayerCost& c = layers_[l];
    const double gradients = (c.inputBytesPerSample + c.outputBytesPerSample) * samples_;
    t.backward = std::max(t.backward, gradients + c.largestParameterBytes / options_.tp);
    t.largestParameter = std::max(t.largestParameter, c.largestParameterBytes);
  }
  return t;
}

double PointModel::peakBytes(int rank, const std::vector<int>& start,
                             const std::vector<int>& recompute) const {
  const auto& stages = rankStages_[rank];
  const size_t k = stages.size();
  std::vector<double> keep(2 * k), working(k, 0.0);
  double largest = 0.0;
  for (size_t s = 0; s < k; ++s) {
    const int j = stages[s];
    const int a = start[j], e = start[j + 1];
    const bool again = !recompute.empty() && recompute[j] != 0;
    const double stash = sums_->stash.over(a, e);
    // The stage holds its received input either way; recompute keeps only it.
    const double input = a < e ? layers_[a].inputBytesPerSample * samples_ : 0.0;
    keep[2 * s] = again ? input : stash + input;
    keep[2 * s + 1] = sums_->deferred.over(a, e);
    const Transients t = transients(a, e);
    working[s] = t.backward + (again ? stash : 0.0);
    largest = std::max(largest, t.largestParameter);
  }
  double activations = 0.0;
  for (const MemoryPoint& point : shapes_[rank]) {
    double bytes = point.backwardOf >= 0 ? working[point.backwardOf] : 0.0;
    for (size_t x = 0; x < 2 * k; ++x) bytes += point.counts[x] * keep[x];
    activations = std::max(activations, bytes);
  }
  // The optimizer's step runs after the activations are freed.
  const double shards = options_.tp * (options_.fsdp ? options_.dp : 1);
  const double state = stateBytes(rank, start);
  return std::max(state + activations, state + 2.0 * largest / shards);
}

// The seconds of a rank's per-step dp calls, as the runtime issues them:
// replicate, one flat all-reduce per stage with parameters (data_parallel.py);
// FSDP, one all-gather (the first forward; reshard_after_forward=False keeps it
// for the step) and one reduce-scatter (deferred to the step's end) per unit
// (fsdp.py).
double PointModel::collectiveCalls(double stages, double units) const {
  if (!options_.fsdp) {
    return stages * (machine_.replicateCallSeconds > 0 ? machine_.replicateCallSeconds
                                                        : machine_.allReduceLatencySeconds);
  }
  const double call = machine_.fsdpCallSeconds > 0 ? machine_.fsdpCallSeconds
                                                   : machine_.allReduceLatencySeconds;
  return 2.0 * units * call;
}

// The per-step collectives and fixed costs of one rank.
void PointModel::stepTerms(const std::vector<int>& start, Prediction& p,
                           std::vector<double>& optimizer) const {
  const int dp = options_.dp, ep = options_.ep;
  const int expertCopies = dp / ep;  // the copies holding the same experts
  optimizer.assign(ranks_, 0.0);
  double overhead = 0.0, allReduce = 0.0;
  for (int r = 0; r < ranks_; ++r) {
    double bytes = 0.0, tensors = 0.0, units = 0.0, holding = 0.0, measured = 0.0, experts = 0.0;
    for (int j : rankStages_[r]) {
      experts += sums_->experts.over(start[j], start[j + 1]);
      bytes += sums_->parameters.over(start[j], start[j + 1]);
      tensors += sums_->tensors.over(start[j], start[j + 1]);
      measured += sums_->optimizer.over(start[j], start[j + 1]);
      const double stageUnits = sums_->units.over(start[j], start[j + 1]);
      units += stageUnits;
      holding += stageUnits > 0 ? 1.0 : 0.0;
    }
    if (dp > 1) {
      // Dense gradients over every copy; an ep rank's expert shard over the copies holding it.
      const double dense = bytes - (options_.fsdp ? experts : experts / ep);
      const double shard = experts / ep;
      allReduce = std::max(
          allReduce, collectiveCalls(holding, units) +
                         (2.0 * (dp - 1) / dp * dense +
                          2.0 * (expertCopies - 1) / expertCopies * shard) /
                             options_.tp / machine_.allReduceBandwidth);
    }
    measured /= options_.tp * (options_.fsdp ? dp : 1);
    optimizer[r] = measured + estimatedOptimizerSeconds(machine_, bytes, tensors, options_.tp, dp,
                                                        options_.fsdp);
    overhead = std::max(overhead, optimizer[r]);
  }
  p.overheadSeconds = machine_.stepSeconds + overhead;
  p.allReduceSeconds = allReduce;
}

// Ranks of one node when they share its cores (1 when they do not).
double PointModel::sharedRanks() const {
  const int world = options_.pp * options_.dp * options_.tp;
  const int onNode = machine_.ranksPerNode > 0 ? std::min(machine_.ranksPerNode, world) : world;
  return machine_.cores > 0 && onNode > machine_.cores ? static_cast<double>(onNode) / machine_.cores
                                                       : 0.0;
}

Prediction PointModel::predict(const std::vector<int>& balance,
                               const std::vector<int>& recompute) const {
  const std::vector<int> start = starts(balance);
  const StageCosts costs = stageCosts(start, recompute);
  Prediction p;
  std::vector<double> busy(ranks_, 0.0);
  double makespan = 0.0;
  for (size_t w = 0; w < schedules_.size(); ++w) {
    const SimulationResult sim = simulate(schedules_[w], costs, Recording::kNone);
    const double sign = w + 1 == schedules_.size() ? 1.0 : -1.0;
    makespan += sign * sim.makespan;
    for (int r = 0; r < ranks_; ++r) busy[r] += sign * sim.busyTimePerRank[r];
  }
  makespan = std::max(0.0, makespan * stepScale_);
  double total = 0.0;
  for (double& t : busy) {
    t = std::max(0.0, t * stepScale_);
    total += t;
  }
  // Ranks sharing cores: the node's demand (its ranks' average busy time each)
  // spread over its cores, when that exceeds the simulated makespan.
  const double shared = sharedRanks();
  const double pipeline = std::max(makespan, shared * total / ranks_);
  const double stretch = makespan > 0 ? pipeline / makespan : 1.0;
  p.pipelineSeconds = pipeline;
  for (int r = 0; r < ranks_; ++r) {
    double posting = 0.0;
    for (const SendCount& s : sendCounts_[r]) {
      const int a = start[s.stage], e = start[s.stage + 1];
      posting += s.forward * postSeconds(e - 1, true) + s.backward * postSeconds(a, false);
    }
    const double transfer = std::min(busy[r], posting) * stretch;
    p.transferSeconds.push_back(transfer);
    p.computeSeconds.push_back(busy[r] * stretch - transfer);
    p.waitSeconds.push_back(std::max(0.0, pipeline - busy[r] * stretch));
  }
  p.bubbleFraction = pipeline > 0 ? std::max(0.0, 1.0 - total * stretch / (ranks_ * pipeline)) : 0.0;
  std::vector<double> optimizer;
  stepTerms(start, p, optimizer);
  p.stepSeconds = p.pipelineSeconds + p.overheadSeconds + p.allReduceSeconds;
  if (shared > 0) {
    // The optimizer steps share the cores too: the node's whole demand per
    // step, spread over its cores, bounds the step from below.
    double work = 0.0;
    for (int r = 0; r < ranks_; ++r) work += busy[r] + optimizer[r];
    const double demand = shared * work / ranks_ + machine_.stepSeconds + p.allReduceSeconds;
    if (demand > p.stepSeconds) {
      p.overheadSeconds += demand - p.stepSeconds;
      p.stepSeconds = demand;
    }
  }
  for (int r = 0; r < ranks_; ++r) {
    p.peakBytes.push_back(peakBytes(r, start, recompute));
    if (options_.memoryBytes > 0 && p.peakBytes.back() > options_.memoryBytes) p.fits = false;
  }
  return p;
}

namespace {

// Times of one kind of action, indexed by (stage, microbatch).
class EndTimes {
 public:
  EndTimes(int stages, int microbatches)
      : microbatches_(microbatches), ends_(static_cast<size_t>(stages) * microbatches, -1.0),
        at_(ends_.size(), -1) {}
  void set(int stage, int microbatch, double end, int index) {
    ends_[slot(stage, microbatch)] = end;
    at_[slot(stage, microbatch)] = index;
  }
  double end(int stage, int microbatch) const { return ends_[slot(stage, microbatch)]; }
  int index(int stage, int microbatch) const { return at_[slot(stage, microbatch)]; }

 private:
  size_t slot(int stage, int microbatch) const {
    return static_cast<size_t>(stage) * microbatches_ + microbatch;
  }
  int microbatches_;
  std::vector<double> ends_;
  std::vector<int> at_;
};

bool tight(double a, double b) { return std::abs(a - b) <= 1e-12 * std::max(1.0, std::abs(b)); }

}  // namespace

// Walks back from the action that ends last: each step takes a dependency
// that ended exactly when the action started (the data it waited for, or the
// rank's previous action).
CriticalPath PointModel::criticalPath(const std::vector<int>& balance,
                                      const std::vector<int>& recompute) const {
  return criticalPath(stageCosts(starts(balance), recompute));
}

CriticalPath PointModel::criticalPath(const StageCosts& costs) const {
  const Schedule& schedule = schedules_.front();
  const SimulationResult sim = simulate(schedule, costs, Recording::kFull);
  const auto& line = sim.timeline;
  const int total = schedule.totalMicrobatches();
  EndTimes forward(stages_, total), grad(stages_, total);
  std::vector<int> previous(line.size(), -1), lastOfRank(ranks_, -1);
  int last = -1;
  for (size_t x = 0; x < line.size(); ++x) {
    const TimedAction& t = line[x];
    const Action& a = t.action;
    previous[x] = lastOfRank[t.rank];
    lastOfRank[t.rank] = static_cast<int>(x);
    if (a.kind == ActionKind::kForward) forward.set(a.stage, a.microbatch, t.end, static_cast<int>(x));
    if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) {
      grad.set(a.stage, a.microbatch, t.end, static_cast<int>(x));
    }
    if (last < 0 || t.end > line[last].end) last = static_cast<int>(x);
  }
  CriticalPath path;
  path.forward.assign(stages_, 0.0);
  path.backward.assign(stages_, 0.0);
  path.weight.assign(stages_, 0.0);
  path.comm.assign(std::max(0, stages_ - 1), 0.0);
  for (int x = last; x >= 0;) {
    const TimedAction& t = line[x];
    const Action& a = t.action;
    const int j = a.stage, i = a.microbatch;
    if (a.kind == ActionKind::kForward) path.forward[j] += 1;
    if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) path.backward[j] += 1;
    if (a.kind == ActionKind::kBackwardWeight || (a.kind == ActionKind::kBackward && split_)) {
      path.weight[j] += 1;
    }
    if (t.start <= 0.0) break;
    int next = -1;
    auto crossing = [&](int from, int to) { return firstRank_[from] != firstRank_[to]; };
    if (a.kind == ActionKind::kForward && j > 0) {
      const double comm = crossing(j - 1, j) ? costs.comm[j - 1] : 0.0;
      if (tight(forward.end(j - 1, i) + comm, t.start)) {
        next = forward.index(j - 1, i);
        if (crossing(j - 1, j)) path.comm[j - 1] += 1;
      }
    } else if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) {
      if (tight(forward.end(j, i), t.start)) {
        next = forward.index(j, i);
      } else if (j + 1 < stages_) {
        const double comm = crossing(j, j + 1) ? costs.comm[j] : 0.0;
        if (tight(grad.end(j + 1, i) + comm, t.start)) {
          next = grad.index(j + 1, i);
          if (crossing(j, j + 1)) path.comm[j] += 1;
        }
      }
    } else if (a.kind == ActionKind::kBackwardWeight && tight(grad.end(j, i), t.start)) {
      next = grad.index(j, i);
    }
    x = next >= 0 ? next : previous[x];
  }
  return path;
}

// Per rank and stage: the sends it posts in one step, each way (counted like
// busy time: the last window minus the one before, for an asynchronous
// schedule).
void PointModel::countSends() {
  sendCounts_.assign(ranks_, {});
  for (int r = 0; r < ranks_; ++r) {
    for (int j : rankStages_[r]) sendCounts_[r].push_back(SendCount{j, 0.0, 0.0});
  }
  for (size_t w = 0; w < schedules_.size(); ++w) {
    const double sign = w + 1 == schedules_.size() ? 1.0 : -1.0;
    for (int r = 0; r < ranks_; ++r) {
      for (const Action& a : schedules_[w].actions(r)) {
        const bool forward = a.kind == ActionKind::kForward && sendsForward(a.stage);
        const bool backward = (a.kind == ActionKind::kBackward ||
                               a.kind == ActionKind::kBackwardInput) && sendsBackward(a.stage);
        if (!forward && !backward) continue;
        for (SendCount& s : sendCounts_[r]) {
          if (s.stage != a.stage) continue;
          (forward ? s.forward : s.backward) += sign * stepScale_;
        }
      }
    }
  }
}

// --- predictConfiguration ---------------------------------------------------------

namespace {

void checkConfiguration(const std::vector<LayerCost>& layers, int batchSize, const Configuration& c) {
  if (batchSize < 1) fail("batch_size must be >= 1 (got " + str(batchSize) + ")");
  if (c.pp < 1 || c.dp < 1 || c.tp < 1) {
    fail("mesh (pp, dp, tp) must be >= 1 each (got (" + str(c.pp) + ", " + str(c.dp) + ", " +
         str(c.tp) + "))");
  }
  checkExpertParallel(c.ep, c.dp, c.tp);
  if (c.chunks < 1) fail("chunks must be >= 1 (got " + str(c.chunks) + ")");
  if (c.microbatches < 1 || c.microbatches > batchSize) {
    fail("microbatches must be in 1.." + str(batchSize) + " (every microbatch needs a sample of "
         "the batch of " + str(batchSize) + "; got " + str(c.microbatches) + ")");
  }
  const int layerCount = static_cast<int>(layers.size());
  int stages = c.pp * c.chunks;
  if (!c.replicas.empty()) {
    stages = static_cast<int>(c.replicas.size());
    const int ranks = std::accumulate(c.replicas.begin(), c.replicas.end(), 0);
    if (c.chunks != 1) fail("replicas need chunks=1 (got chunks=" + str(c.chunks) + ")");
    if (*std::min_element(c.replicas.begin(), c.replicas.end()) < 1 || ranks != c.pp) {
      fail("replicas " + joined(c.replicas) + " must be >= 1 each and sum to pp=" + str(c.pp));
    }
  }
  if (static_cast<int>(c.balance.size()) != stages) {
    fail("balance " + joined(c.balance) + " must give the layers of each of the " + str(stages) +
         " stages (pp * chunks" + std::string(c.replicas.empty() ? "" : ", or one per replicated stage") +
         ")");
  }
  if (std::accumulate(c.balance.begin(), c.balance.end(), 0) != layerCount ||
      *std::min_element(c.balance.begin(), c.balance.end()) < 1) {
    fail("balance " + joined(c.balance) + " must be >= 1 per stage and sum to the " +
         str(layerCount) + " layers");
  }
  if (!c.recompute.empty()) {
    const bool binary = std::all_of(c.recompute.begin(), c.recompute.end(),
                                    [](int v) { return v == 0 || v == 1; });
    if (static_cast<int>(c.recompute.size()) != stages || !binary) {
      fail("recompute " + joined(c.recompute) + " must give 0 or 1 for each of the " + str(stages) +
           " stages");
    }
  }
}

}  // namespace

PointOptions pointOptions(const Configuration& config, double memoryBytes,
                          double optimizerStateFactor, bool fsdp) {
  PointOptions o;
  o.schedule = config.schedule;
  o.chunks = config.chunks;
  o.microbatches = config.microbatches;
  o.pp = config.pp;
  o.dp = config.dp;
  o.tp = config.tp;
  o.ep = config.ep;
  o.replicas = config.replicas;
  o.memoryBytes = memoryBytes;
  o.optimizerStateFactor = optimizerStateFactor;
  o.fsdp = fsdp;
  return o;
}

Prediction predictConfiguration(const std::vector<LayerCost>& layers, int batchSize,
                                const MachineCosts& machine, const Configuration& config,
                                double memoryBytes, double optimizerStateFactor, bool fsdp) {
  checkLayers(layers);
  checkMachine(machine);
  checkMemoryArguments(memoryBytes, optimizerStateFactor);
  scheduleTraits(config.schedule);  // names the known schedules if unknown
  checkConfiguration(layers, batchSize, config);
  const PointModel model(layers, batchSize, machine,
                         pointOptions(config, memoryBytes, optimizerStateFactor, fsdp));
  return model.predict(config.balance, config.recompute);
}

}  // namespace pipedream
