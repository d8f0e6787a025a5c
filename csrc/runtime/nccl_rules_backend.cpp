#include "runtime/nccl_rules_backend.h"

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

#include <sstream>

namespace pipedream {

namespace {

constexpr int64_t kMagic = 0x4e43434c;  // "NCCL"
constexpr int kHeaderWords = 4;         // magic, bytes, dtype, operation number
constexpr int kTag = 0;                 // the inner Gloo group's: one per direction, FIFO

using Clock = std::chrono::steady_clock;

std::string bytesOf(int64_t bytes, at::ScalarType dtype) {
  return std::to_string(bytes) + " bytes of " + c10::toString(dtype);
}

at::Tensor asBytes(const at::Tensor& tensor) {
  return tensor.reshape({-1}).view(at::kByte);
}

}  // namespace

// ---------------------------------------------------------------------------- work

NcclRulesWork::NcclRulesWork(int rank, c10d::OpType type, std::string description,
                             std::function<std::string(const std::string&)> blocker, int parts)
    : c10d::Work(rank, type),
      description_(std::move(description)),
      blocker_(std::move(blocker)),
      pending_(parts),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {
  if (pending_ == 0) {
    finish();
    future_->markCompleted(c10::IValue(std::vector<at::Tensor>()));
  }
}

void NcclRulesWork::partDone(std::exception_ptr error) {
  bool last = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (error && !firstError_) firstError_ = error;
    last = --pending_ == 0;
  }
  if (!last) return;
  finish(firstError_);
  if (firstError_) {
    future_->setError(firstError_);
  } else {
    future_->markCompleted(c10::IValue(std::vector<at::Tensor>()));
  }
}

bool NcclRulesWork::isCompleted() {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_;
}

c10::intrusive_ptr<c10::ivalue::Future> NcclRulesWork::getFuture() { return future_; }

bool NcclRulesWork::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (timeout == kNoTimeout) {
    cv_.wait(lock, [&] { return completed_; });
  } else if (!cv_.wait_for(lock, timeout, [&] { return completed_; })) {
    lock.unlock();
    TORCH_CHECK(false, "nccl_rules: rank ", rank_, ": ", description_, " did not complete within ",
                timeout.count(), " ms. Under NCCL's rules the k-th send from rank a to rank b meets "
                "the k-th receive at b from a (tags are ignored) and each pair's operations run one "
                "at a time in the order they were issued; this rank's queue with that peer ",
                blocker_(description_), ". Does the peer issue the matching operation at the same "
                "position?");
  }
  if (exception_) std::rethrow_exception(exception_);
  return true;
}

// ---------------------------------------------------------------------------- backend

NcclRulesBackend::NcclRulesBackend(c10::intrusive_ptr<c10d::Backend> gloo, int rank, int size,
                                   std::chrono::milliseconds timeout)
    : c10d::Backend(rank, size), gloo_(std::move(gloo)), timeout_(timeout) {
  TORCH_CHECK(gloo_, "nccl_rules needs an inner Gloo backend");
  TORCH_CHECK(gloo_->getRank() == rank && gloo_->getSize() == size, "nccl_rules: the inner group is rank ",
              gloo_->getRank(), " of ", gloo_->getSize(), " but this backend is rank ", rank, " of ", size);
  peers_.reserve(size);
  for (int q = 0; q < size; ++q) peers_.push_back(std::make_shared<Peer>());
  try {
    for (int q = 0; q < size; ++q) {
      if (q != rank) peers_[q]->worker = std::thread([this, q] { runPeer(q); });
    }
  } catch (...) {
    stopWorkers();  // no destructor runs for a constructor that throws
    throw;
  }
}

NcclRulesBackend::~NcclRulesBackend() { stopWorkers(); }

void NcclRulesBackend::stopWorkers() {
  for (auto& peer : peers_) {
    std::lock_guard<std::mutex> lock(peer->mutex);
    peer->stop = true;
    for (auto& work : peer->inFlight) work->abort();  // unblocks a worker stuck on a lost peer
    peer->cv.notify_all();
  }
  for (auto& peer : peers_) {
    if (peer->worker.joinable()) peer->worker.join();
  }
}

std::string NcclRulesBackend::describe(const Op& op, int peer) const {
  std::ostringstream out;
  out << (op.send ? "send #" : "receive #") << op.index << (op.send ? " to rank " : " from rank ")
      << peer << " (" << bytesOf(op.tensor.numel() * op.tensor.element_size(), op.tensor.scalar_type())
      << ")";
  return out.str();
}

