#include "runtime/executor.h"

#include <c10/util/Exception.h>
#include <ATen/ThreadLocalState.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <climits>
#include <optional>
#include <thread>

#include "core/pairs.h"

namespace pipedream {

namespace {

constexpr int kForwardDir = 0;   // activations j -> j+1, keyed by j
constexpr int kBackwardDir = 1;  // gradients j+1 -> j, keyed by j

using Clock = std::chrono::steady_clock;

}  // namespace

namespace {

// Checks the rank first: receipt points are computed for it.
TransferLedger makeLedger(const Schedule& schedule, int rank, const ScheduleTraits& traits) {
  TORCH_CHECK(rank >= 0 && rank < schedule.numRanks(), "rank ", rank,
              " is out of range for a schedule of ", schedule.numRanks(), " ranks");
  if (traits.streaming) return TransferLedger::forStreaming(schedule.numRanks());
  return TransferLedger::forFlush(sendReleasePoints(schedule, rank));
}

}  // namespace

PipelineExecutor::PipelineExecutor(Schedule schedule, int rank, std::shared_ptr<CommEngine> engine,
                                   ForwardFn forward,
                                   std::map<int, std::vector<at::Tensor>> stageParameters,
                                   UpdateFn update,
                                   std::map<int, c10::intrusive_ptr<c10d::ProcessGroup>> replicaGroups,
                                   bool recompute, bool overlap, PairFn pair)
    : schedule_(std::move(schedule)),
      traits_(scheduleTraits(schedule_.name())),
      rank_(rank),
      engine_(std::move(engine)),
      forward_(std::move(forward)),
      update_(std::move(update)),
      stageParameters_(std::move(stageParameters)),
      replicaGroups_(std::move(replicaGroups)),
      recompute_(recompute),
      overlap_(overlap),
      pair_(std::move(pair)),
      ledger_(makeLedger(schedule_, rank_, traits_)) {
  // The schedule must be lowered (lower()); a single stage has nothing to send,
  // so that cannot be told from the actions.
  TORCH_CHECK(schedule_.numStages() < 1024, "at most 1023 stages are supported (got ",
              schedule_.numStages(), ")");
  TORCH_CHECK(!traits_.stashWeights || update_, "schedule '", traits_.name,
              "' stashes weights and steps the optimizer itself: it needs an update callback");
  TORCH_CHECK(!traits_.streaming || engine_->protocol() == P2PProtocol::kSplit,
              "schedule '", traits_.name, "' streams: its transfers need the split protocol (got '",
              protocolName(engine_->protocol()), "')");
  if (!traits_.streaming) {
    list_ = schedule_.actions(rank_);
    try {  // both ends of every pair must issue its transfers in one order
      validateChannels(schedule_);
    } catch (const std::invalid_argument& e) {
      TORCH_CHECK(false, "rank ", rank_, ": the schedule's transfer order is not safe: ", e.what(),
                  "; order_transfers() gives one that is");
    }
  }
  lastStage_ = schedule_.numStages() - 1;
  TORCH_CHECK(!overlap_ || (!traits_.stashWeights && !traits_.streaming), "schedule '",
              traits_.name, "' stashes weights or streams: its F&B pairs cannot be overlapped");
  if (traits_.stashWeights) {
    for (const auto& [stage, params] : stageParameters_) stores_.emplace(stage, WeightStore(params));
  }
}

std::string PipelineExecutor::describe(const char* what, int stage, int microbatch) const {
  return std::string(what) + " of microbatch " + std::to_string(microbatch) + " for stage " +
         std::to_string(stage);
}

void PipelineExecutor::account(const std::string& kind, const std::string& name, const char* category,
                               TimePoint start, bool isWait) {
  accountSpan(kind, name, category, start, Clock::now(), isWait);
}

void PipelineExecutor::accountSpan(const std::string& kind, const std::string& name,
                                   const char* category, TimePoint start, TimePoint end, bool isWait) {
  const double seconds = std::chrono::duration<double>(end - start).count();
  stats_.secondsByKind[kind] += seconds;
  if (isWait) {
    stats_.waitSeconds += seconds;
  } else if (std::string(category) == "compute" || std::string(category) == "update") {
    stats_.computeSeconds += seconds;
  }
  if (!actionLogging_) return;
  if (actionLog_.size() >= kMaxActionLogEntries) {
    ++droppedActionLogEntries_;
    return;
  }
  using namespace std::chrono;
  // The span's end on the wall clock: now, less how long ago it ended.
  const auto wallEnd = duration_cast<microseconds>(system_clock::now().time_since_epoch()).count() -
                       duration_cast<microseconds>(Clock::now() - end).count();
  const auto durationUs = duration_cast<microseconds>(end - start).count();
  actionLog_.push_back(ActionLogEntry{name, category, wallEnd - durationUs, durationUs});
}

std::vector<ActionLogEntry> PipelineExecutor::takeActionLog() {
  std::vector<ActionLogEntry> out;
  out.swap(actionLog_);
  return out;
}

void PipelineExecutor::checkSignature(int stage, int microbatch,
                                      const std::vector<at::Tensor>& received) {
  // Shapes are free: any dimension may change between microbatches and steps
  // (the header carries them; the engine's prediction is only a guess). What
  // the stage's forward is written against stays a rule: how many tensors it
  // gets and, per position, the dtype (a floating dtype may become another
  // one: autocast switched on or off, evaluation in another precision).
  const auto metas = metasOf(received);
  auto it = signatures_.find(stage);
  if (it == signatures_.end()) {
    signatures_.emplace(stage, metas);
    return;
  }
  auto describeAll = [](const std::vector<TensorMeta>& list) {
    std::string out;
    for (const auto& m : list) out += (out.empty() ? "" : ", ") + m.toString();
    return std::to_string(list.size()) + (list.size() == 1 ? " tensor (" : " tensors (") + out + ")";
  };
  bool same = it->second.size() == metas.size();
  for (size_t k = 0; same && k < metas.size(); ++k) {
    const auto a = it->second[k].dtype;
    const auto b = metas[k].dtype;
    same = a == b || (at::isFloatingType(a) && at::isFloatingType(b));
  }
  TORCH_CHECK(same, "rank ", rank_, ": ", describe("RECV_F", stage, microbatch), ": rank ",
              schedule_.layout().rankFor(stage - 1, microbatch), " sent ", describeAll(metas),
              " but stage ", stage, " was first given ", describeAll(it->second),
              "; shapes may change from step to step, but the number of tensors a stage passes "
              "and their dtypes may not");
}

std::vector<at::Tensor> PipelineExecutor::receive(const Key& key, int direction) {
  auto& posted = direction == kForwardDir ? recvF_ : recvB_;
  auto it = posted.find(key);
  TORCH_CHECK(it != posted.end(), "rank ", rank_, ": no receive was posted for ",
              describe(direction == kForwardDir ? "RECV_F" : "RECV_B", key.first, key.second));
  auto transfer = it->second;
  posted.erase(it);
  const auto start = Clock::now();
  transfer->wait(engine_->timeout());
  const Action received = Action::comm(
      key.first, direction == kForwardDir ? ActionKind::kRecvForward : ActionKind::kRecvBackward, key.second);
  account(kindToken(received.kind), received.toString(), "wait", start, true);
  auto tensors = transfer->tensors();
  // Gradients are checked against the stashed outputs they are for, at B.
  if (direction == kForwardDir) checkSignature(key.first, key.second, tensors);
  return tensors;
}

void PipelineExecutor::recomputeForward(const Action& a, Stash& s) {
  // Re-run the forward on the stashed inputs and weight version with the
  // RNG state the first forward saw (dropout draws the same masks).
  const RngState now = s.rngState.swapIn();
  std::vector<at::Tensor> weights;
  if (traits_.stashWeights) weights = stores_.at(a.stage).acquire(s.version);
  s.outputs = forward_(a.stage, a.microbatch, s.inputs, weights);
  if (traits_.stashWeights) stores_.at(a.stage).release(s.version);
  now.swapIn();
  s.rngState = RngState();
}

void PipelineExecutor::gradientRoots(const Action& a, const Stash& s, std::vector<at::Tensor>& roots,
                                     std::vector<at::Tensor>& grads) const {
  if (a.stage == lastStage_) {
    roots = {s.outputs.at(0)};
    grads = {at::Tensor()};
    return;
  }
  // The gradient of an activation must have that activation's shape, whatever
  // shapes this step uses: checked here against the stash, so a peer running
  // another model or split is named instead of failing inside autograd.
  TORCH_CHECK(s.gradOutputs.size() == s.outputs.size(), "rank ", rank_, ": ",
              describe("RECV_B", a.stage, a.microbatch), ": rank ",
              schedule_.layout().rankFor(a.stage + 1, a.microbatch), " sent ",
              s.gradOutputs.size(), " gradients for the ", s.outputs.size(), " outputs of stage ",
              a.stage, "; every rank must run the same model, balance and schedule");
  for (size_t k = 0; k < s.outputs.size(); ++k) {
    if (!s.outputs[k].requires_grad()) continue;
    TORCH_CHECK(s.gradOutputs[k].defined(), "stage ", a.stage, " microbatch ", a.microbatch,
                ": missing gradient for output ", k);
    const auto& out = s.outputs[k];
    const auto& grad = s.gradOutputs[k];
    // A peer running another split or model would otherwise surface as an
    // autograd shape error without saying who sent what.
    TORCH_CHECK(grad.sizes() == out.sizes() && at::isFloatingType(grad.scalar_type()), "rank ",
                rank_, ": ", describe("RECV_B", a.stage, a.microbatch), ": rank ",
                schedule_.layout().rankFor(a.stage + 1, a.microbatch), " sent a gradient ",
                TensorMeta{grad.scalar_type(), grad.sizes().vec()}.toString(), " for output ", k,
                " of ", TensorMeta{out.scalar_type(), out.sizes().vec()}.toString(),
                "; every rank must run the same model, balance and schedule");
    roots.push_back(out);
    grads.push_back(grad);
  }
}

std::vector<at::Tensor> PipelineExecutor::inputGradients(const Action& a, Stash& s,
                                                         const std::vector<at::Tensor>& roots,
                                                         const std::vector<at::Tensor>& grads,
                                                         bool inputOnly) {
  if (inputOnly) {
    static const std::vector<at::Tensor> kNoWeights;
    auto params = stageParameters_.find(a.stage);
    return SplitBackward::inputPass(roots, grads, s.inputs,
                                    params != stageParameters_.end() ? params->second : kNoWeights,
                                    s.split);
  }
  if (!roots.empty()) torch::autograd::backward(roots, grads);
  return leafGradients(s);
}

std::vector<at::Tensor> PipelineExecutor::leafGradients(const Stash& s) {
  std::vector<at::Tensor> gradInputs(s.inputs.size());
  for (size_t k = 0; k < s.inputs.size(); ++k) {
    if (s.inputs[k].requires_grad()) gradInputs[k] = s.inputs[k].grad();
  }
  return gradInputs;
}

void PipelineExecutor::keepInputGradients(const Action& a, const Stash& s,
                                          std::vector<at::Tensor> gradInputs) {
  if (a.stage == 0) return;  // nobody upstream
  // Float inputs without a gradient get zeros; others an empty marker.
  for (size_t k = 0; k < gradInputs.size(); ++k) {
    if (!gradInputs[k].defined()) {
      gradInputs[k] = at::isFloatingType(s.inputs[k].scalar_type())
                          ? at::zeros_like(s.inputs[k])
                          : at::empty({0}, s.inputs[k].options().dtype(at::kFloat));
    }
  }
  if (schedule_.layout().rankFor(a.stage - 1, a.microbatch) == rank_) {
    localGrads_[{a.stage - 1, a.microbatch}] = std::move(gradInputs);
  } else {
    inputGrads_[{a.stage, a.microbatch}] = std::move(gradInputs);
  }
}

PipelineExecutor::Stash& PipelineExecutor::stashOf(const Action& a) {
  auto it = stash_.find({a.stage, a.microbatch});
  TORCH_CHECK(it != stash_.end(), "rank ", rank_, ": ", a.toString(),
              " has no stashed forward (schedule bug)");
  return it->second;
}

void PipelineExecutor::prepareBackward(const Action& a, Stash& s, std::vector<at::Tensor>& roots,
                                       std::vector<at::Tensor>& grads) {
  if (recompute_ && s.rngState.defined()) recomputeForward(a, s);
  // Roots: outputs that require grad, with their gradients.
  gradientRoots(a, s, roots, grads);
}

void PipelineExecutor::releaseStash(const Action& a) {
  if (traits_.stashWeights) {
    auto& store = stores_.at(a.stage);
    store.moveGradsToLive(stash_.at({a.stage, a.microbatch}).version);
    store.release(stash_.at({a.stage, a.microbatch}).version);
  }
  stash_.erase({a.stage, a.microbatch});
}

void PipelineExecutor::differentiate(const Action& a, bool inputOnly, bool weightOnly) {
  Stash& s = stashOf(a);
  if (weightOnly) {
    s.split.weightPass();  // from the gradients I captured: no input path again
  } else {
    std::vector<at::Tensor> roots, grads;
    prepareBackward(a, s, roots, grads);
    keepInputGradients(a, s, inputGradients(a, s, roots, grads, inputOnly));
    if (inputOnly) return;  // keep the stash (graph retained) for W
  }
  releaseStash(a);
}

int PipelineExecutor::oldestFutureRead(int stage, size_t from) const {
  for (size_t k = from; k < list_.size(); ++k) {
    const Action& a = list_[k];
    if (a.kind == ActionKind::kForward && a.stage == stage) return a.version;
  }
  return INT_MAX;
}

void PipelineExecutor::updateAction(const Action& a, size_t index) {
  // Flush schedules: the caller steps its optimizer after run().
  if (traits_.updateRule == UpdateRule::kCallerPerBatch) return;
  auto& store = stores_.at(a.stage);
  const int oldest = oldestFutureRead(a.stage, index + 1);
  store.beforeUpdate(oldest);
  update_(a.stage, a.version);
  store.afterUpdate(a.version, oldest);
}

void PipelineExecutor::allReduceAction(const Action& a) {
  // A flush executor without the stage's group (evaluation over the leaders)
  // has nothing to reduce; a stashing one must have it.
  if (!traits_.stashWeights && !replicaGroups_.count(a.stage)) return;
  auto group = replicaGroups_.find(a.stage);
  TORCH_CHECK(group != replicaGroups_.end(), "rank ", rank_, ": ", a.toString(),
              " needs the process group of stage ", a.stage, "'s replicas");
  auto params = stageParameters_.find(a.stage);
  if (params == stageParameters_.end()) return;
  std::vector<at::Tensor> grads;
  for (const auto& p : params->second) {
    if (!p.requires_grad()) continue;
    at::Tensor& g = const_cast<at::Tensor&>(p).mutable_grad();
    if (!g.defined()) g = at::zeros_like(p);
    grads.push_back(g);
  }
  if (grads.empty()) return;
  // One flat buffer: one collective per update, not one per tensor.
  at::Tensor flat = at::cat([&] {
    std::vector<at::Tensor> views;
    for (const auto& g : grads) views.push_back(g.reshape({-1}));
    return views;
  }());
  std::vector<at::Tensor> buffers{flat};
  const auto start = Clock::now();
  auto work = group->second->allreduce(buffers);
  try {
    work->wait(engine_->timeout());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "rank ", rank_, ": ", a.toString(), " (gradient all-reduce among the ",
                group->second->getSize(), " replicas of stage ", a.stage,
                ") failed or timed out: ", e.what());
  }
  account("ALLREDUCE", a.toString(), "allreduce", start, true);
  if (traits_.replicaReduction == ReplicaReduction::kMean) flat.div_(group->second->getSize());
  int64_t offset = 0;
  for (auto& g : grads) {
    g.copy_(flat.narrow(0, offset, g.numel()).view_as(g));
    offset += g.numel();
  }
}

