// A CPU process-group backend that keeps NCCL's point-to-point rules, so that
// code which would hang or read wrong bytes on NCCL fails on any machine, in
// seconds, with a clear error. One GPU cannot host two NCCL ranks; this is how
// several "NCCL" ranks run in CI (tests/test_nccl_rules.py).
//
// What it imitates (ProcessGroupNCCL's point-to-point behaviour):
//   * no tags: the tag of send/recv is ignored, so the k-th send from rank a
//     to rank b meets the k-th receive at b from a;
//   * one stream per pair of ranks: each end runs its operations with a peer
//     one at a time, in the order it issued them; a receive at the head holds
//     everything behind it until its data arrives, a send until the peer has
//     posted its receive (the data moves only then);
//   * the two ends of a matched pair must agree on size and dtype (NCCL reads
//     or writes wrong bytes, or hangs, when they do not);
//   * startCoalescing()/endCoalescing() (batch_isend_irecv): the group's
//     operations with one peer start together, as one queue item, so a send
//     and a receive that cross can both progress.
// What it does not: the real transport (data moves over an inner Gloo group on
// the CPU, two messages per operation: a 32-byte header checked before the data
// is posted, then the data), CUDA streams and events, NCCL's group semantics
// across several peers (each peer's part of a group starts when it reaches
// the head of that peer's queue), and its asynchronous error handling.
// Collectives (all-reduce, broadcast, barrier, ...) are delegated to the inner
// Gloo group unchanged.
//
// Errors: a size or dtype mismatch fails the receive with both sides' values
// (the data is drained, so no abort); an operation that does not complete
// within the wait's timeout (or the backend's) raises naming the operation, its
// position among this rank's operations with the peer, and the operation at
// the head of the pair's queue: a crossed order shows up as a timeout that
// says which operation blocks it.
//
// Threading: one worker thread per peer runs that peer's queue; the caller's
// thread only enqueues (under the peer's mutex) and waits on works.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace pipedream {

class NcclRulesWork;

class NcclRulesBackend : public c10d::Backend {
 public:
  // `gloo`: a Gloo backend over the same ranks (carries the data and every
  // collective); `timeout`: how long a worker waits on one Gloo message.
  NcclRulesBackend(c10::intrusive_ptr<c10d::Backend> gloo, int rank, int size,
                   std::chrono::milliseconds timeout);
  ~NcclRulesBackend() override;

  const std::string getBackendName() const override { return "nccl_rules"; }
  bool supportsCoalescing() const override { return true; }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  // Collectives: the inner Gloo group's.
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplits,
                                               std::vector<int64_t>& inputSplits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override;
  void setSequenceNumberForGroup() override;
  uint64_t getSequenceNumberForGroup() override;

 private:
  struct Op {
    bool send = false;
    at::Tensor tensor;
    int64_t index = 0;  // k: this end's operation number with the peer (0-based)
    c10::intrusive_ptr<NcclRulesWork> work;
  };
  // One queue entry: a single operation, or a coalesced group's operations with this peer.
  using Item = std::vector<Op>;
  struct Peer {
    std::mutex mutex;                  // guards everything below but `worker`
    std::condition_variable cv;
    std::deque<Item> queue;            // not yet started
    std::string head;                  // the item running now ("" when idle)
    int64_t issued = 0;                // operations issued with this peer
    std::vector<c10::intrusive_ptr<c10d::Work>> inFlight;  // Gloo works of the running item
    bool stop = false;
    std::thread worker;                // created in the constructor, joined in the destructor
  };

  c10::intrusive_ptr<c10d::Work> enqueue(bool send, at::Tensor tensor, int peer);
  void runPeer(int peer);
  void runItem(int peer, Item& item);
  // Stops every started worker and joins it (the destructor; a constructor that throws).
  void stopWorkers();
  std::string describe(const Op& op, int peer) const;

  c10::intrusive_ptr<c10d::Backend> gloo_;  // immutable after construction
  std::chrono::milliseconds timeout_;
  // By rank; filled before the first worker starts (a worker reads it: a push_back that
  // reallocated would free the buffer under it), then immutable.
  std::vector<std::shared_ptr<Peer>> peers_;
  // Coalescing state: the caller's thread only.
  bool coalescing_ = false;
  std::vector<std::pair<int, Item>> coalesced_;
};

// Completion of one operation (or of a coalesced group: `parts` > 1).
class NcclRulesWork : public c10d::Work {
 public:
  // `blocker(description)` says what the pair's queue is busy with (for timeouts).
  NcclRulesWork(int rank, c10d::OpType type, std::string description,
                std::function<std::string(const std::string&)> blocker, int parts = 1);
  bool wait(std::chrono::milliseconds timeout) override;
  bool isCompleted() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  // A part finished (with its error, if any); completes the work after all parts.
  void partDone(std::exception_ptr error = nullptr);
  const std::string& description() const { return description_; }

 private:
  std::string description_;
  std::function<std::string(const std::string&)> blocker_;  // immutable; thread-safe (takes the peer's mutex)
  int pending_;          // under mutex_
  std::exception_ptr firstError_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace pipedream
