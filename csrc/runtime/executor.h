// Runs one rank's lowered action list (see csrc/core/lower.h). What the
// schedule means (stashing, streaming, how replicas reduce gradients) comes
// from its traits (csrc/core/traits.h), looked up by the schedule's name.
//
//   F(j, i)      inputs (stage 0: given; otherwise received or handed over by
//                the same rank's stage j-1) -> forward callback -> stash.
//                With weight stashing the callback also gets the tensors of
//                the weight version the action names (WeightStore).
//   B(j, i)      autograd on the stashed outputs with the received output
//                gradients; the input gradients are kept for SEND_B; the
//                stash is freed (with stashing: the snapshot's gradients go
//                to the live parameters' .grad)
//   I / W        the same split in two: I computes input gradients only
//                (graph retained), W the weight gradients (graph freed)
//   SEND_*       asynchronous send; released as TransferLedger decides
//                (csrc/core/transfer_ledger.h)
//   RECV_*       posts the receive (never blocks): orderTransfers() put it
//                where the pair's order allows (csrc/core/channels.h); F/B/I
//                wait for theirs (with the engine's timeout) when they need it
//   recompute    F runs under no_grad and keeps only inputs (and the RNG
//                state); B re-runs the forward with the same RNG state first
//   U            with stashing (asynchronous schedules): the update callback
//                (the user's optimizer), then the next weight version; flush
//                schedules: nothing, the caller steps its optimizer after run()
//   ALLREDUCE    all-reduces the live gradients over the stage's replica
//                group: summed for flush schedules and 2bw (replicas ran
//                parts of one batch whose loss is scaled already), averaged
//                for pipedream (each replica ran its own minibatch)
//
// Two ways to run: run() executes the whole list once per call (flush
// schedules: one batch per step); a streaming executor starts with an empty
// list, gets each step's actions with appendActions() (from AsyncActionFeed,
// csrc/core/action_feed.h) and runs them with runUntil(), keeping all state
// between calls; actions already run are dropped, so memory stays constant.
//
// The forward and update callbacks are the only calls into Python; the
// caller releases the GIL for run*() and the callbacks re-acquire it.
//
// Observability: stats() is a RuntimeStats (csrc/core/runtime_stats.h)
// snapshot since construction or resetStats(): time in compute actions,
// time blocked on peers, time posting sends and receives ("RECV_POST"),
// wall time inside run*(), the engine's transfer
// counters and the weight stores' copies; with the action log on, every
// action (and every wait on a peer) is also recorded as a span with
// wall-clock microseconds (takeActionLog()); the Python side turns these
// spans into the Chrome trace and the debug log.
//
// Threading: an executor is used by one thread at a time (the caller of
// run*()); all members below are owned by that thread. An overlapped F&B
// pair runs its forward's callback on a second thread while the caller runs
// the backward; that thread touches only the pair's own locals (inputs in,
// outputs out), and the bookkeeping before and after the pair is the
// caller's.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/channels.h"
#include "core/receipt.h"
#include "core/runtime_stats.h"
#include "runtime/split_backward.h"
#include "core/schedule.h"
#include "core/traits.h"
#include "core/transfer_ledger.h"
#include "runtime/comm_engine.h"
#include "runtime/overlap.h"
#include "runtime/rng_state.h"
#include "runtime/weight_store.h"

namespace pipedream {

// One span of the real execution, an entry of the action log (a Chrome trace
// "X" event once exported).
struct ActionLogEntry {
  std::string name;      // the action's text, e.g. "1F3" or "0RECV_B2"
  std::string category;  // "compute", "wait", "send", "update", "allreduce"
  int64_t startUs = 0;   // microseconds since the Unix epoch (system clock)
  int64_t durationUs = 0;
};

class PipelineExecutor {
 public:
  // forward(stage, microbatch, inputs, weights) -> outputs. On the last
  // stage the outputs must be one scalar loss, already scaled for the
  // backward. `weights` is empty unless weights are stashed.
  using ForwardFn = std::function<std::vector<at::Tensor>(
      int, int, const std::vector<at::Tensor>&, const std::vector<at::Tensor>&)>;
  // update(stage, newVersion): step the optimizer of `stage`.
  using UpdateFn = std::function<void(int, int)>;
  // pair(fStage, fMicrobatch, fInputs, bStage, bMicrobatch, bRoots, bGrads)
  // -> the forward's outputs: runs an F&B pair's two halves itself (a model's
  // overlapped_forward_backward); the backward must reach the stash's inputs.
  using PairFn = std::function<std::vector<at::Tensor>(
      int, int, const std::vector<at::Tensor>&, int, int, const std::vector<at::Tensor>&,
      const std::vector<at::Tensor>&)>;

