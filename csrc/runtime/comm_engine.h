// Point-to-point transfers of activations and gradients between pipeline
// stages over c10d, correct under NCCL's rules on every backend.
//
// The rules (csrc/core/channels.h): no tags, so the k-th send from rank a to
// rank b meets the k-th receive at b from a with the same size and dtype; one
// in-order stream per pair of ranks. The executor issues each pair's transfers
// in the order orderTransfers() gave both ends (a RECV action posts, the
// consumer waits), and this engine keeps that order on the wire: every transfer
// is a fixed number of data-channel operations whose sizes both ends know before
// either issues them. Nothing is matched by tag (every message uses tag 0).
//
// Two channels per engine:
//   data  the pipeline's group: Gloo on CPU, NCCL on GPU (or any backend);
//   side  a Gloo group over the same ranks that PipeDream creates, for what
//         the data channel cannot carry: metadata that the host must read
//         without touching the GPU, and payloads whose size the receiver could
//         not know in advance. It is only ever used in one direction per
//         message kind and in each pair's order, so Gloo's per-direction FIFO
//         is all it relies on.
//
// Two protocols (chosen per engine; both ends of a pair always agree, since
// every rank builds the same pipeline):
//
// kFused (flush schedules on host memory: Gloo, or Gloo carrying CUDA tensors
// through pinned buffers): a transfer is ONE data-channel message, a packed
// buffer [header | tensor 0 | tensor 1 | ...] (64-byte aligned; the header
// names the transfer and every tensor's dtype and shape). Its size is the
// slot's capacity, which both ends derive from the slot's history (a slot is a
// transfer key: flush schedules repeat them every step, and every receive of a
// step is waited for before the next step posts): the first transfer of a slot
// has 64 bytes, a slot grows to what a transfer needs and shrinks when one
// needs less than a quarter. A transfer that fits is sent in place (smaller
// shapes are padded); one that does not sends a header-only message flagged
// "redirected" with its real size, and the packed message follows on the side
// channel; both ends then take the new capacity. Receives are posted (their
// buffers) at the RECV action, so data lands while the receiver computes. The
// receiver reads headers in each pair's order, so redirected payloads are
// posted on the side channel in the order they were sent.
//
// kSplit (NCCL data channels, and the asynchronous streams on every backend,
// whose slots do not repeat in step with their receives): the sender writes a
// fixed 704-byte metadata message on the side channel (CPU) and then the
// tensors themselves on the data channel, one operation per non-empty tensor
// (no copy, no header). The receiver posts the metadata receive at the RECV
// action; a reader thread per peer waits for them in order and, as each
// arrives, issues the data receive (exact shapes) and what queued behind it. A
// pair's later operations queue behind a receive whose metadata has not
// arrived, so the data channel always sees the agreed order, and the queue
// drains without the executor's thread: a rank may leave a step with a send
// queued behind such a receive and block in a collective of the user's loop
// while its peer needs that send to finish its own step. The receive path never reads GPU memory from the host: no host
// synchronisation per transfer.
//
// Handles follow c10d::Work: wait(timeout), isCompleted(), exception(). Every
// wait has a deadline; a peer that dies or never sends makes wait() throw a
// c10::Error naming this rank, the peer and the action. A transfer announcing
// another key than the one expected (two ranks running different schedules)
// fails naming both.
//
// Devices: tensors live on `device`. NCCL: device to device (c10d orders its
// stream after the compute stream and makes the compute stream wait in wait());
// Gloo with CUDA tensors: packed on the host in pinned memory (the send copies
// synchronously, the receive copies to the device without blocking).
//
// Threading: an engine and its transfers are used from one thread (the
// executor's), except the split protocol's reader threads, which wait for
// metadata receives, publish them and issue the pair's ready data operations,
// all under `mutex_` (on a CUDA device on the executor's stream at the time the
// operation was queued).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "core/channels.h"

