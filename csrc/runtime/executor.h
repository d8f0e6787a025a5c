// Runs one rank's lowered action list (see csrc/core/lower.h) for one step.
//
//   F(j, i)      inputs (stage 0: given; otherwise received or handed over by
//                the same rank's stage j-1) -> forward callback -> stash
//   B(j, i)      autograd on the stashed outputs with the received output
//                gradients; the input gradients are kept for SEND_B; the
//                stash is freed
//   I / W        the same split in two: I computes input gradients only
//                (graph retained), W the weight gradients (graph freed)
//   SEND_*       asynchronous send, waited at the end of the step
//   RECV_*       all receives of the step are posted when it starts; F/B
//                wait for theirs (with the engine's timeout) when they need it
//   U, ALLREDUCE left to the caller (the optimizer is the user's)
//
// The forward callback is the only call into Python; the caller releases
// the GIL for run() and the callback re-acquires it, so waits and autograd
// run without the GIL.
//
// Threading: an executor is used by one thread at a time (the caller of
// run()); all members below are owned by that thread.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/schedule.h"
#include "runtime/comm_engine.h"

namespace pipedream {

class PipelineExecutor {
 public:
  // forward(stage, microbatch, inputs) -> outputs. On the last stage the
  // outputs must be one scalar loss, already scaled for the backward.
  using ForwardFn =
      std::function<std::vector<at::Tensor>(int, int, const std::vector<at::Tensor>&)>;

  PipelineExecutor(Schedule schedule, int rank, std::shared_ptr<CommEngine> engine,
                   ForwardFn forward, std::map<int, std::vector<at::Tensor>> stageParameters);

  // Runs the rank's whole list once. `inputs[i]` are microbatch i's inputs of
  // stage 0 (ignored unless this rank holds stage 0). Returns the detached
  // loss of every microbatch whose last stage ran on this rank (undefined
  // tensors elsewhere).
  std::vector<at::Tensor> run(const std::vector<std::vector<at::Tensor>>& inputs);

  // Forward only (evaluation): runs just the F/SEND_F/RECV_F actions under
  // no_grad; the last stage's callback returns the model outputs, which are
  // returned per microbatch (empty lists on other ranks).
  std::vector<std::vector<at::Tensor>> runForward(const std::vector<std::vector<at::Tensor>>& inputs);

  // Most microbatches stashed at once during the last run (activations).
  int peakStashed() const { return peakStashed_; }
  const CommEngine& engine() const { return *engine_; }

 private:
  struct Stash {
    std::vector<at::Tensor> inputs;   // leaves (requires_grad for floats)
    std::vector<at::Tensor> outputs;  // forward outputs (or {loss})
    std::vector<at::Tensor> gradOutputs;  // kept between I and W
  };
  using Key = std::pair<int, int>;  // (stage, microbatch)

  // Shared body of run() and runForward().
  std::vector<std::vector<at::Tensor>> execute(const std::vector<std::vector<at::Tensor>>& inputs,
                                               bool forwardOnly);
  std::vector<at::Tensor> receive(std::map<Key, std::shared_ptr<Transfer>>& posted, const Key& key,
                                  int direction);
  void backward(const Action& a, bool inputOnly, bool weightOnly);
  std::vector<at::Tensor> gradOutputsFor(const Key& key);
  void checkSignature(int direction, int stage, int microbatch,
                      const std::vector<at::Tensor>& received);
  int tag(int direction, int boundary, int microbatch) const;
  std::string describe(const char* what, int stage, int microbatch) const;

  Schedule schedule_;
  const std::vector<Action>* actions_;
  int rank_;
  int lastStage_;
  std::shared_ptr<CommEngine> engine_;
  ForwardFn forward_;
  std::map<int, std::vector<at::Tensor>> stageParameters_;

  // Per-step state (cleared at the start of run()).
  std::map<Key, Stash> stash_;
  std::map<Key, std::vector<at::Tensor>> inputGrads_;      // for SEND_B / local hand-over
  std::map<Key, std::vector<at::Tensor>> localActivations_; // stage j -> j+1 on this rank
  std::map<Key, std::vector<at::Tensor>> localGrads_;       // stage j+1 -> j on this rank
  std::vector<std::shared_ptr<Transfer>> sends_;
  int peakStashed_ = 0;
  // (direction, stage) -> metadata learned on the first step; the batch
  // dimension may change, nothing else may.
  std::map<std::pair<int, int>, std::vector<TensorMeta>> signatures_;
};

}  // namespace pipedream
