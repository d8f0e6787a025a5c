// Validator: checks every rule a schedule must obey before anything runs it.
//
// Per action: stage and microbatch in range, and on the rank the layout puts
// them on. Per (stage, microbatch): exactly one F and either one B or one I
// plus one W. Per rank, in list order: B/I after their F, W after its I, the
// same version read by F and its backward; a version is read only after the
// UPDATE that creates it; UPDATEs of a stage number 1, 2, 3, ... and each
// follows at least one gradient (B or W) since the previous one; replicated
// stages ALLREDUCE (same version) between their last gradient and the
// UPDATE; no gradient is left without an UPDATE. Lowered schedules: RECV
// before the consumer, SEND after the producer, every SEND matched by one
// RECV on the peer. Across ranks: upstream F before downstream F and
// downstream B/I before upstream B/I, checked by running the schedule in the
// simulator with zero costs: an infeasible order shows up as a deadlock.
//
// On failure, throws std::invalid_argument whose message names the problem
// and shows the rank-by-step grid with the offending action marked >>like
// this<<.
#pragma once

#include "schedule.h"

namespace pipedream {

void validate(const Schedule& schedule);

}  // namespace pipedream
