#include "comm_engine.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <cstring>
#include <sstream>

namespace pipedream {

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kTag = 0;  // every message: nothing is matched by tag
constexpr int kFixedWords = 7;  // magic, forward, boundary, microbatch, redirected, packed bytes, count

std::chrono::milliseconds remaining(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return std::max(left, std::chrono::milliseconds(1));
}

// The calling thread's current stream on `device`; none for the CPU. Data
// operations issued from a reader thread run on the executor's stream.
std::optional<c10::Stream> currentStream(const at::Device& device) {
  if (device.is_cpu()) return std::nullopt;
  const auto* impl = c10::impl::getDeviceGuardImpl(device.type());
  return impl->getStream(device.has_index() ? device : impl->getDevice());
}

int64_t alignUp(int64_t bytes) { return (bytes + kWireAlignment - 1) / kWireAlignment * kWireAlignment; }

c10::intrusive_ptr<c10d::Work> post(c10d::ProcessGroup& group, bool send, const at::Tensor& tensor,
                                    int peer) {
  std::vector<at::Tensor> one{tensor};
  return send ? group.send(one, peer, kTag) : group.recv(one, peer, kTag);
}

// Views of `metas` in a packed buffer (header first).
std::vector<at::Tensor> unpack(const at::Tensor& buffer, const std::vector<TensorMeta>& metas) {
  std::vector<at::Tensor> out;
  int64_t offset = headerBytes(metas);
  for (const auto& m : metas) {
    const int64_t bytes = m.bytes();
    out.push_back(buffer.narrow(0, offset, bytes).view(m.dtype).view(m.shape));
    offset += alignUp(bytes);
  }
  return out;
}

// Packs `tensors` after `header` into `buffer` (host memory); returns the
// number of device-to-host copies that made the host wait.
int64_t pack(const WireHeader& header, const std::vector<at::Tensor>& tensors, at::Tensor& buffer) {
  writeHeader(header, buffer.data_ptr<uint8_t>());
  int64_t syncs = 0;
  int64_t offset = headerBytes(header.metas);
  for (size_t k = 0; k < tensors.size(); ++k) {
    const int64_t bytes = header.metas[k].bytes();
    if (bytes > 0) {
      buffer.narrow(0, offset, bytes).view(header.metas[k].dtype).view(header.metas[k].shape).copy_(tensors[k]);
      syncs += tensors[k].device().is_cpu() ? 0 : 1;
    }
    offset += alignUp(bytes);
  }
  return syncs;
}

// The header of a transfer of `tensors` (not redirected).
WireHeader headerOf(const TransferKey& key, const std::vector<at::Tensor>& tensors) {
  WireHeader header;
  header.key = key;
  header.metas = metasOf(tensors);
  header.packedBytes = packedBytes(header.metas);
  return header;
}

}  // namespace

// ---------------------------------------------------------------------------- wire format

const char* protocolName(P2PProtocol protocol) {
  return protocol == P2PProtocol::kFused ? "fused" : "split";
}

P2PProtocol parseProtocol(const std::string& name) {
  if (name == "fused") return P2PProtocol::kFused;
  if (name == "split") return P2PProtocol::kSplit;
  TORCH_CHECK(false, "unknown point-to-point protocol '", name, "' (use 'fused' or 'split')");
}

int64_t TensorMeta::bytes() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n * static_cast<int64_t>(c10::elementSize(dtype));
}

std::string TensorMeta::toString() const {
  std::ostringstream out;
  out << c10::toString(dtype) << "[";
  for (size_t k = 0; k < shape.size(); ++k) out << (k ? ", " : "") << shape[k];
  out << "]";
  return out.str();
}

std::vector<TensorMeta> metasOf(const std::vector<at::Tensor>& tensors) {
  std::vector<TensorMeta> metas;
  metas.reserve(tensors.size());
  for (const auto& t : tensors) metas.push_back(TensorMeta{t.scalar_type(), t.sizes().vec()});
  return metas;
}

int64_t headerBytes(const std::vector<TensorMeta>& metas) {
  int64_t words = kFixedWords;
  for (const auto& m : metas) words += 2 + static_cast<int64_t>(m.shape.size());
  return alignUp(words * 8);
}

