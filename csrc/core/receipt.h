// Receipt: when a rank knows, from its own list alone, that a send arrived.
//
// A send's buffer must live until the receiver has taken it, and Gloo says so
// only when the send is waited for. Waiting blindly could block on a peer that
// is itself waiting (deadlock until the timeout), so the executor waits only
// for sends the schedule proves received:
//
//   rank r: ... 1B0 1SEND_B0 ........ 1RECV_F2 1F2 ...     (stage 1)
//                      \                  ^
//   rank q: ... 0RECV_B0 0B0 0F2 0SEND_F2 ...              (stage 0)
//
// q's 0B0 consumed r's 1SEND_B0; q sent 0SEND_F2 after that, so once r's 1F2
// has its input, 1SEND_B0 has certainly arrived: waiting for it returns at
// once, and its buffer goes. In general, for a send s of r to q: c_q is q's
// compute action that consumes s (the first F, B or I of the receiving stage
// and microbatch after q's matching RECV); t is q's first send to r after c_q;
// the release point of s is r's compute action that consumes t. A send with
// no such t (the last messages of a step) is released at the end of the step.
//
// Indices (legend as in action.h): k, positions in one rank's lowered list.
#pragma once

#include <vector>

#include "schedule.h"

namespace pipedream {

// For `rank` of a lowered schedule: result[k] lists (ascending) the positions
// of the rank's SEND actions known received once the compute action at
// position k has its inputs; empty for every other k. Every send appears at
// most once, and only at a position after its own; a send whose receiver or
// reply the lists do not show is not listed (it waits for the end of the step).
// Throws std::out_of_range if `rank` is not a rank of the schedule.
std::vector<std::vector<int>> sendReleasePoints(const Schedule& lowered, int rank);

}  // namespace pipedream
