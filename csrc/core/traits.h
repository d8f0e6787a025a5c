// What each schedule means, as data: which schedule flushes, who steps the
// optimizer and when, how replicas combine gradients, and what the planner may
// assume. Every schedule's traits are one row of the schedule registry
// (generators.h: traits plus generator); buildSchedule, AsyncActionFeed, the
// executor and the Python layer ask these traits instead of comparing schedule
// names.
#pragma once

#include <string>
#include <vector>

#include "schedule.h"

namespace pipedream {

// When and by whom a stage's optimizer steps.
enum class UpdateRule {
  kCallerPerBatch,  // flush schedules: the caller, once per batch, after the step
  kPerMinibatch,    // pipedream: inside the pipeline, after every minibatch
  kPerBatch,        // pipedream-2bw: inside the pipeline, once per batch of m microbatches
};

// How a replicated stage combines its replicas' gradients at ALLREDUCE.
enum class ReplicaReduction {
  kSum,   // replicas ran parts of one batch whose loss is scaled already
  kMean,  // each replica ran its own minibatch (pipedream)
};

struct ScheduleTraits {
  std::string name;
  bool asynchronous = false;  // no flush: the runtime steps the optimizer
  UpdateRule updateRule = UpdateRule::kCallerPerBatch;
  ReplicaReduction replicaReduction = ReplicaReduction::kSum;
  bool multiChunk = false;          // chunks > 1 allowed (several stages per rank)
  int fixedChunks = 0;              // > 0: exactly this many chunks per rank (V schedules)
  ChunkPlacement chunkPlacement = ChunkPlacement::kRoundRobin;  // with chunks: the layout
  bool supportsReplicas = false;    // replicated stages allowed
  bool splitBackward = false;       // backward split into I and W
  bool stashWeights = false;        // forwards read stashed weight versions
  bool streaming = false;           // the executor is fed per step by AsyncActionFeed
  bool supportsVerticalSync = false;
  bool plannerStraight = false;     // the planner must not replicate stages
  bool plannerTwoVersions = false;  // the planner budgets two weight versions

  // Microbatches one pipeline step admits, for m microbatches per batch
  // (pipedream: one minibatch per step).
  int microbatchesPerStep(int m) const {
    return updateRule == UpdateRule::kPerMinibatch ? 1 : m;
  }
};

// Every schedule, in the order scheduleNames() lists them: the traits of the
// schedule registry's rows (these two are defined with it, in generators.cpp).
const std::vector<ScheduleTraits>& allScheduleTraits();

// Throws std::invalid_argument naming `name` and the known schedules.
const ScheduleTraits& scheduleTraits(const std::string& name);

// "caller_per_batch", "per_minibatch", "per_batch" / "sum", "mean".
const char* updateRuleName(UpdateRule rule);
const char* replicaReductionName(ReplicaReduction reduction);

}  // namespace pipedream
