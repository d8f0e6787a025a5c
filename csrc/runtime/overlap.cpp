#include "runtime/overlap.h"

#include <c10/util/Exception.h>

#include <atomic>

namespace pipedream {

namespace {

std::atomic<OverlapTurn*> activeTurn{nullptr};

const char* roleName(OverlapTurn::Role role) {
  return role == OverlapTurn::Role::kForward ? "forward" : "backward";
}

OverlapTurn::Role other(OverlapTurn::Role role) {
  return role == OverlapTurn::Role::kForward ? OverlapTurn::Role::kBackward
                                             : OverlapTurn::Role::kForward;
}

}  // namespace

OverlapTurn::OverlapTurn(std::chrono::milliseconds timeout)
    : timeout_(timeout), heldSince_(Clock::now()) {}

void OverlapTurn::waitLocked(std::unique_lock<std::mutex>& lock, Role role) {
  const bool mine = changed_.wait_for(lock, timeout_, [&] { return holder_ == role; });
  TORCH_CHECK(mine, "the ", roleName(role), " of an F&B pair waited ", timeout_.count() / 1000.0,
              " s for the ", roleName(other(role)),
              " to yield or finish; it is stuck (a peer of one of its collectives is not answering)");
}

void OverlapTurn::closeSegmentLocked(Clock::time_point now) {
  segments_.push_back(Segment{holder_, heldSince_, now});
  heldSince_ = now;
}

void OverlapTurn::waitFor(Role role) {
  std::unique_lock<std::mutex> lock(mutex_);
  waitLocked(lock, role);
}

bool OverlapTurn::yieldTurn(Role role) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (holder_ != role || finished_[static_cast<int>(other(role))]) return false;
  closeSegmentLocked(Clock::now());
  holder_ = other(role);
  ++yields_;
  changed_.notify_all();
  waitLocked(lock, role);
  return true;
}

void OverlapTurn::finish(Role role) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (finished_[static_cast<int>(role)]) return;
  finished_[static_cast<int>(role)] = true;
  if (holder_ == role) {
    closeSegmentLocked(Clock::now());
    holder_ = other(role);
  }
  changed_.notify_all();
}

std::vector<OverlapTurn::Segment> OverlapTurn::segments() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return segments_;
}

int OverlapTurn::yields() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return yields_;
}

OverlapTurn* OverlapTurn::active() { return activeTurn.load(); }

void OverlapTurn::setActive(OverlapTurn* turn) { activeTurn.store(turn); }

bool overlapYield(OverlapTurn::Role direction) {
  OverlapTurn* turn = OverlapTurn::active();
  return turn != nullptr && turn->yieldTurn(direction);
}

}  // namespace pipedream