void PipelineExecutor::releaseSends(const std::vector<TransferId>& ids) {
  for (TransferId id : ids) {
    auto it = sends_.find(id);
    if (it == sends_.end()) continue;
    it->second->wait(engine_->timeout());
    sends_.erase(it);
  }
}

void PipelineExecutor::reset() {
  next_ = 0;
  ledger_.clear();
  sends_.clear();
  stash_.clear();
  inputGrads_.clear();
  localActivations_.clear();
  localGrads_.clear();
  recvF_.clear();
  recvB_.clear();
}

void PipelineExecutor::releaseCommunication() {
  recvF_.clear();
  recvB_.clear();
  sends_.clear();
  replicaGroups_.clear();
  engine_.reset();
}

void PipelineExecutor::waitSends() {
  if (ledger_.sendsInFlight() == 0) return;
  const auto start = Clock::now();
  releaseSends(ledger_.releaseAll());
  account("SEND_WAIT", "wait for sends", "wait", start, true);
}

PipelineExecutor::Results PipelineExecutor::runList(const std::vector<std::vector<at::Tensor>>& inputs,
                                                     bool forwardOnly) {
  const auto begin = Clock::now();
  reset();
  Results results;
  execute(0, list_.size(),
          [&inputs](int i) { return i < static_cast<int>(inputs.size()) ? &inputs[i] : nullptr; },
          forwardOnly, results);
  waitSends();
  if (forwardOnly) {
    stash_.clear();  // forward-only stashes nothing a backward will read
  } else {
    TORCH_CHECK(stash_.empty(), "rank ", rank_, ": ", stash_.size(),
                " microbatches still stashed at the end of the step (schedule bug)");
  }
  next_ = list_.size();
  stats_.busySeconds += std::chrono::duration<double>(Clock::now() - begin).count();
  ++stats_.steps;
  return results;
}

