// Schedule generators. Each returns a compute-only Schedule (F/B/I/W plus
// UPDATE and ALLREDUCE); lower() (lower.h) inserts the communication.
//
// Legend: p stages (ranks for interleaved), m microbatches per batch, v chunks
// per rank, r_j replicas of stage j, i microbatch, j stage, v version.
//
// 1F1B (PipeDream-Flush), p = 4, m = 8, one clock per F or B:
//
//   rank 0: F0 F1 F2 F3 .. .. B0 F4 B1 F5 B2 F6 B3 F7 B4 .. B5 .. B6 .. B7 U1
//   rank 1:    F0 F1 F2 .. B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .. B6 .. B7 U1
//   rank 2:       F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .. B7 U1
//   rank 3:          F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 U1
//
// (the grid only sketches the order; real times come from simulate()).
//
// Asynchronous PipeDream: stage j admits NOAM_j = ceil(ranks in stages
// j..p-1 / r_j) minibatches, then alternates B and F with an UPDATE after
// every B, so F(i) on stage j reads version max(0, i - (p-1-j)) on a
// straight pipeline.
#pragma once

#include <string>
#include <vector>

#include "schedule.h"
#include "traits.h"

namespace pipedream {

struct ScheduleOptions {
  std::string name;          // one of scheduleNames()
  int stages = 1;            // p: pipeline stages (ranks when chunks per rank > 1)
  int microbatches = 1;      // m: microbatches per batch (minibatches for pipedream)
  int chunks = 1;            // v: model chunks per rank (multi-chunk schedules; 2 for zbv, dualpipev)
  std::vector<int> replicas; // per-stage replica counts (empty: all 1)
  int batches = 1;           // batches in the schedule (not for pipedream)
  // pipedream only: every stage reads, for minibatch i, the version stage 0
  // read (PipeDream's vertical sync) instead of its newest one.
  bool verticalSync = false;
};

// A schedule's generator: every rank's compute list for `options` (all
// `options.batches` batches) on `layout`, which buildSchedule made from the
// schedule's traits (chunked or straight) after the checks the traits imply.
// Throws std::invalid_argument naming the fix for what only this schedule
// rules out (dualpipev: m < 2p, ...).
using ScheduleGenerator = std::vector<std::vector<Action>> (*)(const ScheduleOptions& options,
                                                                const Layout& layout);

struct RegisteredSchedule {
  ScheduleTraits traits;  // what the schedule means; traits.name is its name
  ScheduleGenerator generate;
};

// The schedule registry: one row per schedule, the only place a name meets its
// generator (generators.cpp says how to add one). allScheduleTraits() is its
// traits column, scheduleNames() its names, in the same order.
const std::vector<RegisteredSchedule>& scheduleRegistry();

// "gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev",
// "interleaved-zb", "pipedream", "pipedream-2bw": the registry's names, in its order.
std::vector<std::string> scheduleNames();

// Builds the compute-only schedule with the registry's generator of
// `options.name`. Throws std::invalid_argument naming the bad value and the
// fix (unknown name, m < p where needed, ...).
Schedule buildSchedule(const ScheduleOptions& options);

// NOAM of stage j: ceil(sum of replicas of stages j..p-1 / r_j).
int numOptimalActiveMinibatches(const std::vector<int>& replicas, int stage);

}  // namespace pipedream