int64_t packedBytes(const std::vector<TensorMeta>& metas) {
  int64_t total = headerBytes(metas);
  for (const auto& m : metas) total += alignUp(m.bytes());
  return total;
}

void writeHeader(const WireHeader& header, uint8_t* out) {
  TORCH_CHECK(header.metas.size() <= kMaxTensorsPerTransfer, "a stage boundary carries ",
              header.metas.size(), " tensors but at most ", kMaxTensorsPerTransfer,
              " are supported; pack them into fewer tensors");
  std::vector<int64_t> words{kHeaderMagic,
                             header.key.forward ? 1 : 0,
                             header.key.boundary,
                             header.key.microbatch,
                             header.redirected ? 1 : 0,
                             header.packedBytes,
                             static_cast<int64_t>(header.metas.size())};
  for (size_t k = 0; k < header.metas.size(); ++k) {
    const auto& m = header.metas[k];
    TORCH_CHECK(m.shape.size() <= kMaxDims, "tensor ", k, " at a stage boundary has ", m.shape.size(),
                " dimensions; at most ", kMaxDims, " are supported");
    words.push_back(static_cast<int64_t>(m.dtype));
    words.push_back(static_cast<int64_t>(m.shape.size()));
    words.insert(words.end(), m.shape.begin(), m.shape.end());
  }
  std::memcpy(out, words.data(), words.size() * sizeof(int64_t));
}

WireHeader readHeader(const uint8_t* data, int64_t available, const std::string& description) {
  const int64_t count = available / 8;
  std::vector<int64_t> words(static_cast<size_t>(count));
  std::memcpy(words.data(), data, static_cast<size_t>(count) * sizeof(int64_t));
  TORCH_CHECK(count >= kFixedWords, description, ": received a message of ", available,
              " bytes, too short for a header");
  TORCH_CHECK(words[0] == kHeaderMagic, description, ": received a header with a bad magic number (",
              words[0], "); the peer is not running the same pipedream_ext schedule");
  WireHeader header;
  header.key = TransferKey{words[1] != 0, static_cast<int>(words[2]), static_cast<int>(words[3])};
  header.redirected = words[4] != 0;
  header.packedBytes = words[5];
  const int64_t n = words[6];
  TORCH_CHECK(n >= 0 && n <= kMaxTensorsPerTransfer, description, ": header announces ", n, " tensors");
  int64_t at = kFixedWords;
  for (int64_t k = 0; k < n; ++k) {
    TORCH_CHECK(at + 2 <= count, description, ": header cut short at tensor ", k);
    TensorMeta meta;
    TORCH_CHECK(words[at] >= 0 && words[at] < static_cast<int64_t>(at::ScalarType::NumOptions),
                description, ": header announces an unknown dtype ", words[at]);
    meta.dtype = static_cast<at::ScalarType>(words[at]);
    const int64_t ndim = words[at + 1];
    TORCH_CHECK(ndim >= 0 && ndim <= kMaxDims && at + 2 + ndim <= count, description, ": bad rank ", ndim);
    for (int64_t d = 0; d < ndim; ++d) {
      TORCH_CHECK(words[at + 2 + d] >= 0, description, ": header announces a negative size ",
                  words[at + 2 + d]);
    }
    meta.shape.assign(words.begin() + at + 2, words.begin() + at + 2 + ndim);
    header.metas.push_back(std::move(meta));
    at += 2 + ndim;
  }
  const int64_t expected = packedBytes(header.metas);
  TORCH_CHECK(header.redirected ? header.packedBytes >= kMinCapacity : header.packedBytes == expected,
              description, ": header announces ", header.packedBytes, " bytes for ", n,
              " tensors that need ", expected);
  return header;
}

int64_t nextCapacity(int64_t capacity, int64_t needed) {
  if (needed > capacity || needed * 4 < capacity) return std::max(needed, kMinCapacity);
  return capacity;
}

// ---------------------------------------------------------------------------- per-peer state

class SplitRecv;