std::vector<at::Tensor> PipelineExecutor::run(const std::vector<std::vector<at::Tensor>>& inputs) {
  std::vector<at::Tensor> losses(schedule_.totalMicrobatches());
  for (auto& [i, out] : runList(inputs, /*forwardOnly=*/false)) losses[i] = out.empty() ? at::Tensor() : out[0];
  return losses;
}

std::vector<std::vector<at::Tensor>> PipelineExecutor::runForward(
    const std::vector<std::vector<at::Tensor>>& inputs) {
  at::NoGradGuard noGrad;
  std::vector<std::vector<at::Tensor>> outputs(schedule_.totalMicrobatches());
  for (auto& [i, out] : runList(inputs, /*forwardOnly=*/true)) outputs[i] = std::move(out);
  return outputs;
}

std::map<int, at::Tensor> PipelineExecutor::runUntil(
    size_t end, const std::map<int, std::vector<at::Tensor>>& inputs) {
  TORCH_CHECK(end >= next_ && end <= list_.size(), "runUntil(", end, ") outside [", next_, ", ",
              list_.size(), "]");
  const auto begin = Clock::now();
  Results results;
  execute(next_, end,
          [&inputs](int i) {
            auto it = inputs.find(i);
            return it == inputs.end() ? nullptr : &it->second;
          },
          /*forwardOnly=*/false, results);
  next_ = end;
  const auto beyond = ledger_.releaseBeyondBound();
  if (!beyond.empty()) {
    const auto start = Clock::now();
    releaseSends(beyond);
    account("SEND_WAIT", "wait for sends", "wait", start, true);
  }
  stats_.busySeconds += std::chrono::duration<double>(Clock::now() - begin).count();
  ++stats_.steps;
  std::map<int, at::Tensor> losses;
  for (auto& [i, out] : results) losses[i] = out.at(0);
  return losses;
}

