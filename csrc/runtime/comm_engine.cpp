#include "comm_engine.h"

#include <c10/util/Exception.h>

#include <sstream>

namespace pipedream {

namespace {

using Clock = std::chrono::steady_clock;

std::chrono::milliseconds remaining(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return std::max(left, std::chrono::milliseconds(1));
}

// Waits for one c10d work item; rethrows failures with context.
void waitWork(const c10::intrusive_ptr<c10d::Work>& work, Clock::time_point deadline, int self,
              int peer, const std::string& description, std::chrono::milliseconds timeout) {
  try {
    work->wait(remaining(deadline));
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "rank ", self, ": ", description, " with rank ", peer,
                " failed or timed out after ", timeout.count(),
                " ms (is rank ", peer, " alive?): ", e.what());
  }
}

int messageTag(int tag, int part) { return tag * kPartsPerTag + part; }

class SendTransfer : public Transfer {
 public:
  SendTransfer(std::vector<c10::intrusive_ptr<c10d::Work>> works, std::vector<at::Tensor> keepAlive,
               int self, int peer, std::string description, std::chrono::milliseconds timeout)
      : works_(std::move(works)),
        keepAlive_(std::move(keepAlive)),
        self_(self),
        peer_(peer),
        description_(std::move(description)),
        timeout_(timeout) {}

  // Idempotent: Gloo's SendWork::wait waits for one more completion of its
  // buffer each call, so a second wait would block until the timeout. The
  // works hold the sent tensors too: both go once the send is done.
  bool wait(std::chrono::milliseconds timeout) override {
    if (error_) std::rethrow_exception(error_);
    if (done_) return true;
    const auto deadline = Clock::now() + timeout;
    try {
      for (auto& work : works_) waitWork(work, deadline, self_, peer_, description_, timeout);
    } catch (...) {
      error_ = std::current_exception();
      throw;
    }
    works_.clear();
    keepAlive_.clear();
    done_ = true;
    return true;
  }
  bool isCompleted() override {
    if (done_) return true;
    for (auto& work : works_) {
      if (!work->isCompleted()) return false;
    }
    return true;
  }
  std::exception_ptr exception() const override { return error_; }
  const std::vector<at::Tensor>& tensors() const override { return keepAlive_; }
  const std::string& description() const override { return description_; }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  std::vector<at::Tensor> keepAlive_;  // buffers must outlive the sends
  int self_;
  int peer_;
  std::string description_;
  std::chrono::milliseconds timeout_;
  std::exception_ptr error_;
  bool done_ = false;  // waited successfully: works_ and keepAlive_ released
};

class RecvTransfer : public Transfer {
 public:
  // `predicted`: the slot's shapes from its last transfer (pre-posted now),
  // or nullptr to post the data when the header arrives.
  RecvTransfer(CommEngine& engine, int peer, int tag, std::string description,
               const std::vector<TensorMeta>* predicted, bool eager)
      : engine_(engine), peer_(peer), tag_(tag), description_(std::move(description)) {
    header_ = at::empty({kHeaderWords}, engine_.wireOptions(at::kLong));
    std::vector<at::Tensor> buffers{header_};
    headerWork_ = engine_.group().recv(buffers, peer_, messageTag(tag_, 0));
    if (predicted != nullptr) {
      prePosted_ = true;
      predicted_ = *predicted;
      if (eager) post();
    }
  }

  void post() override {
    if (!prePosted_ || predictedPosted_) return;
    postData(predicted_, 1);
    predictedPosted_ = true;
  }

  void poll() override {
    if (headerDone_ || done_ || !headerWork_->isCompleted()) return;
    try {
      headerWork_->wait(std::chrono::milliseconds(1));  // completed: surfaces errors only
      onHeader();
    } catch (...) {
      // Leave it to wait(), which reports failures with their context.
    }
  }

  bool wait(std::chrono::milliseconds timeout) override {
    if (done_) return true;
    const auto deadline = Clock::now() + timeout;
    try {
      if (!headerDone_) {
        waitWork(headerWork_, deadline, engine_.rank(), peer_, description_, timeout);
        onHeader();
      }
      for (auto& work : dataWorks_) waitWork(work, deadline, engine_.rank(), peer_, description_, timeout);
      // Redirected: the first buffers only took the sender's filler.
      tensors_.erase(tensors_.begin(), tensors_.begin() + static_cast<std::ptrdiff_t>(skip_));
      for (auto& t : tensors_) {
        engine_.addBytesReceived(t.numel() * t.element_size());
        t = engine_.fromWire(t);
      }
    } catch (...) {
      error_ = std::current_exception();
      throw;
    }
    done_ = true;
    return true;
  }

