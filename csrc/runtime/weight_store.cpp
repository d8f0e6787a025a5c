#include "runtime/weight_store.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

namespace pipedream {

WeightStore::WeightStore(std::vector<at::Tensor> live) : live_(std::move(live)) {}

const std::vector<at::Tensor>& WeightStore::acquire(int version) {
  auto it = snapshots_.find(version);
  if (it == snapshots_.end()) {
    TORCH_CHECK(version == current_, "weight version ", version,
                " was requested but only the live version ", current_,
                " can be snapshotted now (older versions must be retained)");
    Snapshot snapshot;
    snapshot.aliasesLive = true;
    for (const auto& p : live_) {
      // A new tensor on the same storage: autograd tracks it on its own
      // (its version counter is not the live parameter's).
      at::Tensor alias = at::empty({0}, p.options());
      alias.set_(p.storage(), p.storage_offset(), p.sizes(), p.strides());
      snapshot.tensors.push_back(alias.requires_grad_(p.requires_grad()));
    }
    it = snapshots_.emplace(version, std::move(snapshot)).first;
  }
  ++it->second.readers;
  peak_ = std::max(peak_, liveVersions());
  return it->second.tensors;
}

void WeightStore::moveGradsToLive(int version) {
  auto it = snapshots_.find(version);
  TORCH_CHECK(it != snapshots_.end(), "no snapshot of weight version ", version);
  auto& tensors = it->second.tensors;
  for (size_t k = 0; k < tensors.size(); ++k) {
    at::Tensor grad = tensors[k].grad();
    if (!grad.defined()) continue;
    at::Tensor& liveGrad = live_[k].mutable_grad();
    if (liveGrad.defined()) {
      liveGrad.add_(grad);
    } else {
      liveGrad = grad.detach();  // take the tensor over: the snapshot lets go of it below
    }
    tensors[k].mutable_grad() = at::Tensor();
  }
}

void WeightStore::release(int version) {
  auto it = snapshots_.find(version);
  TORCH_CHECK(it != snapshots_.end() && it->second.readers > 0,
              "release of weight version ", version, " that has no reader");
  --it->second.readers;
  collect();
}

void WeightStore::beforeUpdate(int oldestFutureRead) {
  oldestFutureRead_ = oldestFutureRead;
  const bool neededLater = oldestFutureRead_ <= current_;  // e.g. vertical sync
  auto it = snapshots_.find(current_);
  if (it == snapshots_.end()) {
    if (!neededLater) return;  // nobody reads this version again: update in place
    acquire(current_);
    it = snapshots_.find(current_);
    --it->second.readers;
  }
  if (!it->second.aliasesLive) return;
  if (it->second.readers == 0 && !neededLater) {
    snapshots_.erase(it);  // its readers are done: update in place, no copy
    return;
  }
  // Still needed: the live parameters move to a copy, the snapshot keeps the
  // storage its readers' autograd graphs saved.
  at::NoGradGuard noGrad;
  for (auto& p : live_) {
    at::Tensor copy = p.detach().clone();
    bytesCopied_ += copy.numel() * copy.element_size();
    p.set_data(copy);
  }
  it->second.aliasesLive = false;
}

void WeightStore::afterUpdate(int version, int oldestFutureRead) {
  TORCH_CHECK(version == current_ + 1, "weight version ", version, " follows version ", current_,
              "; updates must number 1, 2, 3, ...");
  current_ = version;
  oldestFutureRead_ = oldestFutureRead;
  collect();
  peak_ = std::max(peak_, liveVersions());
}

void WeightStore::collect() {
  for (auto it = snapshots_.begin(); it != snapshots_.end();) {
    const bool unneeded = it->second.readers == 0 && it->first < current_ &&
                          it->first < oldestFutureRead_;
    it = unneeded ? snapshots_.erase(it) : std::next(it);
  }
}

int WeightStore::liveVersions() const {
  int count = 1;  // the live parameters
  for (const auto& [version, snapshot] : snapshots_) {
    if (version != current_) ++count;
  }
  return count;
}

}  // namespace pipedream
