// Unbounded asynchronous schedules, one step at a time, in constant memory.
//
// A `pipedream` run admits one minibatch per step and a `pipedream-2bw` run
// one batch of m microbatches; the runtime runs, at step t, the
// actions of its rank's lowered list (in transfer order, channels.h) from
// just after the forward of step t-1 up to and including the forward of step
// t and its sends, and at the end the drain.
// Generating the list for the whole run would cost memory proportional to
// its length. After warm-up these lists are periodic: with P steps per
// period (the lcm of the replica counts for pipedream, 1 for 2bw), step
// t + P does what step t did with microbatch ids shifted by P steps' worth
// and each stage's versions shifted by its updates per period (P / r_j).
// AsyncActionFeed generates one short list and serves every step and every
// drain from it by such shifts. The tests check the result against lists
// generated in full, action for action.
//
//   step:      0    1    2    3  | 4          5          6 ...
//   stage 0:   F0   F1   F2   F3 | B0 U1 F4v1 B1 U2 F5v2 B2 U3 F6v3   (p = 4)
//                                  '--- period ---'  = shifted by +1
#pragma once

#include <cstdint>
#include <vector>

#include "generators.h"
#include "schedule.h"

namespace pipedream {

class AsyncActionFeed {
 public:
  // `options.name` must be "pipedream" or "pipedream-2bw"; for pipedream
  // `options.microbatches` is ignored (one minibatch per step); for 2bw it
  // is the batch size in microbatches and `options.batches` is ignored.
  explicit AsyncActionFeed(ScheduleOptions options);

  // Lowered actions `rank` runs at step `step` (>= 0) of an unbounded run.
  std::vector<Action> stepActions(int rank, int64_t step) const;
  // Lowered actions that drain `rank` after `steps` steps (then every
  // admitted microbatch has had its backward and update).
  std::vector<Action> drainActions(int rank, int64_t steps) const;

  // The layout and a short lowered schedule of the same shape (for the
  // executor's metadata).
  const Schedule& base() const { return base_; }
  int period() const { return period_; }
  int microbatchesPerStep() const { return perStep_; }

 private:
  Schedule lowered(int steps) const;
  // [begin, end) of each step's slice in `schedule` for `rank`.
  std::vector<std::pair<size_t, size_t>> slices(const Schedule& schedule, int rank, int steps) const;
  std::vector<Action> shifted(std::vector<Action> actions, int64_t periods) const;

  ScheduleOptions options_;
  int perStep_ = 1;                    // microbatches per step
  int period_ = 1;                     // steps per period
  int warmup_ = 0;                     // steps before the pattern repeats
  std::vector<int> versionsPerPeriod_; // per stage
  Schedule base_;                      // lowered list of warmup_ + 2 periods
  std::vector<std::vector<std::pair<size_t, size_t>>> baseSlices_;  // per rank
};

}  // namespace pipedream