// One peer's order keeping. `unread`: executor thread. Split: `pending`,
// `toRead`, `current` and `stop` are guarded by the engine's mutex_; the reader
// waits for metadata receives in order and, when one arrives, issues what may
// go of `pending` itself, so a pair progresses while the executor's thread is
// busy elsewhere (the user's loop, a collective between steps).
class CommEngine::PeerQueue {
 public:
  std::deque<std::shared_ptr<SplitOp>> pending;   // split: not yet on the data channel
  std::deque<std::shared_ptr<FusedRecv>> unread;  // fused: headers not yet read
  std::deque<std::shared_ptr<SplitRecv>> toRead;  // split: metadata to wait for
  c10::intrusive_ptr<c10d::Work> current;         // the metadata receive being waited for
  bool stop = false;
  std::thread reader;
};

// ---------------------------------------------------------------------------- the transfer base

Transfer::Transfer(CommEngine& engine, int peer, std::string description)
    : engine_(engine), peer_(peer), description_(std::move(description)) {}

bool Transfer::wait(std::chrono::milliseconds timeout) {
  if (error_) std::rethrow_exception(error_);
  if (done_) return true;
  const auto deadline = Clock::now() + timeout;
  try {
    finish(deadline, timeout);
  } catch (...) {
    error_ = std::current_exception();
    throw;
  }
  done_ = true;
  return true;
}

void Transfer::waitWork(const c10::intrusive_ptr<c10d::Work>& work, Clock::time_point deadline,
                        std::chrono::milliseconds timeout) const {
  try {
    work->wait(remaining(deadline));
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "rank ", engine_.rank(), ": ", description_, " with rank ", peer_,
                " failed or timed out after ", timeout.count(), " ms (is rank ", peer_, " alive?): ",
                e.what());
  }
}

void Transfer::waitWorks(Clock::time_point deadline, std::chrono::milliseconds timeout) {
  for (auto& work : works_) waitWork(work, deadline, timeout);
  works_.clear();
}

// ---------------------------------------------------------------------------- fused transfers

class FusedSend : public Transfer {
 public:
  FusedSend(CommEngine& engine, const std::vector<at::Tensor>& tensors, int peer, const TransferKey& key,
            std::string description)
      : Transfer(engine, peer, std::move(description)) {
    const WireHeader header = headerOf(key, tensors);
    const int64_t needed = header.packedBytes;
    const int64_t capacity = engine.capacity(peer, key, true);
    auto& counters = engine.mutableCounters();
    at::Tensor packed = at::empty({std::max(needed, capacity)}, engine.hostOptions().dtype(at::kByte));
    std::vector<at::Tensor> contiguous;
    for (const auto& t : tensors) contiguous.push_back(t.detach().contiguous());
    counters.hostSyncs += pack(header, contiguous, packed);
    if (needed <= capacity) {
      send(engine.group(), packed.narrow(0, 0, capacity));
      counters.paddingBytes += capacity - needed;
    } else {
      // The receiver posted `capacity` bytes: a header saying where the rest goes.
      WireHeader redirect = header;
      redirect.redirected = true;
      redirect.metas.clear();
      at::Tensor small = at::empty({capacity}, engine.hostOptions().dtype(at::kByte));
      writeHeader(redirect, small.data_ptr<uint8_t>());
      send(engine.group(), small);
      send(engine.side(), packed);
      ++counters.redirectedSends;
    }
    engine.setCapacity(peer, key, true, nextCapacity(capacity, needed));
    ++counters.sends;
    for (const auto& m : header.metas) counters.bytesSent += m.bytes();
  }

 private:
  // Runs once: Gloo's SendWork::wait waits for one more completion each call.
  void finish(Clock::time_point deadline, std::chrono::milliseconds timeout) override {
    waitWorks(deadline, timeout);
    tensors_.clear();
  }

  void send(c10d::ProcessGroup& group, const at::Tensor& buffer) {
    tensors_.push_back(buffer);  // buffers must outlive the sends
    works_.push_back(post(group, true, buffer, peer_));
    ++engine_.mutableCounters().messagesSent;
  }
};

