// Choosing the whole configuration of a run: schedule, chunks, microbatches,
// balance, recompute per stage and mesh (pp, dp, tp), scored by one cost model
// that predicts the step time and the peak memory of every rank. See
// docs/planner.md, "Choosing the whole configuration".
//
// Legend: l layer, j stage (pp * chunks of them), r rank of one pipeline,
// i microbatch, b samples of one microbatch.
//
// The cost model (predictConfiguration):
//   - every layer's forward / backward costs are affine in b
//     (t(b) = fixed + perSample * b: two profiled microbatch sizes fix both);
//     a stage's F, B (I and W for split-backward schedules) are the sums over
//     its layers, divided by tp, plus MachineCosts::actionSeconds per action
//     and, for an action that sends, sendSeconds + sendSecondsPerByte x the
//     bytes it sends (the rank's own time to post it);
//     recompute adds the stage's forward to its B (to I when split);
//   - the schedule the runtime would run (buildSchedule) is simulated
//     (simulate.h) with those costs and with boundary transfers of
//     latencySeconds + bytes / bandwidth; the makespan is the pipeline's time;
//   - b, a microbatch's samples, is ceil(batchSize / microbatches): the
//     runtime splits with torch.tensor_split, whose first microbatches are
//     the largest (pipedream: a step is one minibatch, the whole batch);
//   - ranks sharing cores (ranksPerNode > cores, else every rank on one node)
//     stretch the compute: the pipeline takes max(makespan, R x the average
//     busy time of a rank / cores) for R ranks on a node, every rank's
//     compute scaled alike (the node's demand spread over its cores); and the
//     step takes at least R x (the average busy time + optimizer step of a
//     rank) / cores + the per-step and all-reduce terms (the optimizer steps
//     share the cores too; the excess counts as overhead);
//   - an asynchronous schedule never drains: its step is the difference of
//     the simulated makespans of two windows and one (fill and drain cancel);
//   - per step: stepSeconds, the optimizer (the sum of the rank's layers'
//     optimizerSeconds, plus optimizerSecondsPerByte times its parameter bytes
//     and optimizerSecondsPerTensor times its parameter tensors; / dp under
//     FSDP, / tp) of the slowest rank and the data-parallel gradient all-reduce
//     over dp (replicate: one flat all-reduce per stage with parameters,
//     replicateCallSeconds each), or FSDP's calls as the runtime issues them:
//     one all-gather and one reduce-scatter per unit (a layer with parameters)
//     per step, fsdpCallSeconds each;
//   - tensor parallelism: each microbatch's forward and backward of a layer
//     add its tpCollectives all-reduces over tp (half in each, a measured
//     in-step call each: replicateCallSeconds), not divided by tp;
//   - expert parallelism (ep > 1; dp counts every copy, ep of them sharing
//     their experts): a layer's experts are held 1 / ep each (under FSDP
//     1 / dp, as the dense part), their gradients reduced over dp / ep copies
//     (the dense part's over dp); each microbatch's forward and backward add
//     its allToAllCalls (half in each, replicateCallSeconds each) and 4 row
//     exchanges of (ep - 1) / ep x allToAllBytesPerSample x b bytes at the
//     all-reduce bandwidth;
//   - memory per rank: weights, gradients and optimizer state
//     (optimizerStateFactor x weights; / dp under FSDP; / tp), plus the
//     activations in flight as the simulator counts them for the schedule
//     (peakActivations x the stage's stashed bytes and its received input per
//     microbatch; only the input with recompute, plus one microbatch being
//     recomputed), plus before a backward its working memory (the largest
//     layer's output gradient + input gradient, and its largest parameter
//     tensor's fresh gradient); or, if larger, the optimizer's step: the state
//     plus twice the rank's largest parameter tensor (Adam's temporaries).
//
// The search (searchConfigurations) returns the best configuration under this
// model: exactly what enumerateConfigurations (every point of the space
// scored) returns, only faster (bounds prune what cannot win).
#pragma once

#include <array>
#include <string>
#include <vector>