void PipelineExecutor::appendActions(const std::vector<Action>& actions) {
  if (next_ >= 256) {  // drop what already ran: constant memory over a long stream
    list_.erase(list_.begin(), list_.begin() + static_cast<std::ptrdiff_t>(next_));
    dropped_ += next_;
    next_ = 0;
  }
  list_.insert(list_.end(), actions.begin(), actions.end());
}

RuntimeStats PipelineExecutor::stats() const {
  RuntimeStats out = stats_;
  const auto& c = engine_->counters();
  out.bytesSent = c.bytesSent;
  out.bytesReceived = c.bytesReceived;
  out.sends = c.sends;
  out.receives = c.receives;
  out.messagesSent = c.messagesSent;
  out.prePostedReceives = c.prePostedReceives;
  out.redirectedSends = c.redirectedSends;
  out.paddingBytes = c.paddingBytes;
  out.hostSyncs = c.hostSyncs;
  for (const auto& [stage, store] : stores_) {
    out.peakWeightVersions[stage] = store.peakLiveVersions();
    out.weightBytesCopied += store.bytesCopied();
  }
  return out;
}

void PipelineExecutor::resetStats() {
  stats_ = RuntimeStats{};
  engine_->resetCounters();
  for (auto& [stage, store] : stores_) {
    store.resetBytesCopied();
    store.resetPeak();
  }
}

