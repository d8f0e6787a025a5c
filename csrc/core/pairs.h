// Forward/backward pairs: the "F&B" of dualpipev run together.
//
// DualPipe (DeepSeek-V3 report) runs the forward of one microbatch on one
// chunk beside the full backward of another on the other chunk, so that one's
// all_to_all hides behind the other's compute. A pair is an F directly
// followed by a B of another stage on the same rank, with nothing between
// them in the rank's lowered list:
//
//   ordered (order_transfers):  7F4 7SEND_F4 0RECV_B1 0B0 0SEND_B0
//   paired:                     7F4 0B0 7SEND_F4 0RECV_B1 0SEND_B0
//
// pairForwardBackward() makes every such F ... B adjacent: the transfers
// between them move after the B (their order kept), except the B's own
// receive, which moves before the F. The executor then waits for both
// members' inputs, runs the two, and issues their transfers after both, as
// DualPipe's own runtime does. The result is checked by validateChannels()
// (mirrored pairs, no deadlock under NCCL's rules) like any ordered schedule.
//
// Index legend as in action.h (i microbatch, j stage, r rank, k position).
#pragma once

#include <cstddef>
#include <vector>

#include "schedule.h"

namespace pipedream {

// True when list[k] is an F directly followed by a B (full backward) of
// another stage: the two run as one pair when the executor overlaps them.
bool startsPair(const std::vector<Action>& list, size_t k);

// Positions of the F of every pair in a rank's list.
std::vector<size_t> pairStarts(const std::vector<Action>& list);

// `ordered` (lowered, in transfer order) with every F ... B of another stage
// separated only by transfers made adjacent (see above). Throws
// std::invalid_argument naming the schedule when it is not lowered (over
// several ranks; one rank has no transfers to lower), or when
// the moved transfers are not safe (validateChannels' message).
Schedule pairForwardBackward(const Schedule& ordered);

}  // namespace pipedream
