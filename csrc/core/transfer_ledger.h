// Which transfers an executor posts and releases when: the bookkeeping of
// csrc/runtime/executor.cpp, apart from the Transfer handles it holds, on
// opaque ids (the executor uses absolute positions in its action list).
//
// Receive window. Gloo moves a message only once both ends posted it, so a
// receive's data buffers are best posted early; posting all of a step's
// would hold O(M) buffers. The first `receiveWindow` receives of a range get
// theirs at once; each consumed receive lets the next waiting one post.
//
// Send release. A send's buffer lives until it is released (waited for);
// Gloo reports a send complete only when waited for, and a blind wait could
// block on a peer that waits too. A send is released by the first of:
//   * a receipt point (flush executors): the compute action at a position
//     that csrc/core/receipt.h proves comes after the send arrived;
//   * its gradient: a SEND_F of (stage, microbatch) once the gradient of that
//     microbatch arrives (the peer consumed the activation by then);
//   * the bound (streaming executors): at most `maxSendsInFlight` are kept,
//     the oldest released first (their peers are steps further);
//   * the end of the step / stream (releaseAll).
// Every release call returns only ids still in flight and forgets them, so
// releasing twice is harmless.
//
// Threading: not synchronised; every member is owned by the one thread that
// runs the executor holding the ledger.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

namespace pipedream {

class TransferLedger {
 public:
  using Id = int64_t;

  // Flush executor of `numRanks` ranks: receiptPoints[k] = positions of the
  // sends released once the compute action at position k has its inputs
  // (sendReleasePoints() of receipt.h); no bound on sends in flight.
  static TransferLedger forFlush(int numRanks, std::vector<std::vector<int>> receiptPoints);
  // Streaming executor: no receipt points; at most 4 * numRanks + 16 sends.
  static TransferLedger forStreaming(int numRanks);

  size_t receiveWindow() const { return receiveWindow_; }
  size_t maxSendsInFlight() const { return maxSendsInFlight_; }  // 0: unbounded

  // ---- receives ----
  // Starts a range: forgets receives still waiting to post.
  void beginReceives();
  // Registers the range's next receive in list order; true: post its data
  // buffers now, false: it waits for a consumed receive.
  bool admitReceive(Id id);
  // A receive was consumed: the waiting receive to post now, if any.
  std::optional<Id> onReceiveConsumed();
  size_t waitingReceives() const { return waiting_.size(); }

  // ---- sends ----
  // A send was issued (ids ascend in issue order). `forwardKey`: the
  // (stage, microbatch) of a SEND_F that its gradient may release.
  void sendIssued(Id id, std::optional<std::pair<int, int>> forwardKey = std::nullopt);
  // Sends released by the receipt point at `position` (ascending).
  std::vector<Id> releaseAtReceiptPoint(size_t position);
  bool isReceiptPoint(size_t position) const {
    return position < receiptPoints_.size() && !receiptPoints_[position].empty();
  }
  // The SEND_F of (stage, microbatch), once its gradient arrived.
  std::optional<Id> releaseByGradient(int stage, int microbatch);
  // The oldest sends beyond the bound (none when unbounded), oldest first.
  std::vector<Id> releaseBeyondBound();
  // Every send in flight, oldest first.
  std::vector<Id> releaseAll();
  size_t sendsInFlight() const { return inFlight_.size(); }

  // Forgets every receive and send (a new step).
  void clear();

 private:
  TransferLedger(size_t receiveWindow, size_t maxSendsInFlight,
                 std::vector<std::vector<int>> receiptPoints);
  void forget(Id id);

  size_t receiveWindow_;
  size_t maxSendsInFlight_;
  std::vector<std::vector<int>> receiptPoints_;
  size_t admitted_ = 0;        // receives admitted since beginReceives()
  std::deque<Id> waiting_;     // admitted receives not yet told to post, in order
  std::set<Id> inFlight_;      // sends not released, ascending = issue order
  std::map<std::pair<int, int>, Id> forwardSends_;  // (stage, microbatch) -> SEND_F id
  std::map<Id, std::pair<int, int>> forwardKeyOf_;
};

}  // namespace pipedream