void PipelineExecutor::postReceive(const Action& a) {
  // Where orderTransfers() put it: the pair's order, ahead of the consumer.
  const Layout& layout = schedule_.layout();
  const bool forward = a.kind == ActionKind::kRecvForward;
  const int peer = layout.rankFor(forward ? a.stage - 1 : a.stage + 1, a.microbatch);
  auto& posted = forward ? recvF_ : recvB_;
  posted[{a.stage, a.microbatch}] =
      engine_->recv(peer, TransferKey::of(a), describe(forward ? "RECV_F" : "RECV_B", a.stage, a.microbatch));
}

void PipelineExecutor::execute(size_t begin, size_t end, const InputFn& inputOf, bool forwardOnly,
                               Results& results) {
  for (size_t index = begin; index < end; ++index) {
    const Action& a = list_[index];
    if (forwardOnly && a.kind != ActionKind::kForward && a.kind != ActionKind::kSendForward &&
        a.kind != ActionKind::kRecvForward) {
      continue;
    }
    if (overlap_ && !forwardOnly && index + 1 < end && startsPair(list_, index)) {
      pairAction(index, inputOf, results);  // accounts both halves itself
      stats_.actions += 2;
      afterAction(index);
      afterAction(++index);
      continue;
    }
    auto start = Clock::now();
    switch (a.kind) {
      case ActionKind::kForward: forwardAction(a, inputOf, forwardOnly, results, start); break;
      case ActionKind::kSendForward: sendForwardAction(a, index, forwardOnly); break;
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput:
      case ActionKind::kBackwardWeight: backwardAction(a, start); break;
      case ActionKind::kSendBackward: sendBackwardAction(a, index); break;
      case ActionKind::kUpdate: updateAction(a, index); break;
      case ActionKind::kAllReduce: allReduceAction(a); break;
      case ActionKind::kRecvForward:
      case ActionKind::kRecvBackward: postReceive(a); break;  // consumers wait for them
    }
    accountAction(a, start);
    afterAction(index);
  }
}

