// Lowering: inserts SEND/RECV actions into a compute-only schedule.
//
// For every compute action whose input lives on another rank, a RECV is
// placed directly before it; every output needed on another rank gets a SEND
// directly after the action that produced it:
//
//   rank 0:  0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 ...
//   rank 1:  1RECV_F0 1F0 1B0 1SEND_B0 ...
//
// Sends are asynchronous (they never wait for the receiver), so this order
// cannot deadlock whenever the compute-only schedule is feasible: every RECV
// waits only for a SEND that its peer issues as soon as the producing action
// is done. Transfers between stages on the same rank need no communication.
#pragma once

#include "schedule.h"

namespace pipedream {

// Throws std::invalid_argument if `schedule` already contains communication.
Schedule lower(const Schedule& schedule);

// The compute-only view: drops SEND/RECV actions.
Schedule stripCommunication(const Schedule& schedule);

}  // namespace pipedream
