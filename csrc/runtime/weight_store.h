// Weight versions of one stage, for weight stashing (asynchronous schedules).
//
// The live parameters (the tensors the user's optimizer updates in place)
// always hold the newest version. A forward that reads version v runs on a
// *snapshot* of v: leaf tensors that require grad, made once per version.
// The backward of the same minibatch differentiates with respect to that
// snapshot, so autograd never sees an in-place update, and its gradients are
// then added to the live parameters' .grad for the next optimizer step. A
// snapshot is freed as soon as no in-flight minibatch reads it and no future
// forward will (the executor tells the store the oldest version a future
// forward of this rank reads).
//
// Copy on update: the snapshot of the live version starts as an *alias*
// (new tensors, with their own autograd version counters, on the live
// parameters' storage): no copy. Only when the optimizer is about to update
// a version that is still needed do the live parameters move to a fresh copy
// (set_data), leaving the old storage to the snapshot; a version nobody
// needs any more is updated in place. So the last stage (F and B back to
// back) never copies, and other stages copy once per needed version.
//
//   version:   0        1        2          live params
//   stage 0:   [F0 F1 F2 F3]..B0 U1 [F4] B1 U2 [F5] ...   (p = 4)
//              snapshot 0 held by F0..F3 until B3
//
// Threading: owned by the executor thread.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <vector>

namespace pipedream {

class WeightStore {
 public:
  WeightStore() = default;
  explicit WeightStore(std::vector<at::Tensor> live);

  // Snapshot tensors of `version` (creating them from the live parameters
  // if `version` is the current one); one more in-flight reader.
  const std::vector<at::Tensor>& acquire(int version);
  // Adds the gradients held by `version`'s snapshot to the live .grad
  // (allocating it if needed) and clears the snapshot's gradients.
  void moveGradsToLive(int version);
  // One reader fewer; frees the snapshot once nobody needs it.
  void release(int version);
  // Call before the optimizer overwrites the live parameters. Future
  // forwards read versions >= `oldestFutureRead`; if that includes the
  // current version, it is snapshotted now (vertical sync reads old ones).
  void beforeUpdate(int oldestFutureRead);
  // The optimizer has produced `version` (= current + 1) in the live
  // parameters; snapshots older than `oldestFutureRead` without readers go.
  void afterUpdate(int version, int oldestFutureRead);

  int currentVersion() const { return current_; }
  // Distinct versions held: snapshots plus the live one.
  int liveVersions() const;
  int peakLiveVersions() const { return peak_; }
  void resetPeak() { peak_ = liveVersions(); }
  const std::vector<at::Tensor>& live() const { return live_; }

 private:
  struct Snapshot {
    std::vector<at::Tensor> tensors;
    int readers = 0;
    bool aliasesLive = false;  // shares the live parameters' storage
  };
  void collect();

  std::vector<at::Tensor> live_;  // the optimizer's parameters (never replaced)
  std::map<int, Snapshot> snapshots_;
  int current_ = 0;
  int oldestFutureRead_ = 0;
  int peak_ = 1;

 public:
  // Bytes copied for snapshots so far (benchmarks, tests).
  int64_t bytesCopied() const { return bytesCopied_; }
  void resetBytesCopied() { bytesCopied_ = 0; }

 private:
  int64_t bytesCopied_ = 0;
};

}  // namespace pipedream