// Every member: the executor thread.
class FusedRecv : public Transfer {
 public:
  FusedRecv(CommEngine& engine, int peer, const TransferKey& key, std::string description)
      : Transfer(engine, peer, std::move(description)), key_(key) {
    capacity_ = engine.capacity(peer, key, false);
    buffer_ = at::empty({capacity_}, engine.hostOptions().dtype(at::kByte));
    dataWork_ = post(engine.group(), false, buffer_, peer);
    ++engine.mutableCounters().receives;
  }

  // Reads the header (in the pair's order: CommEngine::readHeaders) and posts
  // the side receive of a redirected payload. A failure is kept for wait().
  void readHeader(Clock::time_point deadline) {
    if (headerRead_) return;
    try {
      waitWork(dataWork_, deadline, engine_.timeout());
      header_ = pipedream::readHeader(buffer_.data_ptr<uint8_t>(), capacity_, description_);
      checkKey(header_.key);
      if (header_.redirected) {
        side_ = at::empty({header_.packedBytes}, engine_.hostOptions().dtype(at::kByte));
        sideWork_ = post(engine_.side(), false, side_, peer_);
      }
      engine_.setCapacity(peer_, key_, false, nextCapacity(capacity_, header_.packedBytes));
    } catch (...) {
      setError(std::current_exception());
    }
    headerRead_ = true;
  }
  bool headerRead() const { return headerRead_; }

 private:
  void finish(Clock::time_point deadline, std::chrono::milliseconds timeout) override {
    engine_.readHeaders(peer_, this, deadline);
    if (exception()) std::rethrow_exception(exception());
    at::Tensor packed = buffer_;
    if (header_.redirected) {
      waitWork(sideWork_, deadline, timeout);
      header_ = pipedream::readHeader(side_.data_ptr<uint8_t>(), side_.numel(), description_);
      TORCH_CHECK(!header_.redirected, description_, ": a redirected payload redirects again");
      checkKey(header_.key);
      packed = side_;
    }
    tensors_ = unpack(packed, header_.metas);
    auto& counters = engine_.mutableCounters();
    for (auto& t : tensors_) {
      counters.bytesReceived += t.numel() * t.element_size();
      if (engine_.staged()) t = t.to(engine_.device(), /*non_blocking=*/true);
    }
    buffer_ = at::Tensor();
    side_ = at::Tensor();
  }

  void checkKey(const TransferKey& got) const {
    TORCH_CHECK(got == key_, "rank ", engine_.rank(), ": ", description_, ": rank ", peer_,
                " sent transfer ", got.toString(), " where this rank expected ", key_.toString(),
                " (the two ranks issue this pair's transfers in different orders: do both run the "
                "same schedule, balance and pipedream_ext version?)");
  }

  TransferKey key_;
  int64_t capacity_ = 0;
  at::Tensor buffer_;  // the data-channel message (capacity_ bytes)
  c10::intrusive_ptr<c10d::Work> dataWork_;
  bool headerRead_ = false;
  WireHeader header_;
  at::Tensor side_;  // a redirected payload
  c10::intrusive_ptr<c10d::Work> sideWork_;
};

// ---------------------------------------------------------------------------- split transfers

// A split-protocol transfer's data-channel part, queued in the pair's order.
// issue() runs on the executor's thread or the pair's reader thread, under the
// engine's mutex_; what it writes (works_, tensors_) is read by the executor
// only once issued() is true.
class SplitOp : public Transfer {
 public:
  bool issued() const { return issued_.load(); }
  // Posts the data operations. The caller holds the engine's mutex_ (the
  // executor's thread, or the pair's reader when metadata arrives); sets
  // issued() last, so a thread that sees it also sees the posted works.
  virtual void issue() = 0;
  // Whether issue() may run now (receives: their metadata, or its error, is
  // in). The caller holds the engine's mutex_.
  virtual bool readyLocked() const { return true; }

 protected:
  using Transfer::Transfer;
  // Blocks until issue() ran (the metadata ahead of this transfer arrived).
  void waitIssued(Clock::time_point deadline) {
    if (!issued_) engine_.waitIssued(peer_, *this, deadline, description_);
  }

  std::atomic<bool> issued_{false};  // set by issue(), last
};