 private:
  void postData(const std::vector<TensorMeta>& metas, int firstPart) {
    for (size_t k = 0; k < metas.size(); ++k) {
      at::Tensor buffer = at::empty(metas[k].shape, engine_.wireOptions(metas[k].dtype));
      std::vector<at::Tensor> one{buffer};
      dataWorks_.push_back(
          engine_.group().recv(one, peer_, messageTag(tag_, firstPart + static_cast<int>(k))));
      tensors_.push_back(buffer);
    }
  }

  void onHeader() {
    bool redirected = false;
    const auto metas = decodeHeader(header_.to(at::kCPU), description_, &redirected);
    if (redirected) {
      TORCH_CHECK(prePosted_, description_, ": rank ", peer_,
                  " redirected a transfer this rank did not pre-post (the two ranks disagree on "
                  "the transfer history; are both running the same schedule?)");
      post();  // the buffers the sender's filler goes to
      skip_ = tensors_.size();
      postData(metas, kRedirectedPart + 1);
    } else if (prePosted_) {
      TORCH_CHECK(metas == predicted_, description_, ": rank ", peer_,
                  " sent shapes that differ from the pre-posted ones without redirecting (the two "
                  "ranks disagree on the transfer history)");
      post();
    } else {
      postData(metas, 1);
    }
    if (engine_.shapePrediction()) engine_.receivedShapes_[{peer_, tag_}] = metas;
    headerDone_ = true;
  }

 public:
  bool isCompleted() override { return done_; }
  std::exception_ptr exception() const override { return error_; }
  const std::vector<at::Tensor>& tensors() const override { return tensors_; }
  const std::string& description() const override { return description_; }

 private:
  CommEngine& engine_;
  int peer_;
  int tag_;
  std::string description_;
  at::Tensor header_;
  c10::intrusive_ptr<c10d::Work> headerWork_;
  bool prePosted_ = false;             // committed to the predicted shapes
  bool predictedPosted_ = false;       // ... and their buffers are posted
  std::vector<TensorMeta> predicted_;  // their shapes
  std::vector<c10::intrusive_ptr<c10d::Work>> dataWorks_;
  std::vector<at::Tensor> tensors_;
  size_t skip_ = 0;  // leading filler buffers of a redirected transfer
  bool headerDone_ = false;
  bool done_ = false;
  std::exception_ptr error_;
};

}  // namespace

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

at::Tensor encodeHeader(const std::vector<TensorMeta>& metas, bool redirected) {
  TORCH_CHECK(metas.size() <= kMaxTensorsPerTransfer, "a stage boundary carries ",
              metas.size(), " tensors but at most ", kMaxTensorsPerTransfer,
              " are supported; pack them into fewer tensors");
  at::Tensor header = at::zeros({kHeaderWords}, at::TensorOptions().dtype(at::kLong));
  auto* words = header.data_ptr<int64_t>();
  words[0] = kHeaderMagic;
  words[1] = static_cast<int64_t>(metas.size()) | (redirected ? kRedirectedFlag : 0);
  for (size_t k = 0; k < metas.size(); ++k) {
    const auto& m = metas[k];
    TORCH_CHECK(m.shape.size() <= kMaxDims, "tensor ", k, " at a stage boundary has ",
                m.shape.size(), " dimensions; at most ", kMaxDims, " are supported");
    int64_t* slot = words + 2 + k * (2 + kMaxDims);
    slot[0] = static_cast<int64_t>(m.dtype);
    slot[1] = static_cast<int64_t>(m.shape.size());
    for (size_t d = 0; d < m.shape.size(); ++d) slot[2 + d] = m.shape[d];
  }
  return header;
}

std::vector<TensorMeta> decodeHeader(const at::Tensor& header, const std::string& description,
                                     bool* redirected) {
  const auto* words = header.data_ptr<int64_t>();
  TORCH_CHECK(words[0] == kHeaderMagic, description,
              ": received a header with a bad magic number (", words[0],
              "); the peer is not running the same pipedream_ext schedule");
  if (redirected != nullptr) *redirected = (words[1] & kRedirectedFlag) != 0;
  const int64_t count = words[1] & ~kRedirectedFlag;
  TORCH_CHECK(count >= 0 && count <= kMaxTensorsPerTransfer, description,
              ": header announces ", count, " tensors");
  std::vector<TensorMeta> metas;
  for (int64_t k = 0; k < count; ++k) {
    const int64_t* slot = words + 2 + k * (2 + kMaxDims);
    TensorMeta meta;
    TORCH_CHECK(slot[0] >= 0 && slot[0] < static_cast<int64_t>(at::ScalarType::NumOptions),
                description, ": header announces an unknown dtype ", slot[0]);
    meta.dtype = static_cast<at::ScalarType>(slot[0]);
    TORCH_CHECK(slot[1] >= 0 && slot[1] <= kMaxDims, description, ": bad rank ", slot[1]);
    for (int64_t d = 0; d < slot[1]; ++d) {
      TORCH_CHECK(slot[2 + d] >= 0, description, ": header announces a negative size ", slot[2 + d]);
    }
    meta.shape.assign(slot + 2, slot + 2 + slot[1]);
    metas.push_back(std::move(meta));
  }
  return metas;
}

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

