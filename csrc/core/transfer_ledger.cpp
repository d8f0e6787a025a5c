#include "transfer_ledger.h"

namespace pipedream {

TransferLedger::TransferLedger(size_t maxSendsInFlight, std::vector<std::vector<int>> receiptPoints)
    : maxSendsInFlight_(maxSendsInFlight),
      receiptPoints_(std::move(receiptPoints)) {}

TransferLedger TransferLedger::forFlush(std::vector<std::vector<int>> receiptPoints) {
  return TransferLedger(0, std::move(receiptPoints));
}

TransferLedger TransferLedger::forStreaming(int numRanks) {
  // The oldest of this many sends have long been received (their peers are
  // steps further), so waiting for them costs nothing.
  return TransferLedger(4 * static_cast<size_t>(numRanks) + 16, {});
}

void TransferLedger::sendIssued(Id id, std::optional<std::pair<int, int>> forwardKey) {
  inFlight_.insert(id);
  if (forwardKey) {
    forwardSends_[*forwardKey] = id;
    forwardKeyOf_[id] = *forwardKey;
  }
}

void TransferLedger::forget(Id id) {
  inFlight_.erase(id);
  auto key = forwardKeyOf_.find(id);
  if (key == forwardKeyOf_.end()) return;
  auto send = forwardSends_.find(key->second);
  if (send != forwardSends_.end() && send->second == id) forwardSends_.erase(send);
  forwardKeyOf_.erase(key);
}

std::vector<TransferLedger::Id> TransferLedger::releaseAtReceiptPoint(size_t position) {
  std::vector<Id> released;
  if (position >= receiptPoints_.size()) return released;
  for (int send : receiptPoints_[position]) {
    if (!inFlight_.count(send)) continue;  // not sent in this run (forward-only) or released
    forget(send);
    released.push_back(send);
  }
  return released;
}

std::optional<TransferLedger::Id> TransferLedger::releaseByGradient(int stage, int microbatch) {
  auto it = forwardSends_.find({stage, microbatch});
  if (it == forwardSends_.end()) return std::nullopt;
  const Id id = it->second;
  forget(id);
  return id;
}

std::vector<TransferLedger::Id> TransferLedger::releaseBeyondBound() {
  std::vector<Id> released;
  if (maxSendsInFlight_ == 0) return released;
  while (inFlight_.size() > maxSendsInFlight_) {
    const Id oldest = *inFlight_.begin();
    forget(oldest);
    released.push_back(oldest);
  }
  return released;
}

std::vector<TransferLedger::Id> TransferLedger::releaseAll() {
  std::vector<Id> released(inFlight_.begin(), inFlight_.end());
  inFlight_.clear();
  forwardSends_.clear();
  forwardKeyOf_.clear();
  return released;
}

void TransferLedger::clear() { releaseAll(); }

}  // namespace pipedream