c10::intrusive_ptr<c10d::Work> NcclRulesBackend::enqueue(bool send, at::Tensor tensor, int peer) {
  TORCH_CHECK(peer >= 0 && peer < getSize() && peer != getRank(), "nccl_rules: rank ", getRank(),
              ": bad peer rank ", peer);
  TORCH_CHECK(tensor.is_contiguous(), "nccl_rules: rank ", getRank(), ": ", send ? "send" : "recv",
              " needs a contiguous tensor (NCCL does too)");
  TORCH_CHECK(tensor.device().is_cpu(), "nccl_rules carries CPU tensors (got ", tensor.device(), ")");
  auto state = peers_.at(peer);
  Op op;
  op.send = send;
  op.tensor = tensor;
  {
    std::lock_guard<std::mutex> lock(state->mutex);
    op.index = state->issued++;
  }
  std::weak_ptr<Peer> weak = state;
  op.work = c10::make_intrusive<NcclRulesWork>(
      getRank(), send ? c10d::OpType::SEND : c10d::OpType::RECV, describe(op, peer),
      [weak](const std::string& self) {
        auto p = weak.lock();
        if (!p) return std::string("is gone");
        std::lock_guard<std::mutex> lock(p->mutex);
        if (p->head.rfind(self, 0) == 0) {
          return "is at this operation: the peer has not issued the matching " +
                 std::string(self.rfind("send", 0) == 0 ? "receive" : "send") + " as its operation #" +
                 self.substr(self.find('#') + 1, self.find(' ', self.find('#')) - self.find('#') - 1) +
                 " with this rank";
        }
        return p->head.empty() ? std::string("is idle (the operation never started)")
                               : "is still busy with the earlier " + p->head + ", which holds this one";
      });
  auto work = op.work;
  if (coalescing_) {
    auto it = std::find_if(coalesced_.begin(), coalesced_.end(), [&](const auto& e) { return e.first == peer; });
    if (it == coalesced_.end()) it = coalesced_.insert(coalesced_.end(), {peer, Item{}});
    it->second.push_back(std::move(op));
    return work;
  }
  {
    std::lock_guard<std::mutex> lock(state->mutex);
    state->queue.push_back(Item{std::move(op)});
  }
  state->cv.notify_all();
  return work;
}

c10::intrusive_ptr<c10d::Work> NcclRulesBackend::send(std::vector<at::Tensor>& tensors, int dstRank,
                                                       int /*tag: NCCL has none*/) {
  TORCH_CHECK(tensors.size() == 1, "nccl_rules: send takes one tensor (got ", tensors.size(), ")");
  return enqueue(true, tensors[0], dstRank);
}

c10::intrusive_ptr<c10d::Work> NcclRulesBackend::recv(std::vector<at::Tensor>& tensors, int srcRank,
                                                       int /*tag: NCCL has none*/) {
  TORCH_CHECK(tensors.size() == 1, "nccl_rules: recv takes one tensor (got ", tensors.size(), ")");
  return enqueue(false, tensors[0], srcRank);
}

c10::intrusive_ptr<c10d::Work> NcclRulesBackend::recvAnysource(std::vector<at::Tensor>&, int) {
  TORCH_CHECK(false, "nccl_rules: NCCL has no receive from any source; name the peer");
}

void NcclRulesBackend::startCoalescing() {
  TORCH_CHECK(!coalescing_, "nccl_rules: startCoalescing() twice without endCoalescing()");
  coalescing_ = true;
  coalesced_.clear();
}

c10::intrusive_ptr<c10d::Work> NcclRulesBackend::endCoalescing() {
  TORCH_CHECK(coalescing_, "nccl_rules: endCoalescing() without startCoalescing()");
  coalescing_ = false;
  int parts = 0;
  for (auto& [peer, item] : coalesced_) parts += static_cast<int>(item.size());
  auto group = c10::make_intrusive<NcclRulesWork>(
      getRank(), c10d::OpType::COALESCED, "a coalesced group of " + std::to_string(parts) + " operations",
      [](const std::string&) { return std::string("holds the group's operations"); }, parts);
  for (auto& [peer, item] : coalesced_) {
    // Each operation's own work completes the group's part too.
    for (auto& op : item) {
      op.work->getFuture()->addCallback([group](c10::ivalue::Future& f) {
        group->partDone(f.hasError() ? f.exception_ptr() : nullptr);
      });
    }
    auto& state = peers_.at(peer);
    {
      std::lock_guard<std::mutex> lock(state->mutex);
      state->queue.push_back(std::move(item));
    }
    state->cv.notify_all();
  }
  coalesced_.clear();
  return group;
}