  // `update` is required when the schedule's traits stash weights;
  // `replicaGroups` maps each replicated local stage to its replicas' group.
  // `overlap`: every F&B pair of the list (csrc/core/pairs.h: an F directly
  // followed by a B of another stage) runs its halves together, by `pair` if
  // given, else on two threads taking turns (csrc/runtime/overlap.h).
  PipelineExecutor(Schedule schedule, int rank, std::shared_ptr<CommEngine> engine,
                   ForwardFn forward, std::map<int, std::vector<at::Tensor>> stageParameters,
                   UpdateFn update = nullptr,
                   std::map<int, c10::intrusive_ptr<c10d::ProcessGroup>> replicaGroups = {},
                   bool recompute = false, bool overlap = false, PairFn pair = nullptr);

  // Runs the rank's whole list once (state reset first). `inputs[i]` are
  // microbatch i's inputs of stage 0 (ignored unless this rank holds stage
  // 0). Returns the detached loss of every microbatch whose last stage ran on
  // this rank (undefined tensors elsewhere).
  std::vector<at::Tensor> run(const std::vector<std::vector<at::Tensor>>& inputs);

  // Forward only (evaluation): runs just the F/SEND_F/RECV_F actions under
  // no_grad; the last stage's callback returns the model outputs, which are
  // returned per microbatch (empty lists on other ranks).
  std::vector<std::vector<at::Tensor>> runForward(const std::vector<std::vector<at::Tensor>>& inputs);

  // Streaming: runs actions [position(), end) keeping all state. `inputs`
  // maps microbatch -> stage-0 inputs for the forwards in that range.
  // Returns microbatch -> detached loss for last-stage forwards that ran.
  std::map<int, at::Tensor> runUntil(size_t end, const std::map<int, std::vector<at::Tensor>>& inputs);
  size_t position() const { return next_; }
  size_t size() const { return list_.size(); }
  // Streaming: appends actions to run next (dropping those already run).
  void appendActions(const std::vector<Action>& actions);
  // Waits for every outstanding send (end of a stream or of the program).
  void waitSends();
  // Drops every handle on the process groups: posted transfers, the engine and
  // the replica groups. The executor is unusable afterwards. Runs no Python, so
  // the bindings call it without the GIL before deleting the executor: the last
  // reference to a Gloo group joins its worker threads, and a worker freeing a
  // tensor Python created (the user's own broadcast, say) needs the GIL.
  void releaseCommunication();

  const ScheduleTraits& traits() const { return traits_; }
  P2PProtocol protocol() const { return engine_->protocol(); }

  // Everything this executor did since construction or resetStats().
  RuntimeStats stats() const;
  // Starts stats() over, including the engine's and weight stores' counters.
  void resetStats();
  // Records every action in the action log while on (at most
  // kMaxActionLogEntries are kept between takeActionLog() calls; later ones
  // are counted as dropped).
  void setActionLogging(bool on) { actionLogging_ = on; }
  bool actionLogging() const { return actionLogging_; }
  std::vector<ActionLogEntry> takeActionLog();
  int64_t droppedActionLogEntries() const { return droppedActionLogEntries_; }
  static constexpr size_t kMaxActionLogEntries = 1 << 20;

 private:
  struct Stash {
    std::vector<at::Tensor> inputs;       // leaves (requires_grad for floats)
    std::vector<at::Tensor> outputs;      // forward outputs (or {loss})
    std::vector<at::Tensor> gradOutputs;  // the outputs' gradients (B, I)
    int version = 0;                      // weight version read (stashing)
    RngState rngState;                    // recompute: RNG states before F (CPU, device)
    SplitBackward split;                  // what W needs from I (frontier gradients)
  };
  using Key = std::pair<int, int>;  // (stage, microbatch)

  using InputFn = std::function<const std::vector<at::Tensor>*(int)>;
  using Results = std::map<int, std::vector<at::Tensor>>;
  using TimePoint = std::chrono::steady_clock::time_point;
  using TransferId = TransferLedger::Id;

  void reset();
  // One whole step over the list (run, runForward): the last stage's outputs by microbatch.
  Results runList(const std::vector<std::vector<at::Tensor>>& inputs, bool forwardOnly);
  void execute(size_t begin, size_t end, const InputFn& inputOf, bool forwardOnly, Results& results);
  // One method per action kind. `start` is when the action's compute began;
  // an action that waits for a receive moves it past the wait.
  void postReceive(const Action& a);
  void forwardAction(const Action& a, const InputFn& inputOf, bool forwardOnly, Results& results,
                     TimePoint& start);
  std::vector<at::Tensor> forwardInputs(const Action& a, const InputFn& inputOf, bool forwardOnly,
                                        TimePoint& start);
  void sendForwardAction(const Action& a, size_t index, bool forwardOnly);
  void backwardAction(const Action& a, TimePoint& start);
  // An F&B pair at list_[index], list_[index + 1] (overlap_ only).
  void pairAction(size_t index, const InputFn& inputOf, Results& results);
  void runTurns(const Action& f, const std::vector<at::Tensor>& in, std::vector<at::Tensor>& out,
                const Action& b, const Stash& s, const std::vector<at::Tensor>& roots,
                const std::vector<at::Tensor>& grads, std::vector<at::Tensor>& gradInputs);
  // Receipt points and peaks after list_[index] ran.
  void afterAction(size_t index);
  // F in three parts (the pair runs the middle one on its own thread).
  std::vector<at::Tensor> callForward(const Action& a, const std::vector<at::Tensor>& in,
                                      const std::vector<at::Tensor>& weights, bool forwardOnly);
  void keepForward(const Action& a, std::vector<at::Tensor> in, std::vector<at::Tensor> out,
                   RngState rngState, bool forwardOnly, Results& results);
  // B's gradients in (received or handed over by stage j+1 on this rank).
  void takeGradOutputs(const Action& a, TimePoint& start);
  Stash& stashOf(const Action& a);
  // Recompute (if on) and the roots of B or I.
  void prepareBackward(const Action& a, Stash& s, std::vector<at::Tensor>& roots,
                       std::vector<at::Tensor>& grads);
  void releaseStash(const Action& a);
  void sendBackwardAction(const Action& a, size_t index);
  void updateAction(const Action& a, size_t index);
  void allReduceAction(const Action& a);
  void accountAction(const Action& a, TimePoint start);

