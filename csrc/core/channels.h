// Point-to-point channels: the order in which both ends of every pair of
// ranks issue the pair's transfers, derived from the lowered schedule and
// proven safe under NCCL's rules.
//
// NCCL's rules (and so the strictest backend's): messages carry no tag, so
// the k-th send from rank a to rank b meets the k-th receive at b from a and
// the two must agree on size and type; and all operations between one pair
// run on one stream, one at a time, in the order each end issued them: a
// receive at the head of the stream holds everything behind it until its data
// arrives, a send until its receive is posted. So for every pair (a, b) the
// sequence of a's operations with b must mirror b's operations with a: the
// k-th is a send of transfer t on one end and the receive of t on the other.
//
// A lowered schedule (lower.h: RECV right before its consumer) does not
// mirror: in 1F1B, rank 0 sends F1 while rank 1 sends B0, and each would
// wait for the other's receive behind its own send:
//
//   rank 0 with rank 1:  0SEND_F0 0SEND_F1 0RECV_B0 ...
//   rank 1 with rank 0:  1RECV_F0 1SEND_B0 1RECV_F1 ...   <- k = 1 crosses
//
// orderTransfers() moves RECV actions (SENDs stay right after their
// producers) so that every pair mirrors. The order of a pair's transfers is
// the order their sends happen when the schedule is simulated (unit costs,
// no latency; ties: forward before backward, then microbatch, then stage),
// which every rank computes identically from the schedule alone. Each RECV
// goes as early as that order allows (right after the pair's operation
// before it), so receives are posted ahead of their consumers without
// crossing a send the peer has not matched yet:
//
//   rank 0 with rank 1:  0SEND_F0 0SEND_F1 0RECV_B0 ...
//   rank 1 with rank 0:  1RECV_F0 1RECV_F1 1SEND_B0 ...   (1RECV_F1 moved up)
//
// A RECV action now means "post this receive" (it never blocks); its
// consumer (F, B or I) waits for the data. For asynchronous action feeds
// (action_feed.h), whose lists are served one step at a time, a RECV of a
// microbatch is never moved into a step before the one that admits it.
//
// validateChannels() proves the result: (1) every pair's two sequences
// mirror each other, operation by operation; (2) the schedule cannot deadlock
// under NCCL's rules, by running it in a channel simulator: each pair is one
// in-order stream whose k-th operation completes once both ends issued it and
// operation k-1 completed; a receive is issued only once its sender issued the
// send (so a receiver that learns shapes from the sender's metadata is covered
// too), later operations of the pair queue behind it; compute actions wait for
// their received inputs, the send-release points (receipt.h) and the end of
// the list wait for sends; replicas meet at ALLREDUCE.
//
// Index legend as in action.h (i microbatch, j stage, r rank, k position).
#pragma once

#include <string>
#include <vector>

#include "schedule.h"

namespace pipedream {

// One message between two stages: the activation (forward) or gradient
// (backward) of microbatch i across boundary j (between stages j and j+1).
struct TransferKey {
  bool forward = true;
  int boundary = 0;
  int microbatch = 0;

  // The transfer a SEND_* or RECV_* action is one end of.
  static TransferKey of(const Action& comm);
  bool operator==(const TransferKey& other) const {
    return forward == other.forward && boundary == other.boundary && microbatch == other.microbatch;
  }
  bool operator<(const TransferKey& other) const;
  std::string toString() const;  // "F0:3" (boundary 0, microbatch 3), "B1:0"
};

// The rank at the other end of a SEND_* / RECV_* action run by `rank`.
int peerOf(const Layout& layout, const Action& comm);

// One end's operations with one peer, in list order.
struct ChannelOp {
  bool send = false;
  TransferKey key;
  int position = 0;  // in the rank's list
};
std::vector<ChannelOp> channelOps(const Schedule& schedule, int rank, int peer);

// The lowered schedule with every RECV moved to where it is issued (see the
// file comment); SENDs and compute actions keep their order. RECVs may be
// anywhere before their consumers in `lowered`. `microbatchesPerStep` > 0:
// the lists are served one step of that many microbatches at a time (streams).
// Throws std::invalid_argument if `lowered` is not lowered or cannot run, and
// std::logic_error if no mirrored order exists within the step rule.
Schedule orderTransfers(const Schedule& lowered, int microbatchesPerStep = 0);

// Throws std::invalid_argument naming the pair, the position and both
// operations if a pair's sequences do not mirror, or the blocked ranks and
// what each waits for if the channel simulation deadlocks. `forwardOnly`:
// checks the F / SEND_F / RECV_F actions alone (evaluation runs only those).
void validateChannels(const Schedule& ordered, bool forwardOnly = false);

// The work validateChannels() did, counted: each pair's operations are
// indexed once and every input, receipt point and send is looked up by key,
// so `steps` and `lookups` grow with the actions, not with their square
// (tests/cpp/test_channels.cpp counts them).
struct ChannelCheckStats {
  long actions = 0;  // actions of all ranks
  long steps = 0;    // attempts to run a rank's next action (one sweep tries every rank)
  long sweeps = 0;   // passes over all ranks until nothing moves
  long lookups = 0;  // channel operations examined: a compute action's receives, its receipt
                     // point's sends, the sends checked at the end of a list
};
void validateChannels(const Schedule& ordered, bool forwardOnly, ChannelCheckStats* stats);

// A (pp, dp, tp) device mesh in ascending rank order (init_device_mesh): one
// pipeline per (dp, tp) coordinate c = dp_i * tensorParallel + tp_i, on its own
// pp group, whose rank r is global rank r * dp * tp + c. The tp ranks of a
// (pp, dp) coordinate share every compute action's tensor-parallel collectives;
// with `shardedDataParallel` (FSDP) the dp ranks of a (pp, tp) coordinate share
// its all-gathers and reduce-scatters too.
struct MeshShape {
  int dataParallel = 1;
  int tensorParallel = 1;
  bool shardedDataParallel = false;
};

// validateChannels() over a whole mesh: `pipelines` (one ordered schedule per
// (dp, tp) coordinate, in coordinate order; the runtime runs the same one on
// every coordinate) run side by side on the global ranks. Proves (1) each
// pipeline's pairs mirror (the pairs of two pipelines are distinct pairs of
// global ranks: their pp groups share no rank), and (2) the whole world cannot
// deadlock under NCCL's rules, each pair of global ranks one in-order stream
// and every compute action a collective of its rank's groups, run once every
// member reached that same action (NCCL needs every member of a communicator
// to issue its collectives in one order). Throws std::invalid_argument naming
// the pipeline's coordinate and the pair, or the blocked global ranks and, for
// a collective, where each member of the group is.
void validateMeshChannels(const std::vector<Schedule>& pipelines, const MeshShape& mesh,
                          bool forwardOnly = false);

// One line per rank and peer: "rank 0 -> 1: 0SEND_F0 0SEND_F1 0RECV_B0 ...";
// the two lines of a pair mirror each other position by position.
std::string channelsToText(const Schedule& ordered);

}  // namespace pipedream