namespace pipedream {

constexpr int kMaxTensorsPerTransfer = 8;
constexpr int kMaxDims = 8;
constexpr int64_t kHeaderMagic = 0x50495045;  // "PIPE"
constexpr int64_t kWireAlignment = 64;        // header and every tensor start here
constexpr int64_t kMinCapacity = 64;          // a slot's first message: a header alone
// The split protocol's metadata message: the header of the largest transfer.
constexpr int64_t kMetadataBytes = 704;

enum class P2PProtocol { kFused, kSplit };
const char* protocolName(P2PProtocol protocol);  // "fused", "split"
P2PProtocol parseProtocol(const std::string& name);

struct TensorMeta {
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  bool operator==(const TensorMeta& other) const {
    return dtype == other.dtype && shape == other.shape;
  }
  int64_t bytes() const;
  std::string toString() const;  // "Float[4, 16]"
};
std::vector<TensorMeta> metasOf(const std::vector<at::Tensor>& tensors);

// What a header says: which transfer, whether the payload follows on the side
// channel (and its size), and every tensor's dtype and shape.
struct WireHeader {
  TransferKey key;
  bool redirected = false;
  int64_t packedBytes = 0;  // the whole packed message (header + payload)
  std::vector<TensorMeta> metas;
};
// Bytes of a header for `metas` (aligned) and of the packed message.
int64_t headerBytes(const std::vector<TensorMeta>& metas);
int64_t packedBytes(const std::vector<TensorMeta>& metas);
// Writes `header` at `out` (which has at least headerBytes(header.metas) bytes).
void writeHeader(const WireHeader& header, uint8_t* out);
// Reads and checks a header from `available` bytes; errors name `description`.
WireHeader readHeader(const uint8_t* data, int64_t available, const std::string& description);
// The capacity a slot has after a transfer that needed `needed` bytes.
int64_t nextCapacity(int64_t capacity, int64_t needed);

class CommEngine;

// An in-flight send or receive, as c10d::Work is for a collective: this base
// holds what every transfer has (its peer and description, its state, its
// tensors and c10d operations) and the one wait(); each protocol's send and
// receive (comm_engine.cpp: FusedSend, FusedRecv, SplitSend, SplitRecv) adds
// only how its messages go out and complete (finish()).
//
// Threads: a transfer is created, waited for and read on the thread that uses
// its engine (the executor's). The split protocol's issue() may instead run on
// the pair's reader thread, under the engine's mutex_, and writes works_ and
// tensors_ before it publishes issued(); the executor reads them only after.
class Transfer {
 public:
  virtual ~Transfer() = default;
  Transfer(const Transfer&) = delete;
  Transfer& operator=(const Transfer&) = delete;

  // Blocks until done or `timeout` passes. Returns true when done; throws
  // c10::Error (with peer and action) on failure or timeout. Once it has
  // returned, it returns true at once; once it has thrown (or a failure was
  // recorded), it throws that error again.
  bool wait(std::chrono::milliseconds timeout);
  // Non-blocking: whether wait() completed the transfer (without waiting,
  // Gloo reports nothing; a false may be stale).
  bool isCompleted() const { return done_; }
  // The failure wait() threw or will throw; null when none is known.
  std::exception_ptr exception() const { return error_; }
  // Received tensors (receives only; valid after wait() returned true).
  const std::vector<at::Tensor>& tensors() const { return tensors_; }
  const std::string& description() const { return description_; }

 protected:
  Transfer(CommEngine& engine, int peer, std::string description);
  // Completes the transfer by `deadline` (`timeout` is what errors quote) and
  // releases what it no longer needs; throws c10::Error on failure. wait()
  // calls it until it returns once; its error is kept and rethrown.
  virtual void finish(std::chrono::steady_clock::time_point deadline,
                      std::chrono::milliseconds timeout) = 0;
  // Waits for `work` by `deadline`; a failure or timeout throws c10::Error
  // naming this rank, the peer, the transfer and `timeout`.
  void waitWork(const c10::intrusive_ptr<c10d::Work>& work,
                std::chrono::steady_clock::time_point deadline, std::chrono::milliseconds timeout) const;
  // waitWork() for every operation in works_, in order; then clears works_.
  void waitWorks(std::chrono::steady_clock::time_point deadline, std::chrono::milliseconds timeout);
  // Records a failure found before wait() (a fused receive whose header a
  // wait for a later receive of the pair read); wait() throws it.
  void setError(std::exception_ptr error) { error_ = std::move(error); }

  CommEngine& engine_;             // immutable; the engine outlives its transfers
  const int peer_;                 // immutable
  const std::string description_;  // immutable: the action, for error messages
  // Receives: what arrived (see tensors()). Sends: the buffers the posted
  // operations read, kept alive until finish() releases them. Written by the
  // constructor, issue() or finish() (see the class comment for the threads).
  std::vector<at::Tensor> tensors_;
  // The c10d operations finish() waits for (waitWorks()): sends' messages,
  // split receives' data. Written like tensors_.
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;