  std::vector<at::Tensor> receive(const Key& key, int direction);
  // Autograd of B (neither flag), I (inputOnly) or W (weightOnly).
  void differentiate(const Action& a, bool inputOnly, bool weightOnly);
  void recomputeForward(const Action& a, Stash& s);
  void gradientRoots(const Action& a, const Stash& s, std::vector<at::Tensor>& roots,
                     std::vector<at::Tensor>& grads) const;
  // Input gradients of B or I; keepInputGradients() keeps them for SEND_B or
  // the same rank's stage j-1.
  std::vector<at::Tensor> inputGradients(const Action& a, Stash& s,
                                         const std::vector<at::Tensor>& roots,
                                         const std::vector<at::Tensor>& grads, bool inputOnly);
  static std::vector<at::Tensor> leafGradients(const Stash& s);
  void keepInputGradients(const Action& a, const Stash& s, std::vector<at::Tensor> gradInputs);
  int oldestFutureRead(int stage, size_t from) const;
  // Received activations of `stage`: the number of tensors and their dtypes
  // (not their shapes) must be those of the stage's first input.
  void checkSignature(int stage, int microbatch, const std::vector<at::Tensor>& received);
  std::string describe(const char* what, int stage, int microbatch) const;
  // The ledger's id of list position `index`: absolute over a stream.
  TransferId idOf(size_t index) const { return static_cast<TransferId>(dropped_ + index); }
  // Waits for (releases) the sends `ids` and drops their handles.
  void releaseSends(const std::vector<TransferId>& ids);
  // Accounts [start, now) to `kind` in stats_ and, when logging actions, the action log.
  void account(const std::string& kind, const std::string& name, const char* category,
               TimePoint start, bool isWait);
  void accountSpan(const std::string& kind, const std::string& name, const char* category,
                   TimePoint start, TimePoint end, bool isWait);

  Schedule schedule_;          // layout and metadata
  const ScheduleTraits& traits_;  // of schedule_.name(); a static table entry
  std::vector<Action> list_;   // this rank's actions (streaming: a window)
  size_t dropped_ = 0;         // streaming: actions dropped from the front of list_
  int rank_;
  int lastStage_;
  std::shared_ptr<CommEngine> engine_;
  ForwardFn forward_;
  UpdateFn update_;
  std::map<int, std::vector<at::Tensor>> stageParameters_;
  std::map<int, c10::intrusive_ptr<c10d::ProcessGroup>> replicaGroups_;
  bool recompute_;  // F keeps only its inputs; B re-runs the forward first
  bool overlap_;    // F&B pairs run their halves together
  PairFn pair_;     // how (empty: two threads taking turns)
  std::map<int, WeightStore> stores_;  // per local stage (stashing only)

  // Stream state (cleared by reset()).
  size_t next_ = 0;
  std::map<Key, Stash> stash_;
  std::map<Key, std::vector<at::Tensor>> inputGrads_;       // for SEND_B
  std::map<Key, std::vector<at::Tensor>> localActivations_; // stage j -> j+1 on this rank
  std::map<Key, std::vector<at::Tensor>> localGrads_;       // stage j+1 -> j on this rank
  std::map<Key, std::shared_ptr<Transfer>> recvF_, recvB_;  // posted receives
  // Which sends may be released: the ledger decides on ids; the handles stay here.
  TransferLedger ledger_;
  std::map<TransferId, std::shared_ptr<Transfer>> sends_;  // sends in flight
  // stage -> its first received input's metadata; only the count and the
  // dtypes are checked against it (shapes may change at every microbatch).
  std::map<int, std::vector<TensorMeta>> signatures_;

  RuntimeStats stats_;  // own counters; stats() adds the engine's and the stores'
  bool actionLogging_ = false;
  std::vector<ActionLogEntry> actionLog_;
  int64_t droppedActionLogEntries_ = 0;
};

}  // namespace pipedream
