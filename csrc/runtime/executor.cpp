#include "runtime/executor.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

namespace pipedream {

namespace {

constexpr int kForwardDir = 0;   // activations j -> j+1, keyed by j
constexpr int kBackwardDir = 1;  // gradients j+1 -> j, keyed by j

}  // namespace

PipelineExecutor::PipelineExecutor(Schedule schedule, int rank, std::shared_ptr<CommEngine> engine,
                                   ForwardFn forward,
                                   std::map<int, std::vector<at::Tensor>> stageParameters)
    : schedule_(std::move(schedule)),
      rank_(rank),
      engine_(std::move(engine)),
      forward_(std::move(forward)),
      stageParameters_(std::move(stageParameters)) {
  TORCH_CHECK(schedule_.isLowered(), "PipelineExecutor needs a lowered schedule (with SEND/RECV)");
  TORCH_CHECK(rank_ >= 0 && rank_ < schedule_.numRanks(), "rank ", rank_,
              " is out of range for a schedule of ", schedule_.numRanks(), " ranks");
  actions_ = &schedule_.actions(rank_);
  lastStage_ = schedule_.numStages() - 1;
}

int PipelineExecutor::tag(int direction, int boundary, int microbatch) const {
  return (direction * schedule_.numStages() + boundary) * schedule_.totalMicrobatches() + microbatch;
}

std::string PipelineExecutor::describe(const char* what, int stage, int microbatch) const {
  return std::string(what) + " of microbatch " + std::to_string(microbatch) + " for stage " +
         std::to_string(stage);
}

void PipelineExecutor::checkSignature(int direction, int stage, int microbatch,
                                      const std::vector<at::Tensor>& received) {
  std::vector<TensorMeta> metas;
  for (const auto& t : received) metas.push_back(TensorMeta{t.scalar_type(), t.sizes().vec()});
  auto key = std::make_pair(direction, stage);
  auto it = signatures_.find(key);
  if (it == signatures_.end()) {
    signatures_.emplace(key, metas);
    return;
  }
  auto describeAll = [](const std::vector<TensorMeta>& list) {
    std::string out;
    for (const auto& m : list) out += (out.empty() ? "" : ", ") + m.toString();
    return "(" + out + ")";
  };
  bool same = it->second.size() == metas.size();
  for (size_t k = 0; same && k < metas.size(); ++k) {
    const auto& a = it->second[k];
    const auto& b = metas[k];
    // The batch dimension may differ (uneven microbatches, a smaller last batch).
    same = a.dtype == b.dtype && a.shape.size() == b.shape.size() &&
           std::equal(a.shape.begin() + (a.shape.empty() ? 0 : 1), a.shape.end(),
                      b.shape.begin() + (b.shape.empty() ? 0 : 1));
  }
  TORCH_CHECK(same, "stage ", stage, " microbatch ", microbatch, ": ",
              direction == kForwardDir ? "input activations" : "output gradients",
              " changed shape or dtype: expected ", describeAll(it->second), " (first step) but got ",
              describeAll(metas),
              "; every microbatch must give a stage the same shapes apart from the batch dimension");
}

std::vector<at::Tensor> PipelineExecutor::receive(std::map<Key, std::shared_ptr<Transfer>>& posted,
                                                  const Key& key, int direction) {
  auto it = posted.find(key);
  TORCH_CHECK(it != posted.end(), "rank ", rank_, ": no receive was posted for ",
              describe(direction == kForwardDir ? "RECV_F" : "RECV_B", key.first, key.second));
  auto transfer = it->second;
  posted.erase(it);
  transfer->wait(engine_->timeout());
  auto tensors = transfer->tensors();
  checkSignature(direction, key.first, key.second, tensors);
  return tensors;
}

std::vector<at::Tensor> PipelineExecutor::gradOutputsFor(const Key& key) {
  auto local = localGrads_.find(key);
  if (local != localGrads_.end()) {
    auto grads = std::move(local->second);
    localGrads_.erase(local);
    return grads;
  }
  return {};
}

void PipelineExecutor::backward(const Action& a, bool inputOnly, bool weightOnly) {
  const Key key{a.stage, a.microbatch};
  auto it = stash_.find(key);
  TORCH_CHECK(it != stash_.end(), "rank ", rank_, ": ", a.toString(),
              " has no stashed forward (schedule bug)");
  Stash& s = it->second;

  // Roots: outputs that require grad, with their gradients.
  std::vector<at::Tensor> roots, grads;
  if (a.stage == lastStage_) {
    roots = {s.outputs.at(0)};
    grads = {at::Tensor()};
  } else {
    for (size_t k = 0; k < s.outputs.size(); ++k) {
      if (!s.outputs[k].requires_grad()) continue;
      TORCH_CHECK(k < s.gradOutputs.size() && s.gradOutputs[k].defined(), "stage ", a.stage,
                  " microbatch ", a.microbatch, ": missing gradient for output ", k);
      roots.push_back(s.outputs[k]);
      grads.push_back(s.gradOutputs[k]);
    }
  }

  std::vector<at::Tensor> gradInputs(s.inputs.size());
  if (!weightOnly) {
    std::vector<at::Tensor> needInputs;
    std::vector<size_t> needIndex;
    for (size_t k = 0; k < s.inputs.size(); ++k) {
      if (s.inputs[k].requires_grad()) {
        needInputs.push_back(s.inputs[k]);
        needIndex.push_back(k);
      }
    }
    if (inputOnly) {
      if (!roots.empty() && !needInputs.empty()) {
        auto result = torch::autograd::grad(roots, needInputs, grads, /*retain_graph=*/true,
                                            /*create_graph=*/false, /*allow_unused=*/true);
        for (size_t n = 0; n < needIndex.size(); ++n) gradInputs[needIndex[n]] = result[n];
      }
    } else if (!roots.empty()) {
      torch::autograd::backward(roots, grads);
      for (size_t n = 0; n < needIndex.size(); ++n) {
        gradInputs[needIndex[n]] = s.inputs[needIndex[n]].grad();
      }
    }
    if (a.stage > 0) {
      // Float inputs without a gradient get zeros; others an empty marker.
      for (size_t k = 0; k < gradInputs.size(); ++k) {
        if (!gradInputs[k].defined()) {
          gradInputs[k] = at::isFloatingType(s.inputs[k].scalar_type())
                              ? at::zeros_like(s.inputs[k])
                              : at::empty({0}, s.inputs[k].options().dtype(at::kFloat));
        }
      }
      const Key upstream{a.stage - 1, a.microbatch};
      if (schedule_.layout().rankFor(a.stage - 1, a.microbatch) == rank_) {
        localGrads_[upstream] = gradInputs;
      } else {
        inputGrads_[key] = gradInputs;
      }
    }
  }
  if (inputOnly) return;  // keep the stash (graph retained) for W

  if (weightOnly && !roots.empty()) {
    auto params = stageParameters_.find(a.stage);
    std::vector<at::Tensor> weights;
    if (params != stageParameters_.end()) {
      for (const auto& p : params->second) {
        if (p.requires_grad()) weights.push_back(p);
      }
    }
    if (!weights.empty()) {
      torch::autograd::backward(roots, grads, /*keep_graph=*/false, /*create_graph=*/false, weights);
    }
  }
  stash_.erase(it);
}

std::vector<at::Tensor> PipelineExecutor::run(const std::vector<std::vector<at::Tensor>>& inputs) {
  auto outputs = execute(inputs, /*forwardOnly=*/false);
  std::vector<at::Tensor> losses;
  for (auto& out : outputs) losses.push_back(out.empty() ? at::Tensor() : out[0]);
  return losses;
}

std::vector<std::vector<at::Tensor>> PipelineExecutor::runForward(
    const std::vector<std::vector<at::Tensor>>& inputs) {
  at::NoGradGuard noGrad;
  return execute(inputs, /*forwardOnly=*/true);
}

std::vector<std::vector<at::Tensor>> PipelineExecutor::execute(
    const std::vector<std::vector<at::Tensor>>& inputs, bool forwardOnly) {
  stash_.clear();
  inputGrads_.clear();
  localActivations_.clear();
  localGrads_.clear();
  sends_.clear();
  peakStashed_ = 0;
  const Layout& layout = schedule_.layout();
  std::vector<std::vector<at::Tensor>> results(schedule_.totalMicrobatches());
  auto wanted = [forwardOnly](const Action& a) {
    return !forwardOnly || a.kind == ActionKind::kForward || a.kind == ActionKind::kSendForward ||
           a.kind == ActionKind::kRecvForward;
  };

  // Post every receive of the step up front (headers only; cheap).
  std::map<Key, std::shared_ptr<Transfer>> recvF, recvB;
  for (const Action& a : *actions_) {
    if (!wanted(a)) continue;
    if (a.kind == ActionKind::kRecvForward) {
      recvF[{a.stage, a.microbatch}] =
          engine_->recv(layout.rankFor(a.stage - 1, a.microbatch), tag(kForwardDir, a.stage - 1, a.microbatch),
                        describe("RECV_F", a.stage, a.microbatch));
    } else if (a.kind == ActionKind::kRecvBackward) {
      recvB[{a.stage, a.microbatch}] =
          engine_->recv(layout.rankFor(a.stage + 1, a.microbatch), tag(kBackwardDir, a.stage, a.microbatch),
                        describe("RECV_B", a.stage, a.microbatch));
    }
  }

  for (const Action& a : *actions_) {
    if (!wanted(a)) continue;
    const Key key{a.stage, a.microbatch};
    switch (a.kind) {
      case ActionKind::kForward: {
        std::vector<at::Tensor> in;
        if (a.stage == 0) {
          TORCH_CHECK(a.microbatch < static_cast<int>(inputs.size()), "rank ", rank_,
                      " holds stage 0 but got inputs for ", inputs.size(), " microbatches; ",
                      a.toString(), " needs microbatch ", a.microbatch);
          in = inputs[a.microbatch];
        } else if (layout.rankFor(a.stage - 1, a.microbatch) == rank_) {
          in = std::move(localActivations_.at({a.stage - 1, a.microbatch}));
          localActivations_.erase({a.stage - 1, a.microbatch});
        } else {
          in = receive(recvF, key, kForwardDir);
        }
        if (a.stage > 0) {
          for (auto& t : in) {
            t = t.detach();
            if (!forwardOnly && at::isFloatingType(t.scalar_type())) t.requires_grad_(true);
          }
        }
        std::vector<at::Tensor> out = forward_(a.stage, a.microbatch, in);
        if (a.stage == lastStage_) {
          if (forwardOnly) {
            results[a.microbatch] = out;
            break;
          }
          TORCH_CHECK(out.size() == 1 && out[0].numel() == 1,
                      "the last stage must return one scalar loss (got ", out.size(), " tensors)");
          results[a.microbatch] = {out[0].detach()};
        } else if (layout.rankFor(a.stage + 1, a.microbatch) == rank_) {
          std::vector<at::Tensor> handOver;
          for (const auto& t : out) handOver.push_back(t.detach());
          localActivations_[{a.stage, a.microbatch}] = std::move(handOver);
        }
        if (forwardOnly) {
          if (a.stage != lastStage_ && layout.rankFor(a.stage + 1, a.microbatch) != rank_) {
            stash_[key] = Stash{{}, std::move(out), {}};  // until SEND_F
          }
          break;
        }
        stash_[key] = Stash{std::move(in), std::move(out), {}};
        peakStashed_ = std::max(peakStashed_, static_cast<int>(stash_.size()));
        break;
      }
      case ActionKind::kSendForward: {
        const auto& out = stash_.at(key).outputs;
        sends_.push_back(engine_->send(out, layout.rankFor(a.stage + 1, a.microbatch),
                                       tag(kForwardDir, a.stage, a.microbatch),
                                       describe("SEND_F", a.stage, a.microbatch)));
        if (forwardOnly) stash_.erase(key);
        break;
      }
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput: {
        if (a.stage != lastStage_) {
          auto& s = stash_.at(key);
          if (layout.rankFor(a.stage + 1, a.microbatch) == rank_) {
            s.gradOutputs = gradOutputsFor(key);
          } else {
            s.gradOutputs = receive(recvB, key, kBackwardDir);
          }
        }
        backward(a, a.kind == ActionKind::kBackwardInput, false);
        break;
      }
      case ActionKind::kBackwardWeight:
        backward(a, false, true);
        break;
      case ActionKind::kSendBackward: {
        auto it = inputGrads_.find(key);
        TORCH_CHECK(it != inputGrads_.end(), "rank ", rank_, ": ", a.toString(), " before its backward");
        sends_.push_back(engine_->send(it->second, layout.rankFor(a.stage - 1, a.microbatch),
                                       tag(kBackwardDir, a.stage - 1, a.microbatch),
                                       describe("SEND_B", a.stage, a.microbatch)));
        inputGrads_.erase(it);
        break;
      }
      case ActionKind::kRecvForward:
      case ActionKind::kRecvBackward:
      case ActionKind::kUpdate:
      case ActionKind::kAllReduce:
        break;  // receives were posted up front; updates belong to the caller
    }
  }
  for (auto& send : sends_) send->wait(engine_->timeout());
  sends_.clear();
  TORCH_CHECK(stash_.empty(), "rank ", rank_, ": ", stash_.size(),
              " microbatches still stashed at the end of the step (schedule bug)");
  return results;
}

}  // namespace pipedream