class SplitSend : public SplitOp {
 public:
  SplitSend(CommEngine& engine, const std::vector<at::Tensor>& tensors, int peer, const TransferKey& key,
            std::string description)
      : SplitOp(engine, peer, std::move(description)) {
    const WireHeader header = headerOf(key, tensors);
    at::Tensor metadata = at::zeros({kMetadataBytes}, at::TensorOptions().dtype(at::kByte));
    TORCH_CHECK(headerBytes(header.metas) <= kMetadataBytes, "transfer header too large");
    writeHeader(header, metadata.data_ptr<uint8_t>());
    tensors_.push_back(metadata);
    works_.push_back(post(engine.side(), true, metadata, peer));
    auto& counters = engine.mutableCounters();
    ++counters.messagesSent;
    ++counters.sends;
    if (auto stream = currentStream(tensors.empty() ? engine.device() : tensors.front().device())) {
      stream_ = *stream;
    }
    for (const auto& t : tensors) {
      if (t.numel() == 0) continue;  // both ends know from the metadata: nothing to move
      at::Tensor data = t.detach().contiguous();
      if (engine.staged()) {
        data = at::empty(data.sizes(), engine.hostOptions().dtype(data.scalar_type())).copy_(data);
        ++counters.hostSyncs;
      }
      data_.push_back(data);
      counters.bytesSent += data.numel() * data.element_size();
      ++counters.messagesSent;  // counted here: issue() may run on the reader thread
    }
  }

  void issue() override {
    c10::OptionalStreamGuard guard(stream_);  // the stream the tensors were made on
    for (const auto& data : data_) {
      tensors_.push_back(data);
      works_.push_back(post(engine_.group(), true, data, peer_));
    }
    data_.clear();
    issued_ = true;
  }

 private:
  void finish(Clock::time_point deadline, std::chrono::milliseconds timeout) override {
    waitIssued(deadline);
    waitWorks(deadline, timeout);
    tensors_.clear();
  }

  std::optional<c10::Stream> stream_;  // the executor's current stream (non-CPU devices); constructor
  std::vector<at::Tensor> data_;       // until issued: the constructor, then issue()
};

class SplitRecv : public SplitOp {
 public:
  SplitRecv(CommEngine& engine, int peer, const TransferKey& key, std::string description)
      : SplitOp(engine, peer, std::move(description)), key_(key) {
    metadata_ = at::empty({kMetadataBytes}, at::TensorOptions().dtype(at::kByte));
    metadataWork_ = post(engine.side(), false, metadata_, peer);
    ++engine.mutableCounters().receives;
    stream_ = currentStream(engine.device());
  }