void PipelineExecutor::afterAction(size_t index) {
  if (ledger_.isReceiptPoint(static_cast<size_t>(idOf(index)))) {
    // The schedule proves these arrived (csrc/core/receipt.h): each wait
    // returns at once, and the buffers go now rather than at the step's end.
    const auto releaseStart = Clock::now();
    releaseSends(ledger_.releaseAtReceiptPoint(static_cast<size_t>(idOf(index))));
    account("SEND_WAIT", "wait for sends", "wait", releaseStart, true);
  }
  stats_.peakSendsInFlight =
      std::max(stats_.peakSendsInFlight, static_cast<int64_t>(ledger_.sendsInFlight()));
}

void PipelineExecutor::pairAction(size_t index, const InputFn& inputOf, Results& results) {
  const Action& f = list_[index];
  const Action& b = list_[index + 1];
  // Both halves' inputs first, F's then B's, as DualPipe's runtime waits for them.
  TimePoint start = Clock::now();
  std::vector<at::Tensor> in = forwardInputs(f, inputOf, false, start);
  RngState rngState;
  if (recompute_) rngState = RngState::capture(engine_->device());
  takeGradOutputs(b, start);
  Stash& s = stashOf(b);
  std::vector<at::Tensor> roots, grads, out, gradInputs;
  start = Clock::now();
  prepareBackward(b, s, roots, grads);  // a recompute runs here, whole, restoring the RNG state
  if (pair_) {
    out = pair_(f.stage, f.microbatch, in, b.stage, b.microbatch, roots, grads);
    gradInputs = leafGradients(s);
    accountSpan("F&B", f.toString() + "&" + b.toString(), "compute", start, Clock::now(), false);
  } else {
    accountSpan(kindToken(b.kind), b.toString(), "compute", start, Clock::now(), false);
    runTurns(f, in, out, b, s, roots, grads, gradInputs);
  }
  keepForward(f, std::move(in), std::move(out), std::move(rngState), false, results);
  keepInputGradients(b, s, std::move(gradInputs));
  releaseStash(b);
}