namespace pipedream {

// One layer of the chain stages are cut from. A traced model's groups in
// topological order are such a chain; `outputBytesPerSample` then is what
// crosses a cut placed after this layer (the live activations).
struct LayerCost {
  double forwardFixed = 0.0;         // seconds per microbatch, whatever its size
  double forwardPerSample = 0.0;     // seconds per sample
  double backwardFixed = 0.0;        // input + weight gradients
  double backwardPerSample = 0.0;
  double weightShare = 0.5;          // share of the backward that is the weight gradient (W)
  double outputBytesPerSample = 0.0; // sent to the next stage when cut after this layer
  double stashBytesPerSample = 0.0;  // saved for its backward (autograd's saved tensors)
  double inputBytesPerSample = 0.0;  // its input (what recompute keeps)
  double parameterBytes = 0.0;
  double parameterTensors = 0.0;       // the optimizer pays per tensor
  double largestParameterBytes = 0.0;  // its largest parameter tensor (transients)
  double optimizerSeconds = 0.0;       // the optimizer's step over its parameters (measured)
  // Tensor parallelism (tp > 1) over this layer: the collectives a plan adds per
  // microbatch, forward and backward together (Megatron: a row-parallel output
  // all-reduce in forward, a column-parallel input-gradient all-reduce in
  // backward), and the bytes per sample they reduce. 0: the plan leaves it whole.
  double tpCollectives = 0.0;
  double tpCollectiveBytesPerSample = 0.0;
  // Expert parallelism (ep > 1): the part of parameterBytes that is experts
  // sharded over ep (each ep rank holds 1 / ep of it; its gradients reduce over
  // dp / ep copies, the rest over all dp), and the all_to_all exchanges a plan
  // adds per microbatch, forward and backward together (dispatch and combine,
  // their backward, the counts), with the bytes of routed rows one sample sends
  // in each exchange that moves rows (4 per microbatch), (ep - 1) / ep of them
  // to other ranks.
  double expertParameterBytes = 0.0;
  double allToAllCalls = 0.0;
  double allToAllBytesPerSample = 0.0;
};

// What the machine adds to the layers' compute, measured at start-up by a
// short calibration (pipedream_ext/_planning/calibration.py).
struct MachineCosts {
  double actionSeconds = 0.0;       // runtime overhead per F/B/I/W action
  double sendSeconds = 0.0;         // rank time to post one boundary send
  double sendSecondsPerByte = 0.0;  // and per byte it sends (copies, socket writes)
  double stepSeconds = 0.0;         // per step: the step call, loss all-reduce, set-up
  double latencySeconds = 0.0;      // point-to-point, per message
  double bandwidth = 1e10;          // point-to-point bytes/s
  double allReduceLatencySeconds = 0.0;  // per all-reduce call (dp, tp)
  double allReduceBandwidth = 1e10;      // ring all-reduce bus bytes/s
  // The optimizer's step per parameter byte and per parameter tensor, on top
  // of the layers' measured optimizerSeconds (for layers measured without it).
  double optimizerSecondsPerByte = 0.0;
  double optimizerSecondsPerTensor = 0.0;
  int cores = 0;         // cores the ranks of one node share; 0 = one core per rank
  int ranksPerNode = 0;  // 0 = every rank on one node
  // One FSDP collective call of one unit in a step (its all-gather or its
  // reduce-scatter, with the hooks and copies around it); 0 = an all-reduce's
  // latency.
  double fsdpCallSeconds = 0.0;
  // One replicated stage's gradient all-reduce in a step (with the mesh's
  // per-step work around it; also the price of a tp collective call);
  // 0 = an all-reduce's latency.
  double replicateCallSeconds = 0.0;
};

enum class RecomputeChoice {
  kNever,   // no stage recomputes
  kAlways,  // every stage recomputes
  kSearch,  // the search decides per stage (per rank for multi-chunk schedules)
};

// What the search may choose. A field with one value fixes that choice.
struct SearchSpace {
  int worldSize = 1;
  int batchSize = 1;  // samples per step of ONE pipeline (each dp rank gets its own batch)
  std::vector<std::string> schedules;  // candidate names (scheduleNames())
  std::vector<int> interleavedChunks = {2};  // chunk counts tried for interleaved schedules
  std::vector<int> microbatches;       // candidate counts, each <= batchSize
  std::vector<std::array<int, 3>> meshes;  // (pp, dp, tp) candidates, pp * dp * tp = worldSize;
                                            // empty = {(worldSize, 1, 1)}
  std::vector<int> balance;            // fixed layers per stage, or empty (searched)
  RecomputeChoice recompute = RecomputeChoice::kNever;
  std::vector<int> recomputeStages;    // fixed 0/1 per stage (overrides `recompute`), or empty
  double memoryBytes = 0.0;            // per rank; 0 = unlimited
  double optimizerStateFactor = 2.0;   // optimizer state bytes per weight byte (Adam: 2)
  bool fsdp = false;                   // dp shards weights, gradients and optimizer state
  int ep = 1;  // expert parallelism (fixed): ep of each mesh's dp copies share their experts
  int candidates = 5;                  // runners-up kept in SearchResult::candidates
};

// Predicted costs of one configuration. Per-rank vectors have pp entries (the
// ranks of one pipeline; every dp/tp copy predicts the same).
struct Prediction {
  double stepSeconds = 0.0;          // the whole step: pipeline + per-step costs
  double pipelineSeconds = 0.0;      // the simulated makespan
  double overheadSeconds = 0.0;      // stepSeconds' fixed part and the optimizer
  double allReduceSeconds = 0.0;     // dp / FSDP collectives per step
  std::vector<double> computeSeconds;   // per rank: F/B/I/W (with actionSeconds)
  std::vector<double> waitSeconds;      // per rank: idle in the makespan (bubble, transfers)
  std::vector<double> transferSeconds;  // per rank: posting sends
  std::vector<double> peakBytes;        // per rank
  double bubbleFraction = 0.0;
  bool fits = true;  // every rank's peakBytes <= memoryBytes (or no limit)
};

struct Configuration {
  std::string schedule;
  int chunks = 1;
  int microbatches = 1;
  int pp = 1, dp = 1, tp = 1;
  int ep = 1;                  // of the dp copies, ep share each stage's experts (ep divides dp)
  std::vector<int> balance;    // layers per stage, pp * chunks entries
  std::vector<int> replicas;   // PipeDream replicas per stage (predict only); empty = 1 each
  std::vector<int> recompute;  // 0/1 per stage
  Prediction prediction;
};

struct SearchResult {
  bool feasible = false;  // some configuration fits memoryBytes
  Configuration best;
  std::vector<Configuration> candidates;  // runners-up, best first, `best` excluded
  long long evaluated = 0;  // configurations simulated
  long long pruned = 0;     // configurations ruled out by a bound
};

// Fills `config.prediction`. Throws std::invalid_argument naming the bad value
// (unknown schedule, balance not summing to the layers, ...).
Prediction predictConfiguration(const std::vector<LayerCost>& layers, int batchSize,
                                const MachineCosts& machine, const Configuration& config,
                                double memoryBytes = 0.0, double optimizerStateFactor = 2.0,
                                bool fsdp = false);

// The best configuration under the cost model (ties: fewer stages, then the
// order of `space.schedules`, then fewer microbatches, the order of
// `space.meshes`, fewer chunks, the smaller balance and recompute list;
// improvements below 1e-10 of the step are not searched for, so of two
// configurations that close either may come back). When nothing fits,
// `feasible` is false and `best` is the smallest peak scored. Runners-up are
// the best configuration of each other (mesh, schedule, chunks, microbatches)
// that fits. Recompute kSearch: per stage (per rank for multi-chunk
// schedules); with a flush schedule only where the rank does not fit without
// it (the makespan never shrinks when an action costs more). Throws
// std::invalid_argument for an invalid space (empty lists, a mesh whose
// product is not worldSize, microbatches > batchSize, ...).
SearchResult searchConfigurations(const std::vector<LayerCost>& layers,
                                  const MachineCosts& machine, const SearchSpace& space);

// Every point of `space` scored by predictConfiguration (tests compare it with
// searchConfigurations; exponential in the layers).
SearchResult enumerateConfigurations(const std::vector<LayerCost>& layers,
                                     const MachineCosts& machine, const SearchSpace& space);

}  // namespace pipedream