  // Reader thread: waits for the metadata (no deadline: a step's receives may
  // wait for a peer as long as the user's loop takes; the executor's waits
  // carry the timeout). Publishes under the engine's mutex_.
  void readMetadata(std::mutex& mutex) {
    WireHeader header;
    std::exception_ptr error;
    try {
      metadataWork_->wait();
      header = pipedream::readHeader(metadata_.data_ptr<uint8_t>(), kMetadataBytes, description_);
      TORCH_CHECK(header.key == key_, "rank ", engine_.rank(), ": ", description_, ": rank ", peer_,
                  " sent transfer ", header.key.toString(), " where this rank expected ",
                  key_.toString(), " (the two ranks issue this pair's transfers in different "
                  "orders: do both run the same schedule, balance and pipedream_ext version?)");
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(mutex);
    metas_ = std::move(header.metas);
    metadataError_ = error;
    arrived_ = true;
  }

  bool readyLocked() const override { return arrived_; }

  void issue() override {
    if (!metadataError_) {  // else wait() reports it
      c10::OptionalStreamGuard guard(stream_);  // buffers belong to the consumer's stream
      const auto options =
          engine_.staged() ? engine_.hostOptions() : at::TensorOptions().device(engine_.device());
      for (const auto& m : metas_) {
        at::Tensor buffer = at::empty(m.shape, options.dtype(m.dtype));
        tensors_.push_back(buffer);
        if (m.bytes() > 0) works_.push_back(post(engine_.group(), false, buffer, peer_));
      }
    }
    issued_ = true;
  }

  c10::intrusive_ptr<c10d::Work> metadataWork() const { return metadataWork_; }

 private:
  void finish(Clock::time_point deadline, std::chrono::milliseconds timeout) override {
    if (issued_) ++engine_.mutableCounters().prePostedReceives;
    waitIssued(deadline);
    if (metadataError_) std::rethrow_exception(metadataError_);
    waitWorks(deadline, timeout);
    auto& counters = engine_.mutableCounters();
    for (auto& t : tensors_) {
      counters.bytesReceived += t.numel() * t.element_size();
      if (engine_.staged()) t = t.to(engine_.device(), /*non_blocking=*/true);
    }
  }

  TransferKey key_;                      // constructor
  std::optional<c10::Stream> stream_;    // the executor's current stream (non-CPU devices); constructor
  at::Tensor metadata_;                  // constructor; filled by the side channel
  c10::intrusive_ptr<c10d::Work> metadataWork_;  // constructor; waited for by the reader
  // Published by the reader under engine_.mutex_; read by issue() under it, and
  // by the executor after issued().
  bool arrived_ = false;
  std::vector<TensorMeta> metas_;
  std::exception_ptr metadataError_;
};

// ---------------------------------------------------------------------------- engine

namespace {

// The backend that carries `device`'s tensors: a group created as
// "cpu:gloo,cuda:nccl" reports no single name, so ask per device type.
std::string backendNameFor(c10d::ProcessGroup& group, const at::Device& device) {
  try {
    return group.getBackend(device.type())->getBackendName();
  } catch (const std::exception&) {
    return group.getBackendName();
  }
}

}  // namespace

CommEngine::CommEngine(c10::intrusive_ptr<c10d::ProcessGroup> group,
                       c10::intrusive_ptr<c10d::ProcessGroup> side, std::chrono::milliseconds timeout,
                       at::Device device, P2PProtocol protocol)
    : group_(std::move(group)), side_(std::move(side)), timeout_(timeout), device_(device), protocol_(protocol) {
  TORCH_CHECK(group_, "CommEngine needs a process group");
  TORCH_CHECK(side_, "CommEngine needs a side group (Gloo, the same ranks)");
  TORCH_CHECK(timeout_.count() > 0, "communication timeout must be > 0 ms (got ", timeout_.count(), ")");
  const std::string data = backendNameFor(*group_, device_);
  stageThroughHost_ = !device_.is_cpu() && data != "nccl";
  TORCH_CHECK(side_->getSize() == group_->getSize() && side_->getRank() == group_->getRank(),
              "the side group is rank ", side_->getRank(), " of ", side_->getSize(),
              " but the pipeline's group is rank ", group_->getRank(), " of ", group_->getSize(),
              "; it must hold the same ranks in the same order");
  TORCH_CHECK(side_.get() != group_.get() || (!device_.is_cpu() && !stageThroughHost_),
              "the side group must not be the group whose Gloo backend carries the data");
  rank_ = group_->getRank();
  worldSize_ = group_->getSize();
}

CommEngine::~CommEngine() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [peer, queue] : peers_) {
      queue->stop = true;
      if (queue->current) queue->current->abort();  // a metadata receive nobody will send now
    }
  }
  arrived_.notify_all();
  for (auto& [peer, queue] : peers_) {
    if (queue->reader.joinable()) queue->reader.join();
  }
}

at::TensorOptions CommEngine::hostOptions() const {
  auto options = at::TensorOptions();
  if (device_.is_cpu()) return options;
  return options.device(at::kCPU).pinned_memory(true);
}

int64_t CommEngine::capacity(int peer, const TransferKey& key, bool sending) const {
  auto it = capacities_.find({peer, sending, key});
  return it == capacities_.end() ? kMinCapacity : it->second;
}

void CommEngine::setCapacity(int peer, const TransferKey& key, bool sending, int64_t capacity) {
  capacities_[{peer, sending, key}] = capacity;
}

void CommEngine::checkPeer(int peer, const std::string& description) const {
  TORCH_CHECK(peer >= 0 && peer < worldSize_ && peer != rank_, description, ": bad peer rank ", peer);
}