void PipelineExecutor::runTurns(const Action& f, const std::vector<at::Tensor>& in,
                                std::vector<at::Tensor>& out, const Action& b, const Stash& s,
                                const std::vector<at::Tensor>& roots,
                                const std::vector<at::Tensor>& grads,
                                std::vector<at::Tensor>& gradInputs) {
  OverlapTurn turn(engine_->timeout());
  OverlapTurn::setActive(&turn);
  const at::ThreadLocalState state;  // grad mode, autocast, dispatch modes of this thread
  // The caller's current stream on the pipeline's device: a thread's own starts as the default.
  std::optional<c10::Stream> stream;
  const at::Device device = engine_->device();
  if (!device.is_cpu()) stream = c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
  std::exception_ptr forwardError, backwardError;
  std::thread forwardThread([&] {
    try {
      at::ThreadLocalStateGuard guard(state);
      c10::OptionalStreamGuard streamGuard;
      if (stream) streamGuard.reset_stream(*stream);
      out = callForward(f, in, {}, false);
    } catch (...) {
      forwardError = std::current_exception();
    }
    turn.finish(OverlapTurn::Role::kForward);
  });
  try {
    turn.waitFor(OverlapTurn::Role::kBackward);
    if (!roots.empty()) torch::autograd::backward(roots, grads);
    gradInputs = leafGradients(s);
  } catch (...) {
    backwardError = std::current_exception();
  }
  turn.finish(OverlapTurn::Role::kBackward);
  forwardThread.join();
  OverlapTurn::setActive(nullptr);
  for (const auto& segment : turn.segments()) {
    const Action& a = segment.role == OverlapTurn::Role::kForward ? f : b;
    accountSpan(kindToken(a.kind), a.toString(), "compute", segment.start, segment.end, false);
  }
  stats_.overlapYields += turn.yields();
  if (forwardError) std::rethrow_exception(forwardError);
  if (backwardError) std::rethrow_exception(backwardError);
}

void PipelineExecutor::accountAction(const Action& a, TimePoint start) {
  ++stats_.actions;
  if (isCompute(a.kind)) {
    account(kindToken(a.kind), a.toString(), "compute", start, false);
  } else if (a.kind == ActionKind::kSendForward || a.kind == ActionKind::kSendBackward) {
    account(kindToken(a.kind), a.toString(), "send", start, false);
  } else if (a.kind == ActionKind::kUpdate && traits_.updateRule != UpdateRule::kCallerPerBatch) {
    account("U", a.toString(), "update", start, false);
  } else if (a.kind == ActionKind::kRecvForward || a.kind == ActionKind::kRecvBackward) {
    // Posting a receive costs the rank a buffer and a socket write (Gloo tells
    // the sender the buffer is ready): a transfer's cost like posting a send.
    // Named apart from the wait ("1RECV_F0"), which a trace pairs with its send.
    account("RECV_POST", "post " + a.toString(), "post", start, false);
  }
}

std::vector<at::Tensor> PipelineExecutor::forwardInputs(const Action& a, const InputFn& inputOf,
                                                        bool forwardOnly, TimePoint& start) {
  std::vector<at::Tensor> in;
  if (a.stage == 0) {
    const auto* given = inputOf(a.microbatch);
    TORCH_CHECK(given != nullptr, "rank ", rank_, " holds stage 0 but has no inputs for ",
                a.toString(), " (microbatch ", a.microbatch, ")");
    return *given;
  }
  const Key upstream{a.stage - 1, a.microbatch};
  if (schedule_.layout().rankFor(a.stage - 1, a.microbatch) == rank_) {
    in = std::move(localActivations_.at(upstream));
    localActivations_.erase(upstream);
  } else {
    in = receive({a.stage, a.microbatch}, kForwardDir);
    start = Clock::now();
  }
  for (auto& t : in) {  // fresh leaves: this stage's backward stops here
    t = t.detach();
    if (!forwardOnly && at::isFloatingType(t.scalar_type())) t.requires_grad_(true);
  }
  return in;
}

void PipelineExecutor::forwardAction(const Action& a, const InputFn& inputOf, bool forwardOnly,
                                     Results& results, TimePoint& start) {
  std::vector<at::Tensor> in = forwardInputs(a, inputOf, forwardOnly, start);
  std::vector<at::Tensor> weights;
  if (traits_.stashWeights && !forwardOnly) weights = stores_.at(a.stage).acquire(a.version);
  RngState rngState;
  if (recompute_ && !forwardOnly) rngState = RngState::capture(engine_->device());
  std::vector<at::Tensor> out = callForward(a, in, weights, forwardOnly);
  keepForward(a, std::move(in), std::move(out), std::move(rngState), forwardOnly, results);
}

std::vector<at::Tensor> PipelineExecutor::callForward(const Action& a, const std::vector<at::Tensor>& in,
                                                      const std::vector<at::Tensor>& weights,
                                                      bool forwardOnly) {
  if (recompute_ && !forwardOnly) {
    at::NoGradGuard noGrad;
    return forward_(a.stage, a.microbatch, in, weights);
  }
  return forward_(a.stage, a.microbatch, in, weights);
}

