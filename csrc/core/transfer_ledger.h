// Which sends an executor releases when: the bookkeeping of
// csrc/runtime/executor.cpp, apart from the Transfer handles it holds, on
// opaque ids (the executor uses absolute positions in its action list).
// (Receives need none: a RECV action posts its receive where orderTransfers()
// put it, csrc/core/channels.h.)
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
  static TransferLedger forFlush(std::vector<std::vector<int>> receiptPoints);
  // Streaming executor: no receipt points; at most 4 * numRanks + 16 sends.
  static TransferLedger forStreaming(int numRanks);

  size_t maxSendsInFlight() const { return maxSendsInFlight_; }  // 0: unbounded

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

  // Forgets every send (a new step).
  void clear();

 private:
  TransferLedger(size_t maxSendsInFlight, std::vector<std::vector<int>> receiptPoints);
  void forget(Id id);

  size_t maxSendsInFlight_;
  std::vector<std::vector<int>> receiptPoints_;
  std::set<Id> inFlight_;      // sends not released, ascending = issue order
  std::map<std::pair<int, int>, Id> forwardSends_;  // (stage, microbatch) -> SEND_F id
  std::map<Id, std::pair<int, int>> forwardKeyOf_;
};

}  // namespace pipedream