void NcclRulesBackend::runPeer(int peer) {
  auto& state = *peers_[peer];
  std::exception_ptr broken;  // after a failure the pair's order is lost: fail what follows
  for (;;) {
    Item item;
    {
      std::unique_lock<std::mutex> lock(state.mutex);
      state.cv.wait(lock, [&] { return state.stop || !state.queue.empty(); });
      if (state.stop) {
        for (auto& queued : state.queue) {
          for (auto& op : queued) {
            op.work->partDone(std::make_exception_ptr(c10::Error(
                {__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                "nccl_rules: " + op.work->description() + " was still queued when the group was destroyed")));
          }
        }
        state.queue.clear();
        return;
      }
      item = std::move(state.queue.front());
      state.queue.pop_front();
      state.head = describe(item.front(), peer) + (item.size() > 1 ? " and its coalesced group" : "");
    }
    if (broken) {
      for (auto& op : item) op.work->partDone(broken);
    } else {
      try {
        runItem(peer, item);
      } catch (...) {
        broken = std::current_exception();
        for (auto& op : item) {
          if (!op.work->isCompleted()) op.work->partDone(broken);
        }
      }
    }
    std::lock_guard<std::mutex> lock(state.mutex);
    state.head.clear();
    state.inFlight.clear();
  }
}

void NcclRulesBackend::runItem(int peer, Item& item) {
  auto& state = *peers_[peer];
  auto post = [&](c10::intrusive_ptr<c10d::Work> work) {
    std::lock_guard<std::mutex> lock(state.mutex);
    TORCH_CHECK(!state.stop, "nccl_rules: the group is being destroyed");
    state.inFlight.push_back(work);
    return work;
  };
  // Sends post header and data at once (they move when the peer posts its
  // receives); receives post their headers, then their data once checked.
  std::vector<c10::intrusive_ptr<c10d::Work>> sends(item.size()), headers(item.size()), data(item.size());
  std::vector<at::Tensor> headerBuffers(item.size());
  for (size_t n = 0; n < item.size(); ++n) {
    Op& op = item[n];
    if (op.send) {
      at::Tensor header = at::empty({kHeaderWords}, at::kLong);
      auto* w = header.data_ptr<int64_t>();
      w[0] = kMagic;
      w[1] = op.tensor.numel() * op.tensor.element_size();
      w[2] = static_cast<int64_t>(op.tensor.scalar_type());
      w[3] = op.index;
      std::vector<at::Tensor> one{header};
      headers[n] = post(gloo_->send(one, peer, kTag));
      std::vector<at::Tensor> payload{asBytes(op.tensor)};
      sends[n] = post(gloo_->send(payload, peer, kTag));
    } else {
      headerBuffers[n] = at::empty({kHeaderWords}, at::kLong);
      std::vector<at::Tensor> one{headerBuffers[n]};
      headers[n] = post(gloo_->recv(one, peer, kTag));
    }
  }
  for (size_t n = 0; n < item.size(); ++n) {
    Op& op = item[n];
    if (op.send) continue;
    headers[n]->wait(timeout_);
    const auto* w = headerBuffers[n].data_ptr<int64_t>();
    const int64_t bytes = op.tensor.numel() * op.tensor.element_size();
    const auto dtype = op.tensor.scalar_type();
    const bool match = w[0] == kMagic && w[1] == bytes && w[2] == static_cast<int64_t>(dtype);
    // Drain a mismatched message into scratch so the pair stays in step and
    // nothing aborts; the receive then fails with both sides' values.
    at::Tensor target = match ? asBytes(op.tensor) : at::empty({std::max<int64_t>(w[1], 0)}, at::kByte);
    std::vector<at::Tensor> one{target};
    data[n] = post(gloo_->recv(one, peer, kTag));
    if (!match) {
      data[n]->wait(timeout_);
      std::ostringstream message;
      message << "nccl_rules: rank " << getRank() << ": " << op.work->description()
              << " met rank " << peer << "'s send #" << w[3] << " of "
              << bytesOf(w[1], static_cast<at::ScalarType>(w[2]))
              << "; NCCL matches the k-th send with the k-th receive by position alone, so the "
                 "two ends issue their operations in different orders (or with different shapes)";
      op.work->partDone(std::make_exception_ptr(
          c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, message.str())));
      data[n].reset();
    }
  }
  for (size_t n = 0; n < item.size(); ++n) {
    Op& op = item[n];
    if (op.send) {
      headers[n]->wait(timeout_);
      sends[n]->wait(timeout_);
      op.work->partDone();
    } else if (data[n]) {
      data[n]->wait(timeout_);
      op.work->partDone();
    }
  }
}