void PipelineExecutor::keepForward(const Action& a, std::vector<at::Tensor> in,
                                   std::vector<at::Tensor> out, RngState rngState, bool forwardOnly,
                                   Results& results) {
  const Key key{a.stage, a.microbatch};
  const bool sendsLater = a.stage != lastStage_ &&
                          schedule_.layout().rankFor(a.stage + 1, a.microbatch) != rank_;
  if (a.stage == lastStage_) {
    if (forwardOnly) {
      results[a.microbatch] = out;
      return;
    }
    TORCH_CHECK(out.size() == 1 && out[0].numel() == 1,
                "the last stage must return one scalar loss (got ", out.size(), " tensors)");
    results[a.microbatch] = {out[0].detach()};
  } else if (!sendsLater) {
    std::vector<at::Tensor> handOver;
    for (const auto& t : out) handOver.push_back(t.detach());
    localActivations_[key] = std::move(handOver);
  }
  if (forwardOnly) {
    if (sendsLater) stash_[key] = Stash{{}, std::move(out), {}, 0, RngState()};  // until SEND_F
    return;
  }
  // With recompute, keep the outputs only until they are sent; the backward
  // recomputes them.
  if (recompute_ && !sendsLater) out.clear();
  stash_[key] = Stash{std::move(in), std::move(out), {}, a.version, rngState};
  stats_.peakActivations = std::max(stats_.peakActivations, static_cast<int64_t>(stash_.size()));
}

void PipelineExecutor::sendForwardAction(const Action& a, size_t index, bool forwardOnly) {
  const Key key{a.stage, a.microbatch};
  const auto& out = stash_.at(key).outputs;
  const TransferId id = idOf(index);
  sends_[id] = engine_->send(out, schedule_.layout().rankFor(a.stage + 1, a.microbatch),
                             TransferKey::of(a), describe("SEND_F", a.stage, a.microbatch));
  // Training: the microbatch's gradient coming back releases this send.
  ledger_.sendIssued(id, forwardOnly ? std::nullopt : std::optional<std::pair<int, int>>(key));
  if (forwardOnly) {
    stash_.erase(key);
  } else if (recompute_) {
    stash_.at(key).outputs.clear();  // the send keeps its own reference
  }
}

void PipelineExecutor::backwardAction(const Action& a, TimePoint& start) {
  if (a.kind == ActionKind::kBackwardWeight) {
    differentiate(a, false, true);
    return;
  }
  TORCH_CHECK(!traits_.stashWeights || a.kind == ActionKind::kBackward,
              "split backward (I/W) is not supported with weight stashing");
  takeGradOutputs(a, start);
  differentiate(a, a.kind == ActionKind::kBackwardInput, false);
}

void PipelineExecutor::takeGradOutputs(const Action& a, TimePoint& start) {
  if (a.stage == lastStage_) return;  // the loss: no gradient comes in
  const Key key{a.stage, a.microbatch};
  auto& s = stash_.at(key);
  if (schedule_.layout().rankFor(a.stage + 1, a.microbatch) == rank_) {
    auto local = localGrads_.find(key);
    TORCH_CHECK(local != localGrads_.end(), "rank ", rank_, ": ", a.toString(),
                " has no gradient from stage ", a.stage + 1);
    s.gradOutputs = std::move(local->second);
    localGrads_.erase(local);
    return;
  }
  s.gradOutputs = receive(key, kBackwardDir);
  if (auto sent = ledger_.releaseByGradient(a.stage, a.microbatch)) {
    // The peer has the activation by now: the wait returns at once.
    const auto releaseStart = Clock::now();
    releaseSends({*sent});
    account("SEND_WAIT", "wait for sends", "wait", releaseStart, true);
  }
  start = Clock::now();
}

void PipelineExecutor::sendBackwardAction(const Action& a, size_t index) {
  const Key key{a.stage, a.microbatch};
  auto it = inputGrads_.find(key);
  TORCH_CHECK(it != inputGrads_.end(), "rank ", rank_, ": ", a.toString(), " before its backward");
  const TransferId id = idOf(index);
  sends_[id] = engine_->send(it->second, schedule_.layout().rankFor(a.stage - 1, a.microbatch),
                             TransferKey::of(a), describe("SEND_B", a.stage, a.microbatch));
  ledger_.sendIssued(id);
  inputGrads_.erase(it);
}

}  // namespace pipedream
