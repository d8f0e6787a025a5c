// Point-to-point transfers of activations and gradients between pipeline
// stages, on top of a c10d ProcessGroup (Gloo on CPU, NCCL on GPU).
//
// Wire format of one transfer of n tensors to a peer under tag T:
//   message T*32 + 0     : header, int64[kHeaderWords]:
//                          [magic, n | flags, (dtype, ndim, d0 .. d7) x n]
//   message T*32 + k     : tensor k-1 (contiguous, k = 1..n)
//   message T*32 + 16 + k: tensor k-1 when redirected (see below)
// No pickle: the receiver allocates from the header and receives in place.
//
// Pre-posted receives (shape prediction, enabled per engine): a slot is a
// (peer, tag) pair. Both ends remember the shapes of the slot's last
// transfer (the sender what it sent, the receiver what it received: the same
// transfer, so the same shapes). A receive on a slot seen before posts its
// data buffers with those shapes at once, together with the header, so the
// data lands while this rank computes instead of after it asks (Gloo moves a
// message only once both ends have posted). The sender knows what was
// pre-posted: if its shapes are the same it sends as usual; if not it sets
// kRedirected in the header, sends zeros of the predicted shapes to fill the
// pre-posted buffers and the real tensors under parts 16 + k, which the
// receiver posts when the header arrives. The prediction is a guess, not a
// rule: any dimension (and the count and dtypes) may differ from one transfer
// to the next; what a stage accepts is the executor's to check. Flush
// schedules repeat their tags every step, so from the second step on every
// receive is pre-posted and only the first step after a change redirects.
// Requirement: a slot's transfers complete in order at the receiver before
// its next receive is posted (true for run()/runForward(); streaming
// executors, whose tags do not repeat, leave prediction off).
//
// Handles follow c10d::Work: wait(timeout), isCompleted(), exception().
// Every wait has a deadline; a peer that dies or never sends makes wait()
// throw a c10::Error naming this rank, the peer, and the action (e.g.
// "RECV_F of microbatch 3 for stage 2").
//
// Devices: tensors live on `device`. When the group's backend for that
// device is NCCL (a "nccl" or "cpu:gloo,cuda:nccl" group), headers and data
// go device to device: c10d's NCCL group orders its stream after the compute
// stream when a send or receive is posted, keeps the tensors of a transfer
// until it is waited for (as the Transfer does), and makes the compute stream
// wait in wait(), so a consumer's kernels see the received data and a sent
// tensor is neither freed nor overwritten before NCCL read it. With Gloo and
// a CUDA device, data is staged through pinned host memory (synchronous
// copies). On CPU nothing is copied.
//
// Threading: a CommEngine and its transfers are used from one thread (the
// executor's); the process group does the actual I/O on its own threads.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <map>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace pipedream {

constexpr int kMaxTensorsPerTransfer = 8;
constexpr int kMaxDims = 8;
constexpr int64_t kHeaderMagic = 0x50495045;  // "PIPE"
constexpr int kHeaderWords = 2 + kMaxTensorsPerTransfer * (2 + kMaxDims);
// Message parts per transfer tag: header, data, redirected data.
constexpr int kPartsPerTag = 32;
constexpr int kRedirectedPart = 16;
constexpr int64_t kRedirectedFlag = int64_t{1} << 16;  // in header word 1

struct TensorMeta {
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  bool operator==(const TensorMeta& other) const {
    return dtype == other.dtype && shape == other.shape;
  }
  std::string toString() const;  // "Float[4, 16]"
};

// An in-flight send or receive. Owned by the thread that created it.
class Transfer {
 public:
  virtual ~Transfer() = default;
  // Blocks until done or `timeout` passes. Returns true when done; throws
  // c10::Error (with peer and action) on failure or timeout.
  virtual bool wait(std::chrono::milliseconds timeout) = 0;
  // Non-blocking: whether every message of the transfer completed.
  virtual bool isCompleted() = 0;
  // The failure, if one was observed (nullptr otherwise).
  virtual std::exception_ptr exception() const = 0;
  // Non-blocking progress: a receive whose header has arrived posts its data
  // receives now, so the data flows while this thread computes (Gloo sends
  // only once the receiver has posted). A no-op for sends.
  virtual void poll() {}
  // A receive with predicted shapes that was created lazy (see recv()): posts
  // its data buffers now. A no-op otherwise (sends, already posted).
  virtual void post() {}
  // Received tensors (receives only; valid after wait() returned true).
  virtual const std::vector<at::Tensor>& tensors() const = 0;
  virtual const std::string& description() const = 0;
};