 private:
  std::exception_ptr error_;  // the executor thread (wait(), setError())
  bool done_ = false;         // the executor thread (wait())
};

class FusedRecv;
class SplitOp;

class CommEngine {
 public:
  // `side`: a Gloo group over the same ranks, never `group` itself when
  // `group` carries `device`'s tensors with Gloo (see the file comment).
  CommEngine(c10::intrusive_ptr<c10d::ProcessGroup> group,
             c10::intrusive_ptr<c10d::ProcessGroup> side, std::chrono::milliseconds timeout,
             at::Device device, P2PProtocol protocol);
  ~CommEngine();
  CommEngine(const CommEngine&) = delete;
  CommEngine& operator=(const CommEngine&) = delete;

  // Starts sending `tensors` (transfer `key`) to `peer`; in the split protocol
  // its data may queue behind a receive of the same pair (the reader issues it).
  std::shared_ptr<Transfer> send(const std::vector<at::Tensor>& tensors, int peer,
                                 const TransferKey& key, const std::string& description);
  // Posts the receive of `key` from `peer`. Never blocks.
  std::shared_ptr<Transfer> recv(int peer, const TransferKey& key, const std::string& description);
  P2PProtocol protocol() const { return protocol_; }
  int rank() const { return rank_; }
  int worldSize() const { return worldSize_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  const at::Device& device() const { return device_; }
  c10d::ProcessGroup& group() { return *group_; }
  c10d::ProcessGroup& side() { return *side_; }

  // Counters since construction or resetCounters() (executor thread only).
  struct Counters {
    int64_t bytesSent = 0;         // tensor bytes
    int64_t bytesReceived = 0;
    int64_t sends = 0;             // transfers
    int64_t receives = 0;
    int64_t messagesSent = 0;      // messages on the wire, data and side channel
    int64_t prePostedReceives = 0; // data receives posted before their consumer waited
    int64_t redirectedSends = 0;   // fused: payload on the side channel (capacity exceeded)
    int64_t paddingBytes = 0;      // fused: capacity beyond what a transfer needed
    int64_t hostSyncs = 0;         // device-to-host copies the engine made (Gloo staging)
  };
  const Counters& counters() const { return counters_; }
  Counters& mutableCounters() { return counters_; }
  void resetCounters() { counters_ = Counters{}; }

  // Where received bytes land before they reach `device()`, and the move there.
  at::TensorOptions hostOptions() const;
  bool staged() const { return stageThroughHost_; }

  // Used by the transfers (executor thread).
  int64_t capacity(int peer, const TransferKey& key, bool sending) const;
  void setCapacity(int peer, const TransferKey& key, bool sending, int64_t capacity);

 private:
  friend class FusedRecv;
  friend class SplitRecv;
  friend class SplitSend;
  friend class SplitOp;
  class PeerQueue;

  PeerQueue& peerQueue(int peer);
  // Split: issues `queue`'s operations from the front while they may go. The
  // caller holds mutex_.
  void issueReadyLocked(PeerQueue& queue);
  // Split: blocks until `op` is issued (the metadata ahead of it arrived).
  void waitIssued(int peer, const SplitOp& op, std::chrono::steady_clock::time_point deadline,
                  const std::string& description);
  // Fused: reads the headers of `peer`'s receives up to and including `upTo`, in order.
  void readHeaders(int peer, const FusedRecv* upTo, std::chrono::steady_clock::time_point deadline);
  void checkPeer(int peer, const std::string& description) const;

  c10::intrusive_ptr<c10d::ProcessGroup> group_;  // immutable after construction
  c10::intrusive_ptr<c10d::ProcessGroup> side_;   // immutable after construction
  std::chrono::milliseconds timeout_;
  at::Device device_;
  P2PProtocol protocol_;
  bool stageThroughHost_;  // CUDA tensors over a CPU-only backend (Gloo)
  int rank_;
  int worldSize_;
  Counters counters_;  // executor thread
  // Fused slot capacities, per (peer, direction of use, key): executor thread.
  std::map<std::tuple<int, bool, TransferKey>, int64_t> capacities_;
  // Per-peer order keeping (and, split, the metadata reader): by peer rank.
  std::map<int, std::unique_ptr<PeerQueue>> peers_;  // executor thread creates; see PeerQueue
  // Split: guards the peer queues' pending operations and what reader threads
  // publish (a receive's metadata or error); notified whenever one arrives.
  std::mutex mutex_;
  std::condition_variable arrived_;
};

}  // namespace pipedream
