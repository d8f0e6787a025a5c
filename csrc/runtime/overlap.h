// The turn of an F&B pair (csrc/core/pairs.h): its forward and its backward
// run on two threads that take turns, exactly one running at a time.
//
// Why turns and not free threads: every rank of a collective's group must
// issue the group's collectives in one order. Two free threads would issue
// the forward's and the backward's all_to_all (or FSDP's, or tensor
// parallelism's) in an order that differs from rank to rank. With turns the
// order is the program's: the forward runs until it has issued an
// asynchronous collective and calls overlapYield(kForward); the backward then
// runs until it does the same; the forward takes the turn back and waits for
// its collective, which travelled meanwhile (Gloo moves it on its own
// threads, NCCL on its stream). Code that never yields runs the forward
// whole, then the backward: the plain order.
//
//   forward  thread: [attention, router, issue dispatch]          [wait, experts, issue combine] ...
//   backward thread:                  [grad of later layers, issue a2a]                  [wait, ...]
//
// Contract: the forward holds the turn first. waitFor(role) blocks until the
// role holds it; yieldTurn(role) passes it to the other role (unless that
// one has finished) and blocks until it comes back; finish(role) gives it
// away for good. A yield by a role not holding the turn does nothing (a
// forward recomputed inside the backward, torch.utils.checkpoint). Every wait
// fails after `timeout` (the other half stuck on a peer).
//
// Threading: the members below are owned by mutex_; active() is the one pair
// running in this process (set by the executor while it runs one).
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <vector>

namespace pipedream {

class OverlapTurn {
 public:
  enum class Role { kForward = 0, kBackward = 1 };
  using Clock = std::chrono::steady_clock;
  // A stretch of time one role held the turn.
  struct Segment {
    Role role;
    Clock::time_point start, end;
  };

  explicit OverlapTurn(std::chrono::milliseconds timeout);

  void waitFor(Role role);
  // Returns whether the turn was passed (false: not this role's, or the other finished).
  bool yieldTurn(Role role);
  void finish(Role role);

  // Every stretch each role held the turn, in order (call after both finished).
  std::vector<Segment> segments() const;
  int yields() const;

  // The pair running in this process, if any (the executor sets it around a pair).
  static OverlapTurn* active();
  static void setActive(OverlapTurn* turn);

 private:
  void waitLocked(std::unique_lock<std::mutex>& lock, Role role);
  void closeSegmentLocked(Clock::time_point now);

  const std::chrono::milliseconds timeout_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  Role holder_ = Role::kForward;          // mutex_
  bool finished_[2] = {false, false};     // mutex_
  Clock::time_point heldSince_;           // mutex_
  std::vector<Segment> segments_;         // mutex_
  int yields_ = 0;                        // mutex_
};

// For code inside a pair's forward (direction kForward) or backward
// (kBackward), right after issuing an asynchronous collective and before
// waiting for it: lets the pair's other half run meanwhile. Outside a pair,
// or for the half not holding the turn, returns false at once.
bool overlapYield(OverlapTurn::Role direction);

}  // namespace pipedream