CommEngine::PeerQueue& CommEngine::peerQueue(int peer) {
  auto it = peers_.find(peer);
  if (it != peers_.end()) return *it->second;
  auto queue = std::make_unique<PeerQueue>();
  PeerQueue* raw = queue.get();
  if (protocol_ == P2PProtocol::kSplit) {
    raw->reader = std::thread([this, raw] {
      for (;;) {
        std::shared_ptr<SplitRecv> next;
        {
          std::unique_lock<std::mutex> lock(mutex_);
          arrived_.wait(lock, [&] { return raw->stop || !raw->toRead.empty(); });
          if (raw->stop) return;
          next = raw->toRead.front();
          raw->toRead.pop_front();
          raw->current = next->metadataWork();
        }
        next->readMetadata(mutex_);
        {
          std::lock_guard<std::mutex> lock(mutex_);
          raw->current.reset();
          issueReadyLocked(*raw);
        }
        arrived_.notify_all();
      }
    });
  }
  return *peers_.emplace(peer, std::move(queue)).first->second;
}

std::shared_ptr<Transfer> CommEngine::send(const std::vector<at::Tensor>& tensors, int peer,
                                           const TransferKey& key, const std::string& description) {
  checkPeer(peer, description);
  PeerQueue& queue = peerQueue(peer);
  if (protocol_ == P2PProtocol::kFused) {
    return std::make_shared<FusedSend>(*this, tensors, peer, key, description);
  }
  auto transfer = std::make_shared<SplitSend>(*this, tensors, peer, key, description);
  std::lock_guard<std::mutex> lock(mutex_);
  queue.pending.push_back(transfer);
  issueReadyLocked(queue);
  return transfer;
}

std::shared_ptr<Transfer> CommEngine::recv(int peer, const TransferKey& key, const std::string& description) {
  checkPeer(peer, description);
  PeerQueue& queue = peerQueue(peer);
  if (protocol_ == P2PProtocol::kFused) {
    auto transfer = std::make_shared<FusedRecv>(*this, peer, key, description);
    queue.unread.push_back(transfer);
    ++counters_.prePostedReceives;  // its buffer is posted now, ahead of the consumer
    return transfer;
  }
  auto transfer = std::make_shared<SplitRecv>(*this, peer, key, description);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue.pending.push_back(transfer);
    queue.toRead.push_back(transfer);
  }
  arrived_.notify_all();
  return transfer;
}

void CommEngine::issueReadyLocked(PeerQueue& queue) {
  while (!queue.pending.empty() && queue.pending.front()->readyLocked()) {
    queue.pending.front()->issue();
    queue.pending.pop_front();
  }
}

void CommEngine::waitIssued(int peer, const SplitOp& op, Clock::time_point deadline,
                            const std::string& description) {
  // The pair's reader issues `op` when the metadata ahead of it arrives.
  std::unique_lock<std::mutex> lock(mutex_);
  if (arrived_.wait_until(lock, deadline, [&] { return op.issued(); })) return;
  PeerQueue& queue = *peers_.at(peer);
  const std::string head = queue.pending.empty() ? "nothing" : queue.pending.front()->description();
  lock.unlock();
  TORCH_CHECK(false, "rank ", rank_, ": ", description, " with rank ", peer, " timed out after ",
              timeout_.count(), " ms waiting for the metadata of ", head, " from rank ", peer,
              " (is rank ", peer, " alive, and does it run the same schedule?)");
}

void CommEngine::readHeaders(int peer, const FusedRecv* upTo, Clock::time_point deadline) {
  // Headers are read in the pair's order, so once `upTo`'s is read every
  // earlier one is too. A consumer may wait for a receive that a wait for a
  // later receive of the pair already read (zbv: rank 1 consumes B0 before
  // F2, posted first): reading on from there would block on the data of
  // receives posted after `upTo`, until the peer sends them.
  if (upTo->headerRead()) return;
  PeerQueue& queue = peerQueue(peer);
  while (!queue.unread.empty()) {
    auto front = queue.unread.front();
    front->readHeader(deadline);
    queue.unread.pop_front();
    if (front.get() == upTo) return;
  }
}

}  // namespace pipedream
