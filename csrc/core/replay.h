// simulate()'s makespan of one schedule, replayed for other costs at a small
// part of a simulation's price (the configuration search scores millions of
// cost vectors against one schedule: configure_search.cpp).
//
// The order in which simulate() runs the actions depends only on which
// dependencies have happened, never on the costs; one full simulation records
// it, and a replay evaluates the same recurrences in that order (start = the
// latest of the rank's free time and each dependency's end, plus the transfer
// after a neighbour's; end = start + cost) without the simulator's
// bookkeeping. The result is bit-identical to simulate()'s: the same additions
// and maxima of the same values.
#pragma once

#include <vector>

#include "schedule.h"
#include "simulate.h"

namespace pipedream {

class MakespanReplay {
 public:
  // Records the order simulate() runs `schedule` in, with `costs` (any costs
  // of the right shape; a split backward when costs.weight is given). Throws
  // what simulate() throws.
  MakespanReplay(const Schedule& schedule, const StageCosts& costs);

  // False for a schedule holding collectives (ALLREDUCE): use simulate().
  bool compiled() const { return compiled_; }

  // simulate(schedule, costs).makespan. `costs` must have the shape of the
  // costs compiled with (std::invalid_argument otherwise); not otherwise checked.
  double makespan(const StageCosts& costs) const;

 private:
  struct Op {
    int rank = 0;
    int cost = -1;  // index into cost_ (F, B, I, W of a stage), or -1: takes no time (a send)
    int own = -1;   // the op of its own stage it waits for, or -1
    int data = -1;  // the op of a neighbouring stage it waits for, or -1
    int comm = -1;  // the boundary whose transfer follows `data`, or -1: none
  };

  int stages_ = 0;
  int ranks_ = 0;
  bool split_ = false;
  bool compiled_ = false;
  std::vector<Op> ops_;
  mutable std::vector<double> end_, cost_, free_;  // scratch of makespan()
};

}  // namespace pipedream