// ---------------------------------------------------------------------------- collectives

c10::intrusive_ptr<c10d::Work> NcclRulesBackend::broadcast(std::vector<at::Tensor>& t,
                                                            const c10d::BroadcastOptions& o) {
  return gloo_->broadcast(t, o);
}
c10::intrusive_ptr<c10d::Work> NcclRulesBackend::allreduce(std::vector<at::Tensor>& t,
                                                            const c10d::AllreduceOptions& o) {
  return gloo_->allreduce(t, o);
}
c10::intrusive_ptr<c10d::Work> NcclRulesBackend::allreduce_coalesced(
    std::vector<at::Tensor>& t, const c10d::AllreduceCoalescedOptions& o) {
  return gloo_->allreduce_coalesced(t, o);
}
c10::intrusive_ptr<c10d::Work> NcclRulesBackend::reduce(std::vector<at::Tensor>& t,
                                                         const c10d::ReduceOptions& o) {
  return gloo_->reduce(t, o);
}
c10::intrusive_ptr<c10d::Work> NcclRulesBackend::allgather(std::vector<std::vector<at::Tensor>>& out,
                                                            std::vector<at::Tensor>& in,
                                                            const c10d::AllgatherOptions& o) {
  return gloo_->allgather(out, in, o);
}
c10::intrusive_ptr<c10d::Work> NcclRulesBackend::_allgather_base(at::Tensor& out, at::Tensor& in,
                                                                  const c10d::AllgatherOptions& o) {
  return gloo_->_allgather_base(out, in, o);
}
c10::intrusive_ptr<c10d::Work> NcclRulesBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
    const c10d::AllgatherOptions& o) {
  return gloo_->allgather_coalesced(out, in, o);
}
c10::intrusive_ptr<c10d::Work> NcclRulesBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& out, std::vector<at::Tensor>& in, const c10d::AllgatherOptions& o) {
  return gloo_->allgather_into_tensor_coalesced(out, in, o);
}
c10::intrusive_ptr<c10d::Work> NcclRulesBackend::gather(std::vector<std::vector<at::Tensor>>& out,
                                                         std::vector<at::Tensor>& in,
                                                         const c10d::GatherOptions& o) {
  return gloo_->gather(out, in, o);
}
c10::intrusive_ptr<c10d::Work> NcclRulesBackend::scatter(std::vector<at::Tensor>& out,
                                                          std::vector<std::vector<at::Tensor>>& in,
                                                          const c10d::ScatterOptions& o) {
  return gloo_->scatter(out, in, o);
}
c10::intrusive_ptr<c10d::Work> NcclRulesBackend::reduce_scatter(std::vector<at::Tensor>& out,
                                                                 std::vector<std::vector<at::Tensor>>& in,
                                                                 const c10d::ReduceScatterOptions& o) {
  return gloo_->reduce_scatter(out, in, o);
}
c10::intrusive_ptr<c10d::Work> NcclRulesBackend::_reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                                       const c10d::ReduceScatterOptions& o) {
  return gloo_->_reduce_scatter_base(out, in, o);
}
c10::intrusive_ptr<c10d::Work> NcclRulesBackend::alltoall_base(at::Tensor& out, at::Tensor& in,
                                                                std::vector<int64_t>& outSplits,
                                                                std::vector<int64_t>& inSplits,
                                                                const c10d::AllToAllOptions& o) {
  return gloo_->alltoall_base(out, in, outSplits, inSplits, o);
}
c10::intrusive_ptr<c10d::Work> NcclRulesBackend::alltoall(std::vector<at::Tensor>& out,
                                                           std::vector<at::Tensor>& in,
                                                           const c10d::AllToAllOptions& o) {
  return gloo_->alltoall(out, in, o);
}
c10::intrusive_ptr<c10d::Work> NcclRulesBackend::barrier(const c10d::BarrierOptions& o) {
  return gloo_->barrier(o);
}
void NcclRulesBackend::monitoredBarrier(const c10d::BarrierOptions& o, bool waitAllRanks) {
  gloo_->monitoredBarrier(o, waitAllRanks);
}
void NcclRulesBackend::setSequenceNumberForGroup() { gloo_->setSequenceNumberForGroup(); }
uint64_t NcclRulesBackend::getSequenceNumberForGroup() { return gloo_->getSequenceNumberForGroup(); }

}  // namespace pipedream