CommEngine::CommEngine(c10::intrusive_ptr<c10d::ProcessGroup> group, std::chrono::milliseconds timeout,
                       at::Device device)
    : group_(std::move(group)), timeout_(timeout), device_(device) {
  TORCH_CHECK(group_, "CommEngine needs a process group");
  stageThroughHost_ = !device_.is_cpu() && backendNameFor(*group_, device_) != "nccl";
  TORCH_CHECK(timeout_.count() > 0, "communication timeout must be > 0 ms (got ", timeout_.count(), ")");
  rank_ = group_->getRank();
  worldSize_ = group_->getSize();
}

at::TensorOptions CommEngine::wireOptions(at::ScalarType dtype) const {
  auto options = at::TensorOptions().dtype(dtype);
  if (device_.is_cpu()) return options;
  if (stageThroughHost_) return options.device(at::kCPU).pinned_memory(true);
  return options.device(device_);
}

at::Tensor CommEngine::fromWire(const at::Tensor& buffer) const {
  return stageThroughHost_ ? buffer.to(device_) : buffer;
}

std::shared_ptr<Transfer> CommEngine::send(const std::vector<at::Tensor>& tensors, int peer, int tag,
                                           const std::string& description) {
  TORCH_CHECK(peer >= 0 && peer < worldSize_ && peer != rank_, description, ": bad peer rank ", peer);
  std::vector<at::Tensor> keepAlive;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  auto post = [&](at::Tensor data, int part) {
    if (!device_.is_cpu() && data.device() != wireOptions(data.scalar_type()).device()) {
      data = at::empty(data.sizes(), wireOptions(data.scalar_type())).copy_(data);
    }
    keepAlive.push_back(data);
    std::vector<at::Tensor> one{data};
    works.push_back(group_->send(one, peer, messageTag(tag, part)));
    bytesSent_ += data.numel() * data.element_size();
  };
  const auto metas = metasOf(tensors);
  // What the receiver pre-posted for this slot (see the file comment).
  const std::vector<TensorMeta>* predicted = nullptr;
  if (predictShapes_) {
    auto it = sentShapes_.find({peer, tag});
    if (it != sentShapes_.end()) predicted = &it->second;
  }
  const bool redirected = predicted != nullptr && !(*predicted == metas);
  ++sends_;
  redirectedSends_ += redirected ? 1 : 0;
  post(encodeHeader(metas, redirected), 0);
  if (redirected) {
    for (size_t k = 0; k < predicted->size(); ++k) {
      post(at::zeros((*predicted)[k].shape, at::TensorOptions().dtype((*predicted)[k].dtype)),
           static_cast<int>(k) + 1);
    }
  }
  const int firstPart = redirected ? kRedirectedPart + 1 : 1;
  for (size_t k = 0; k < tensors.size(); ++k) {
    post(tensors[k].detach().contiguous(), firstPart + static_cast<int>(k));
  }
  if (predictShapes_) sentShapes_[{peer, tag}] = metas;
  return std::make_shared<SendTransfer>(std::move(works), std::move(keepAlive), rank_, peer,
                                        description, timeout_);
}

std::shared_ptr<Transfer> CommEngine::recv(int peer, int tag, const std::string& description,
                                           bool eager) {
  TORCH_CHECK(peer >= 0 && peer < worldSize_ && peer != rank_, description, ": bad peer rank ", peer);
  const std::vector<TensorMeta>* predicted = nullptr;
  if (predictShapes_) {
    auto it = receivedShapes_.find({peer, tag});
    if (it != receivedShapes_.end()) predicted = &it->second;
  }
  ++receives_;
  prePostedReceives_ += predicted != nullptr ? 1 : 0;
  return std::make_shared<RecvTransfer>(*this, peer, tag, description, predicted, eager);
}

}  // namespace pipedream
