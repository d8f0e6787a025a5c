// PipeDream's partitioner: dynamic programming over planning states and worker
// counts, level by level (innermost first), with two cost models. See
// docs/planner.md for the exact formulas.
#pragma once

#include <string>
#include <vector>

#include "profile_graph.h"
#include "topology.h"

namespace pipedream {

enum class CostModel { PipeDream, Default };
CostModel parseCostModel(const std::string& name);  // "pipedream" | "default"
const char* costModelName(CostModel model);

// How the data-parallel ranks of one stage hold its weights: each keeps the
// whole stage (DDP-style all-reduce) or a 1/degree shard of the weights,
// gradients and optimizer state (FSDP: reduce-scatter + all-gather).
enum class Sharding { Replicate, Fsdp };
Sharding parseSharding(const std::string& name);  // "replicate" | "fsdp"
const char* shardingName(Sharding sharding);

// Data parallelism inside every stage, as on a (pp, dp) device mesh: each
// stage is held by `degree` ranks that split the minibatches between them.
// Off (degree 0), the planner may replicate stages PipeDream's way instead.
// On, stages are straight over the topology's workers (the pp dimension), the
// default cost model applies and the formulas are in docs/planner.md
// ("Planning with data parallelism and sharding").
struct DataParallelOptions {
  int degree = 0;                  // dp ranks per stage; 0 = off
  Sharding sharding = Sharding::Replicate;
  double bandwidth = 0.0;          // bytes/s among a stage's dp ranks
  double optimizerState = 2.0;     // optimizer state bytes per weight byte (AdamW: 2)
  bool enabled() const { return degree > 0; }
};

// Tensor parallelism inside every stage: the tp dimension of a (pp, dp, tp)
// mesh, innermost. Each of a stage's dp ranks is `degree` ranks that split
// every layer Megatron-style: weights, gradients and optimizer state 1/degree
// each, compute 1/degree plus `allReducesPerLayer` ring all-reduces of each
// layer's output per minibatch (forward and backward); with sequence
// parallelism the stashed activations and the boundary sends are 1/degree
// too. Needs data parallelism on (degree 1 for a (pp, 1, tp) mesh); the
// formulas are in docs/planner.md ("Planning with tensor parallelism").
struct TensorParallelOptions {
  int degree = 1;                   // tp ranks per dp rank of a stage; 1 = off
  bool sequenceParallel = false;    // activations sharded along the sequence too
  double bandwidth = 0.0;           // bytes/s among a stage's tp ranks
  double allReducesPerLayer = 4.0;  // Megatron: 2 forward + 2 backward per block
  bool enabled() const { return degree > 1; }
};

struct PlannerOptions {
  CostModel costModel = CostModel::Default;
  bool straight = false;       // one worker per stage, no replication
  bool fewerWorkers = false;   // a plan may leave workers unused
  double compression = 0.0;    // activation compression ratio; 0 = absent
  bool twoBw = false;          // default model: 2 weight versions (2BW) instead of PipeDream's
  int maxAntichainStates = 4096;  // above this, use topological cuts
  double workBudget = 1.5e8;      // DP cell updates allowed before coarsening
  DataParallelOptions dataParallel;
  TensorParallelOptions tensorParallel;
};

struct PlanStage {
  std::vector<int> nodes;  // graph node indices (file order)
  int replicas = 1;
  std::vector<int> ranks;
  double time = 0.0;            // predicted seconds per minibatch (see docs)
  double computeSeconds = 0.0;  // fwd + bwd of its layers, one worker
  double parameterBytes = 0.0;
  double activationBytes = 0.0;
  double memoryBytes = 0.0;  // per rank: modelStateBytes + stashedActivationBytes
  double modelStateBytes = 0.0;  // weight versions; with data parallelism weights, gradients
                                 // and optimizer state (divided by the degree under FSDP);
                                 // all divided by the tp degree
  double stashedActivationBytes = 0.0;  // activations of the minibatches in flight (/ tp with SP)
  double tensorParallelSeconds = 0.0;   // TP all-reduces of one minibatch on its tp ranks
                                        // (time = (compute / tp + this + dp sync) / dp)
  int layerStart = -1;       // for a chain graph: layers [start, end), Input excluded
  int layerEnd = -1;
};

struct Plan {
  CostModel costModel = CostModel::Default;
  StateKind stateKind = StateKind::Antichain;
  int numStates = 0;
  bool coarsened = false;  // topological cuts thinned to fit the work budget
  Topology topology;
  int numWorkers = 0;
  int usedWorkers = 0;
  bool chain = false;
  double timePerStage = 0.0;       // the DP optimum: bottleneck seconds per minibatch
  double dataParallelTime = 0.0;   // same model, plain data parallelism on all workers
  double singleWorkerTime = 0.0;   // fwd + bwd of the whole model on one worker
  double speedupOverDp = 0.0;      // dataParallelTime / timePerStage
  std::vector<PlanStage> stages;
};

// Plans `graph` on `topology`. Throws std::invalid_argument when the topology
// is invalid or no plan satisfies the memory limit.
Plan planPartition(const ProfileGraph& graph, const Topology& topology,
                   const PlannerOptions& options = {});

// The same DP on caller-provided states (used by tests to compare paths).
Plan planOnStates(const ProfileGraph& graph, const PlanningStates& states,
                  const Topology& topology, const PlannerOptions& options);

// Estimated DP cell updates for `states` on `topology` (path selection).
double estimateWork(const PlanningStates& states, const Topology& topology, bool straight);

}  // namespace pipedream