class CommEngine {
 public:
  CommEngine(c10::intrusive_ptr<c10d::ProcessGroup> group, std::chrono::milliseconds timeout,
             at::Device device = at::kCPU);

  // Starts sending `tensors` (made contiguous, on their device) to `peer`.
  std::shared_ptr<Transfer> send(const std::vector<at::Tensor>& tensors, int peer, int tag,
                                 const std::string& description);
  // Posts the header receive now, and the data receives too when the slot's
  // shapes are predicted and `eager` (otherwise when post() is called or the
  // header arrives: poll() or wait(), whichever comes first). A lazy receive
  // is still committed to the predicted shapes (the sender relies on it);
  // laziness only bounds how many buffers exist at once.
  std::shared_ptr<Transfer> recv(int peer, int tag, const std::string& description,
                                 bool eager = true);

  // Turns pre-posted receives on or off (see the file comment). Both ends of
  // every slot must agree; call it before the first transfer.
  void setShapePrediction(bool enabled) { predictShapes_ = enabled; }
  bool shapePrediction() const { return predictShapes_; }

  int rank() const { return rank_; }
  int worldSize() const { return worldSize_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  // Payload and header bytes this engine has sent (for benchmarks).
  int64_t bytesSent() const { return bytesSent_; }
  int64_t bytesReceived() const { return bytesReceived_; }
  void addBytesReceived(int64_t bytes) { bytesReceived_ += bytes; }
  // Receives posted with their data buffers (predicted) / sends that had to
  // redirect because their shapes changed; all receives / sends.
  int64_t prePostedReceives() const { return prePostedReceives_; }
  int64_t redirectedSends() const { return redirectedSends_; }
  int64_t receives() const { return receives_; }
  int64_t sends() const { return sends_; }
  // Zeroes the byte and transfer counters above (stats start over).
  void resetCounters() {
    bytesSent_ = bytesReceived_ = 0;
    prePostedReceives_ = redirectedSends_ = receives_ = sends_ = 0;
  }

  c10d::ProcessGroup& group() { return *group_; }
  const at::Device& device() const { return device_; }
  // Where headers and received data land before they reach `device()`.
  at::TensorOptions wireOptions(at::ScalarType dtype) const;
  // Moves a received buffer to `device()` (a no-op unless staged).
  at::Tensor fromWire(const at::Tensor& buffer) const;

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;  // immutable after construction
  std::chrono::milliseconds timeout_;
  at::Device device_;
  bool stageThroughHost_;  // CUDA tensors over a CPU-only backend (Gloo)
  int rank_;
  int worldSize_;
  int64_t bytesSent_ = 0;      // executor thread only
  int64_t bytesReceived_ = 0;  // executor thread only
  bool predictShapes_ = false;  // executor thread only
  int64_t prePostedReceives_ = 0, redirectedSends_ = 0, receives_ = 0, sends_ = 0;  // executor thread

 public:
  // Slot memory for pre-posted receives, keyed by (peer, tag). Executor
  // thread only; used by the transfers this engine creates.
  using Slot = std::pair<int, int>;
  std::map<Slot, std::vector<TensorMeta>> sentShapes_;
  std::map<Slot, std::vector<TensorMeta>> receivedShapes_;
};

// Encodes / decodes the fixed header (exposed for tests).
at::Tensor encodeHeader(const std::vector<TensorMeta>& metas, bool redirected = false);
std::vector<TensorMeta> decodeHeader(const at::Tensor& header, const std::string& description,
                                     bool* redirected = nullptr);
std::vector<TensorMeta> metasOf(const std::vector<at::Tensor>& tensors);

}  // namespace pipedream
