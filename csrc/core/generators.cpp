#include "generators.h"

#include <algorithm>
#include <deque>
#include <functional>
#include <map>
#include <numeric>
#include <queue>
#include <stdexcept>

#include "traits.h"

namespace pipedream {

namespace {

using RankLists = std::vector<std::vector<Action>>;

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument(message); }

std::string str(int value) { return std::to_string(value); }

std::string joined(const std::vector<int>& values) {
  std::string out;
  for (size_t k = 0; k < values.size(); ++k) out += (k ? "-" : "") + str(values[k]);
  return out;
}

// Microbatches [base, base + count) that replica `replica` of `r` runs
// (round robin: i mod r == replica).
std::vector<int> localMicrobatches(int base, int count, int replica, int r) {
  std::vector<int> local;
  for (int i = base; i < base + count; ++i) {
    if (i % r == replica) local.push_back(i);
  }
  return local;
}

// One-forward-one-backward order over a rank's local microbatches: `warmup`
// forwards, then B(local[x]) followed by F(local[x + warmup]) until forwards
// run out, then the remaining backwards. `afterBackward(x)` may append
// UPDATE/ALLREDUCE after the x-th backward; `versionOf(i)` gives the version
// that F(i) and B(i) read.
void appendOneFOneB(std::vector<Action>& out, int stage, const std::vector<int>& local,
                    int warmup, const std::function<int(int)>& versionOf,
                    const std::function<void(int)>& afterBackward) {
  const int n = static_cast<int>(local.size());
  const int w = std::min(warmup, n);
  for (int x = 0; x < w; ++x) {
    out.push_back(Action::compute(stage, ActionKind::kForward, local[x], versionOf(local[x])));
  }
  for (int x = 0; x < n; ++x) {
    out.push_back(Action::compute(stage, ActionKind::kBackward, local[x], versionOf(local[x])));
    afterBackward(x);
    if (w + x < n) {
      const int i = local[w + x];
      out.push_back(Action::compute(stage, ActionKind::kForward, i, versionOf(i)));
    }
  }
}

void appendUpdate(std::vector<Action>& out, int stage, int replicas, int newVersion) {
  if (replicas > 1) out.push_back(Action::allReduce(stage, newVersion));
  out.push_back(Action::update(stage, newVersion));
}

// Calls fn(j, k, r, list) for replica k of each stage j (r replicas), with the
// rank list that replica's actions go to: every straight generator's outer loops.
template <typename Fn>
void forEachReplica(const Layout& layout, RankLists& lists, Fn&& fn) {
  for (int j = 0; j < layout.numStages(); ++j) {
    const auto& ranks = layout.stageRanks(j);
    const int r = static_cast<int>(ranks.size());
    for (int k = 0; k < r; ++k) fn(j, k, r, lists[ranks[k]]);
  }
}

// --- flush schedules: one batch at a time -----------------------------------

// GPipe: all forwards, then all backwards, then one update.
void gpipeBatch(const Layout& layout, int m, int batch, RankLists& lists) {
  forEachReplica(layout, lists, [&](int j, int k, int r, std::vector<Action>& out) {
    const auto local = localMicrobatches(batch * m, m, k, r);
    for (int i : local) out.push_back(Action::compute(j, ActionKind::kForward, i, batch));
    for (int i : local) out.push_back(Action::compute(j, ActionKind::kBackward, i, batch));
    appendUpdate(out, j, r, batch + 1);
  });
}

// PipeDream-Flush (1F1B with a flush): NOAM_j forwards of warm-up, 1F1B,
// drain, one update.
void oneFOneBBatch(const Layout& layout, int m, int batch, RankLists& lists) {
  const auto replicas = layout.replicaCounts();
  forEachReplica(layout, lists, [&](int j, int k, int r, std::vector<Action>& out) {
    appendOneFOneB(out, j, localMicrobatches(batch * m, m, k, r), numOptimalActiveMinibatches(replicas, j),
                   [batch](int) { return batch; }, [](int) {});
    appendUpdate(out, j, r, batch + 1);
  });
}

// Interleaved 1F1B (Megatron-LM; the generalisation of
// torch.distributed.pipelining): p ranks, v chunks per rank. Microbatches go
// in rounds of s = m / max(1, m / p) (so s >= p unless m < p, and rounds must
// be equal). Forwards run round by round, chunks 0..v-1 within a round;
// backwards the same with the chunks reversed. Rank r warms up with
// (v - 1) * s + 2 * (p - 1 - r) forwards, then alternates F and B. With
// s == p this is exactly Megatron's order: virtual microbatch k is
// microbatch (k / pv) * p + k % p of chunk (k % pv) / p.
int interleavedRoundSize(int p, int m) { return m / std::max(1, m / p); }

void interleavedBatch(const Layout& layout, int m, int batch, RankLists& lists) {
  const int p = layout.numRanks();
  const int v = layout.numStages() / p;
  const int roundSize = interleavedRoundSize(p, m);
  std::vector<std::pair<int, int>> forwardOrder, backwardOrder;  // (chunk, microbatch)
  for (int start = 0; start < m; start += roundSize) {
    for (int c = 0; c < v; ++c) {
      for (int i = start; i < start + roundSize; ++i) {
        forwardOrder.push_back({c, i});
        backwardOrder.push_back({v - 1 - c, i});
      }
    }
  }
  const int total = m * v;
  for (int r = 0; r < p; ++r) {
    auto& out = lists[r];
    const int warmup = std::min((v - 1) * roundSize + 2 * (p - 1 - r), total);
    auto emit = [&](const std::pair<int, int>& ci, ActionKind kind) {
      out.push_back(Action::compute(ci.first * p + r, kind, batch * m + ci.second, batch));
    };
    for (int k = 0; k < warmup; ++k) emit(forwardOrder[k], ActionKind::kForward);
    for (int k = 0; k < total - warmup; ++k) {
      emit(forwardOrder[warmup + k], ActionKind::kForward);
      emit(backwardOrder[k], ActionKind::kBackward);
    }
    for (int k = total - warmup; k < total; ++k) emit(backwardOrder[k], ActionKind::kBackward);
    for (int c = 0; c < v; ++c) out.push_back(Action::update(c * p + r, batch + 1));
  }
}

// ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): the backward is
// split into I (input gradient, on the critical path) and W (weight
// gradient, deferrable). The order is what a unit-cost list scheduler
// (tF = tI = tW) produces with priorities I > F > W under 1F1B's activation
// bound: stage j keeps at most p - j microbatches between F and I. A W only
// needs a small stash (the layer inputs and output gradients), and at most
// p of them wait at a time: enough to fill the drain, which leaves (p-1)(tF + tI - tW) idle per rank instead of 1F1B's
// (p-1)(tF + tI + tW).
//
//   p = 4, m = 8 (one clock per action):
//   rank 0: F0 F1 F2 F3 .. .. .. I0 F4 I1 F5 I2 F6 I3 F7 I4 W0 I5 W1 ...
//   rank 3:          F0 I0 F1 I1 F2 I2 ...                  ... I7 W4 W5 W6 W7
//
// A replicated stage (r replicas) runs as r lanes, one per rank, replica k
// taking microbatches i with i mod r == k (as 1F1B's replicas do); a lane keeps
// at most NOAM_j microbatches between F and I (p - j without replicas), and
// its gradients are all-reduced after its last W.
class ZbH1Scheduler {
 public:
  ZbH1Scheduler(const Layout& layout, int m, int batch, RankLists& lists)
      : p_(layout.numStages()),
        m_(m),
        batch_(batch),
        lists_(lists),
        fEnd_(p_, std::vector<int>(m, kNotYet)),
        iEnd_(p_, std::vector<int>(m, kNotYet)),
        firstLane_(p_, 0) {
    const auto replicas = layout.replicaCounts();
    for (int j = 0; j < p_; ++j) {
      const auto& ranks = layout.stageRanks(j);
      const int r = static_cast<int>(ranks.size());
      firstLane_[j] = static_cast<int>(lanes_.size());
      for (int k = 0; k < r; ++k) {
        std::vector<int> local;  // the replica's microbatches (global i mod r == k), batch-local
        for (int i : localMicrobatches(batch * m, m, k, r)) local.push_back(i - batch * m);
        lanes_.push_back(Lane{j, ranks[k], r, numOptimalActiveMinibatches(replicas, j),
                              std::move(local)});
      }
    }
  }

  void run() {
    for (int clock = 0; done_ < p_ * m_; ++clock) {
      bool acted = false;
      for (auto& lane : lanes_) acted = stepLane(lane, clock) || acted;
      if (!acted) checkSomethingPending(clock);
    }
    for (const auto& lane : lanes_) appendUpdate(lists_[lane.rank], lane.stage, lane.replicas, batch_ + 1);
  }

 private:
  static constexpr int kNotYet = -1;
  // Microbatches that become ready at a known clock, and those ready, oldest
  // first: the oldest ready one is found in O(log m), not by a scan.
  class Candidates {
   public:
    void add(int readyAt, int i) { pending_.push_back({readyAt, i}); }
    // The oldest microbatch ready at `clock`, taken, or kNotYet.
    int take(int clock) {
      while (!pending_.empty() && pending_.front().first <= clock) {
        ready_.push(pending_.front().second);
        pending_.pop_front();
      }
      if (ready_.empty()) return kNotYet;
      const int i = ready_.top();
      ready_.pop();
      return i;
    }

   private:
    std::deque<std::pair<int, int>> pending_;  // (clock it is ready at, i), clocks ascending
    std::priority_queue<int, std::vector<int>, std::greater<int>> ready_;
  };
  struct Lane {
    int stage, rank, replicas, limit;
    std::vector<int> local;  // its microbatches, in order
    size_t nextForward = 0;
    int activations = 0;  // F done, I not yet
    int deferred = 0;     // I done, W not yet
    Candidates inputs{};  // F done and (last stage or downstream I done)
    Candidates weights{}; // I done
  };

  void emit(const Lane& lane, ActionKind kind, int i) {
    lists_[lane.rank].push_back(Action::compute(lane.stage, kind, batch_ * m_ + i, batch_));
  }
  // The lane of stage j that runs batch-local microbatch i.
  Lane& laneOf(int j, int i) {
    return lanes_[firstLane_[j] + (batch_ * m_ + i) % lanes_[firstLane_[j]].replicas];
  }

  // At most one action of `lane` at `clock`, by priority I > F > W (a W
  // first with p deferred); true if one ran.
  bool stepLane(Lane& lane, int clock) {
    if (tryInput(lane, clock)) return true;
    // With p deferred W's waiting, a W goes first: p is what the drain needs
    // to be gap-free (p - 1 costs one clock; see the simulator tests).
    if (lane.deferred > p_ - 1 && tryWeight(lane, clock)) return true;
    if (tryForward(lane, clock)) return true;
    return tryWeight(lane, clock);
  }

  // I: the oldest microbatch whose gradient has arrived. It makes the W of
  // the microbatch ready, and its I upstream once that F is done.
  bool tryInput(Lane& lane, int clock) {
    const int j = lane.stage;
    const int i = lane.inputs.take(clock);
    if (i == kNotYet) return false;
    iEnd_[j][i] = clock + 1;
    --lane.activations;
    ++lane.deferred;
    emit(lane, ActionKind::kBackwardInput, i);
    lane.weights.add(clock + 1, i);
    if (j > 0 && fEnd_[j - 1][i] != kNotYet) laneOf(j - 1, i).inputs.add(clock + 1, i);
    return true;
  }

  // F: the next microbatch, if its input is there and memory allows.
  bool tryForward(Lane& lane, int clock) {
    const int j = lane.stage;
    if (lane.nextForward >= lane.local.size() || lane.activations >= lane.limit) return false;
    const int f = lane.local[lane.nextForward];
    if (j != 0 && !(fEnd_[j - 1][f] != kNotYet && fEnd_[j - 1][f] <= clock)) return false;
    fEnd_[j][f] = clock + 1;
    ++lane.nextForward;
    ++lane.activations;
    emit(lane, ActionKind::kForward, f);
    if (j == p_ - 1 || iEnd_[j + 1][f] != kNotYet) lane.inputs.add(clock + 1, f);
    return true;
  }

  // W: the oldest microbatch whose I is done.
  bool tryWeight(Lane& lane, int clock) {
    const int i = lane.weights.take(clock);
    if (i == kNotYet) return false;
    --lane.deferred;
    ++done_;
    emit(lane, ActionKind::kBackwardWeight, i);
    return true;
  }

  // With unit costs every action ends by the next clock, so an idle clock
  // with nothing in progress could only repeat forever.
  void checkSomethingPending(int clock) const {
    for (int j = 0; j < p_; ++j) {
      for (int i = 0; i < m_; ++i) {
        if ((fEnd_[j][i] != kNotYet && fEnd_[j][i] > clock) ||
            (iEnd_[j][i] != kNotYet && iEnd_[j][i] > clock)) {
          return;
        }
      }
    }
    throw std::logic_error("zb-h1 generator made no progress");
  }

  const int p_;
  const int m_;
  const int batch_;
  RankLists& lists_;
  std::vector<Lane> lanes_;
  // *End_[j][i]: clock at which the action's result is available.
  std::vector<std::vector<int>> fEnd_, iEnd_;
  std::vector<int> firstLane_;  // per stage: its first lane (replica 0)
  int done_ = 0;  // W's emitted
};

void zbH1Batch(const Layout& layout, int m, int batch, RankLists& lists) {
  ZbH1Scheduler(layout, m, batch, lists).run();
}

// --- zero-bubble schedules with several chunks per rank ----------------------
//
// These follow torch.distributed.pipelining's generators action for action
// (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV in
// torch/distributed/pipelining/schedules.py, torch 2.13): each rank's order
// is computed on its own from (p, m, r), in local microbatch numbers; the
// empty slots torch pads with (None) carry no meaning in a list. Emitted per
// batch with the batch's microbatch offset and version, and one UPDATE per
// local stage at the end.

// One compute action of a rank's order, microbatch local to the batch.
struct Op {
  int stage;
  ActionKind kind;
  int i;
};
using RankOps = std::vector<Op>;

void emitBatch(const std::vector<RankOps>& order, const Layout& layout, int m, int batch,
               RankLists& lists) {
  for (int r = 0; r < static_cast<int>(order.size()); ++r) {
    for (const Op& op : order[r]) {
      lists[r].push_back(Action::compute(op.stage, op.kind, batch * m + op.i, batch));
    }
    for (int j : layout.stagesOfRank(r)) lists[r].push_back(Action::update(j, batch + 1));
  }
}

// Per-stage microbatch counters: the next microbatch of (stage, kind).
class Counters {
 public:
  int take(int stage, ActionKind kind) { return next_[{stage, static_cast<int>(kind)}]++; }
  int peek(int stage, ActionKind kind) { return next_[{stage, static_cast<int>(kind)}]; }

 private:
  std::map<std::pair<int, int>, int> next_;
};

// ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", section 6; torch's
// ScheduleZBVZeroBubble): p ranks, 2p stages in a V, rank r holds chunk 0 =
// stage r and chunk 1 = stage 2p-1-r. With tF = tI = tW (m >= 2p-1) every
// rank is busy without a gap from its first forward to its last W, and holds
// at most 2p chunk activations: p microbatches of a whole stage, 1F1B's
// memory (tests/cpp/test_simulate.cpp). Rank r:
//   warm-up   2(p-r)-1 x F0;  r x (F1 F0);  p-r x (F1 I1 W1)
//   steady    (F0) I0 W0 F1 I1 W1   until every forward ran
//   cool-down r x (I0 I1);  p-r x (I0 W0);  the W1s left, the W0s left
// computed for max(m, 2p-1) microbatches and the ones >= m dropped (torch's
// rule for small m).
RankOps zbvRank(int p, int m, int r) {
  const int n = std::max(2 * p - 1, m);
  const int s0 = r, s1 = 2 * p - 1 - r;
  RankOps ops;
  int f0 = 0, f1 = 0, b0 = 0, b1 = 0;
  auto add = [&](int stage, ActionKind kind, int i) { ops.push_back({stage, kind, i}); };
  using K = ActionKind;
  for (int k = 0; k < 2 * (p - r) - 1; ++k) add(s0, K::kForward, f0++);
  for (int k = 0; k < r; ++k) {
    add(s1, K::kForward, f1++);
    add(s0, K::kForward, f0++);
  }
  for (int k = 0; k < p - r; ++k) {
    add(s1, K::kForward, f1++);
    add(s1, K::kBackwardInput, b1);
    add(s1, K::kBackwardWeight, b1++);
  }
  while (f1 < f0 || f0 < n) {
    if (f0 < n) add(s0, K::kForward, f0++);
    add(s0, K::kBackwardInput, b0);
    add(s0, K::kBackwardWeight, b0++);
    add(s1, K::kForward, f1++);
    add(s1, K::kBackwardInput, b1);
    add(s1, K::kBackwardWeight, b1++);
  }
  int w0 = b0, w1 = b1;
  for (int k = 0; k < r; ++k) {
    add(s0, K::kBackwardInput, b0++);
    add(s1, K::kBackwardInput, b1++);
  }
  for (int k = 0; k < p - r; ++k) {
    add(s0, K::kBackwardInput, b0++);
    add(s0, K::kBackwardWeight, w0++);
  }
  while (w1 < b1) add(s1, K::kBackwardWeight, w1++);
  while (w0 < b0) add(s0, K::kBackwardWeight, w0++);
  if (!(f0 == n && b0 == n && w0 == n && f1 == n && b1 == n && w1 == n)) {
    throw std::logic_error("zbv generator: unbalanced counts on rank " + str(r));
  }
  RankOps kept;
  for (const Op& op : ops) {
    if (op.i < m) kept.push_back(op);
  }
  return kept;
}

// DualPipeV (DeepSeek-V3 report; github.com/deepseek-ai/DualPipe; torch's
// ScheduleDualPipeV): the V placement of zbv, with the steady state pairing
// the forward of one chunk with the full backward of the other ("F&B": DualPipe
// overlaps the two on the device). Our executor runs one action at a time, so
// an F&B pair is the two actions F then B, adjacent in the list; the bubble
// measured is the one without overlap. Rank r (chunk 0 = stage r, chunk 1 =
// stage 2p-1-r, m >= 2p):
//   1  2(p-r-1) x F0
//   2  r+1 x (F0 F1)
//   3  p-r-1 x (I1 W F1)                 W: the oldest pending W, if any
//   4  m-2p+r+1 x (F0&B1  F1&B0)
//   5  p-r-1 x (B1  F1&B0)
//   6  r+1 x (B1 B0), from the middle on as I1 I0 (zero bubble for the drain)
//   7  p-r-1 x (W  B0|I0)
//   8  r+1 x W
RankOps dualPipeVRank(int p, int m, int r) {
  const int s0 = r, s1 = 2 * p - 1 - r;
  using K = ActionKind;
  RankOps ops;
  Counters counters;                     // F and backward (B or I) per stage
  std::deque<std::pair<int, int>> wQueue;  // (stage, microbatch) of I's awaiting their W
  auto add = [&](int stage, K kind) {
    const K counted = kind == K::kForward ? K::kForward : K::kBackwardInput;
    const int i = counters.take(stage, counted);
    ops.push_back({stage, kind, i});
    if (kind == K::kBackwardInput) wQueue.push_back({stage, i});
  };
  auto addW = [&]() {
    if (wQueue.empty()) return;
    ops.push_back({wQueue.front().first, K::kBackwardWeight, wQueue.front().second});
    wQueue.pop_front();
  };
  auto forwardAndBackward = [&](int forwardStage, int backwardStage) {
    add(forwardStage, K::kForward);
    add(backwardStage, K::kBackward);
  };
  for (int k = 0; k < 2 * (p - r - 1); ++k) add(s0, K::kForward);
  for (int k = 0; k < r + 1; ++k) {
    add(s0, K::kForward);
    add(s1, K::kForward);
  }
  for (int k = 0; k < p - r - 1; ++k) {
    add(s1, K::kBackwardInput);
    addW();
    add(s1, K::kForward);
  }
  for (int k = 0; k < m - 2 * p + r + 1; ++k) {
    forwardAndBackward(s0, s1);  // torch does not overlap the first pair of rank p-1
    forwardAndBackward(s1, s0);
  }
  for (int k = 0; k < p - r - 1; ++k) {
    add(s1, K::kBackward);
    forwardAndBackward(s1, s0);
  }
  const int step6 = r + 1;
  bool split = false;
  for (int k = 0; k < step6; ++k) {
    if (k == step6 / 2 && r % 2 == 1) split = true;
    add(s1, split ? K::kBackwardInput : K::kBackward);
    if (k == step6 / 2 && r % 2 == 0) split = true;
    add(s0, split ? K::kBackwardInput : K::kBackward);
  }
  for (int k = 0; k < p - r - 1; ++k) {
    addW();
    add(s0, split ? K::kBackwardInput : K::kBackward);
  }
  for (int k = 0; k < r + 1; ++k) addW();
  if (!wQueue.empty() || counters.peek(s0, K::kForward) != m ||
      counters.peek(s1, K::kForward) != m || counters.peek(s0, K::kBackwardInput) != m ||
      counters.peek(s1, K::kBackwardInput) != m) {
    throw std::logic_error("dualpipev generator: unbalanced counts on rank " + str(r));
  }
  return ops;
}

// Interleaved zero bubble (torch's ScheduleInterleavedZeroBubble, the ZB1P
// schedule of the zero-bubble paper over v round-robin chunks): the
// forward/backward order of interleaved-1f1b (rounds of s microbatches,
// chunks 0..v-1 forward, v-1..0 backward) with B split into I and W, a
// warm-up of (v-1)s + (p-1-r) forwards instead of (v-1)s + 2(p-1-r), and
// rank r deferring its W's by r backwards: F I ... then F I W ... in the
// steady state, I W in the drain, the W's left at the end.
RankOps interleavedZbRank(int p, int v, int m, int r) {
  using K = ActionKind;
  const int s = interleavedRoundSize(p, m);
  const int total = m * v;
  const int warmup = std::min((v - 1) * s + (p - 1 - r), total);
  auto forwardStage = [&](int k) { return ((k / s) % v) * p + r; };
  auto backwardStage = [&](int k) { return (v - 1 - ((k - warmup) / s) % v) * p + r; };
  RankOps ops;
  Counters counters;
  std::vector<int> backwardSteps;  // the op index of every backward, in order
  int weights = 0;
  auto add = [&](int stage, K kind) { ops.push_back({stage, kind, counters.take(stage, kind)}); };
  auto backward = [&](int k) {
    add(backwardStage(k), K::kBackwardInput);
    backwardSteps.push_back(k);
    if (k - warmup >= r) add(backwardStage(backwardSteps[weights++]), K::kBackwardWeight);
  };
  for (int k = 0; k < warmup; ++k) add(forwardStage(k), K::kForward);
  for (int k = warmup; k < total; ++k) {
    add(forwardStage(k), K::kForward);
    backward(k);
  }
  for (int k = total; k < total + warmup; ++k) backward(k);
  while (weights < static_cast<int>(backwardSteps.size())) {
    add(backwardStage(backwardSteps[weights++]), K::kBackwardWeight);
  }
  return ops;
}

// --- asynchronous schedules ------------------------------------------------

// PipeDream: 1F1B without flushes; an UPDATE (after an ALLREDUCE for a
// replicated stage) follows every backward, and F reads the number of
// updates applied so far on its rank.
RankLists generatePipeDream(const ScheduleOptions& o, const Layout& layout) {
  const int m = o.microbatches;
  const bool verticalSync = o.verticalSync;
  RankLists lists(layout.numRanks());
  const auto replicas = layout.replicaCounts();
  // Vertical sync: stage 0's version of minibatch i (its replica runs it as
  // local position i / r_0, after max(0, i / r_0 - NOAM_0 + 1) updates).
  const int noam0 = numOptimalActiveMinibatches(replicas, 0);
  auto stageZeroVersion = [&](int i) { return std::max(0, i / replicas[0] - noam0 + 1); };
  forEachReplica(layout, lists, [&](int j, int k, int r, std::vector<Action>& out) {
    const int noam = numOptimalActiveMinibatches(replicas, j);
    const auto local = localMicrobatches(0, m, k, r);
    // Local position x is read at version max(0, x - noam + 1): warm-up
    // forwards see no update, the x-th steady forward follows x+1-noam...
    std::vector<int> version(m, 0);
    for (size_t x = 0; x < local.size(); ++x) {
      version[local[x]] = verticalSync ? stageZeroVersion(local[x])
                                       : std::max(0, static_cast<int>(x) - noam + 1);
    }
    appendOneFOneB(out, j, local, noam, [&version](int i) { return version[i]; },
                   [&](int x) { appendUpdate(out, j, r, x + 1); });
  });
  return lists;
}

// PipeDream-2BW: 1F1B without flushes over `batches` batches of m
// microbatches; gradients accumulate over a batch, one update per batch.
// Every microbatch of batch t reads version max(0, t - 1), so the update
// after batch t computes W(t+1) = W(t) - lr * grad(W(t-1)), and at most two
// versions are live on any stage.
RankLists generateTwoBw(const ScheduleOptions& o, const Layout& layout) {
  const int m = o.microbatches;
  const auto replicas = layout.replicaCounts();
  // The first forward of batch t+1 must come after the update that ends
  // batch t-1, which needs m/r_j >= NOAM_j - 1 on every stage.
  for (int j = 0; j < layout.numStages(); ++j) {
    const int need = (numOptimalActiveMinibatches(replicas, j) - 1) * replicas[j];
    if (m < need) {
      fail("pipedream-2bw needs at least " + str(need) +
           " microbatches per batch so that stage " + str(j) +
           " never needs a third weight version (got m=" + str(m) + "); use m=" + str(need));
    }
  }
  RankLists lists(layout.numRanks());
  forEachReplica(layout, lists, [&](int j, int k, int r, std::vector<Action>& out) {
    const int perBatch = m / r;
    appendOneFOneB(
        out, j, localMicrobatches(0, m * o.batches, k, r), numOptimalActiveMinibatches(replicas, j),
        [m](int i) { return std::max(0, i / m - 1); },
        [&](int x) {
          if ((x + 1) % perBatch == 0) appendUpdate(out, j, r, (x + 1) / perBatch);
        });
  });
  return lists;
}

// --- checks ----------------------------------------------------------------

void checkPositive(const char* what, int value) {
  if (value < 1) {
    fail(std::string(what) + " must be >= 1 (got " + str(value) + "); give " + what +
         " a positive value");
  }
}

// "'a'", "'a' or 'b'", "'a', 'b' or 'c'": the schedules with `flag` set.
std::string namesWhere(bool ScheduleTraits::*flag) {
  std::vector<std::string> names;
  for (const auto& traits : allScheduleTraits()) {
    if (traits.*flag) names.push_back("'" + traits.name + "'");
  }
  std::string out;
  for (size_t k = 0; k < names.size(); ++k) {
    out += (k == 0 ? "" : k + 1 == names.size() ? " or " : ", ") + names[k];
  }
  return out;
}

// The options `traits` rule out, whatever the schedule family.
void checkOptionsAgainstTraits(const ScheduleOptions& o, const ScheduleTraits& traits) {
  if (o.chunks != 1 && !traits.multiChunk) {
    fail("schedule '" + o.name + "' runs one chunk per rank (got chunks=" + str(o.chunks) +
         "); use chunks=1 or schedule " + namesWhere(&ScheduleTraits::multiChunk));
  }
  const bool anyReplicas =
      std::any_of(o.replicas.begin(), o.replicas.end(), [](int r) { return r != 1; });
  if (anyReplicas && !traits.supportsReplicas) {
    fail("schedule '" + o.name + "' does not support replicated stages (got replicas " +
         joined(o.replicas) + "); use " + namesWhere(&ScheduleTraits::supportsReplicas));
  }
  if (o.verticalSync && !traits.supportsVerticalSync) {
    fail("vertical sync applies to schedule " + namesWhere(&ScheduleTraits::supportsVerticalSync) +
         " only (got '" + o.name +
         "'); pipedream-2bw and the flush schedules read one version per batch already");
  }
  if (o.verticalSync && !o.replicas.empty() &&
      std::adjacent_find(o.replicas.begin(), o.replicas.end(), std::not_equal_to<int>()) !=
          o.replicas.end()) {
    fail("vertical sync needs the same replica count on every stage (got replicas " +
         joined(o.replicas) + "): a version of a stage with r replicas covers r minibatches per "
         "update, so stage 0's version number means something else downstream");
  }
  if (traits.updateRule == UpdateRule::kPerMinibatch && o.batches != 1) {
    fail("schedule '" + o.name + "' updates after every minibatch, so batches does not apply (got batches=" +
         str(o.batches) + "); use batches=1 and give the number of minibatches as microbatches");
  }
  if (traits.fixedChunks > 0 && o.chunks != traits.fixedChunks) {
    fail("schedule '" + o.name + "' places exactly " + str(traits.fixedChunks) +
         " chunks per rank in a V (rank r holds stages r and 2p-1-r; got chunks=" + str(o.chunks) +
         "); use chunks=" + str(traits.fixedChunks));
  }
}

// One chunk per rank: every replica of a stage needs a microbatch, and
// asynchronous replicas equally many (they must agree on the number of
// all-reduces).
void checkReplicasHaveMicrobatches(const ScheduleOptions& o, const Layout& layout,
                                   const ScheduleTraits& traits) {
  const int m = o.microbatches;
  const auto replicas = layout.replicaCounts();
  const bool asynchronous = traits.asynchronous;
  for (int j = 0; j < layout.numStages(); ++j) {
    const int r = replicas[j];
    if (asynchronous ? m % r != 0 : m < r) {
      fail("schedule '" + o.name + "' with replicas " + joined(replicas) + " needs microbatches " +
           (asynchronous ? "to be a multiple of " : ">= ") + str(r) + " (the replicas of stage " +
           str(j) + "), got m=" + str(m) + "; use m=" + str((m + r - 1) / r * r));
    }
  }
}

// Interleaved schedules (round-robin chunks) run microbatches in equal rounds.
void checkEqualRounds(const ScheduleOptions& o) {
  const int p = o.stages;
  const int m = o.microbatches;
  const int roundSize = interleavedRoundSize(p, m);
  if (m % roundSize != 0) {
    int suggestion = m + 1;
    while (suggestion % interleavedRoundSize(p, suggestion) != 0) ++suggestion;
    fail(o.name + " splits microbatches into equal rounds of at least p (got m=" + str(m) +
         ", p=" + str(p) + ": rounds of " + str(roundSize) + " leave " + str(m % roundSize) +
         " over); use m=" + str(suggestion));
  }
}

// --- generators (ScheduleGenerator, generators.h) ----------------------------

// A schedule whose batches are alike: `batchOf` appends batch t to every rank.
using BatchGenerator = void (*)(const Layout& layout, int m, int batch, RankLists& lists);

template <BatchGenerator batchOf>
RankLists everyBatch(const ScheduleOptions& o, const Layout& layout) {
  RankLists lists(layout.numRanks());
  for (int t = 0; t < o.batches; ++t) batchOf(layout, o.microbatches, t, lists);
  return lists;
}

// A multi-chunk schedule whose ranks' orders are computed one by one (as
// torch's generators do): `orderOf(p, v, m, r)`, emitted for every batch.
using RankOrder = RankOps (*)(int p, int v, int m, int r);

RankLists rankByRank(const ScheduleOptions& o, const Layout& layout, RankOrder orderOf) {
  const int p = layout.numRanks();
  RankLists lists(p);
  for (int t = 0; t < o.batches; ++t) {
    std::vector<RankOps> order(p);
    for (int r = 0; r < p; ++r) order[r] = orderOf(p, o.chunks, o.microbatches, r);
    emitBatch(order, layout, o.microbatches, t, lists);
  }
  return lists;
}

RankLists generateInterleaved(const ScheduleOptions& o, const Layout& layout) {
  checkEqualRounds(o);
  return everyBatch<interleavedBatch>(o, layout);
}

RankLists generateZbv(const ScheduleOptions& o, const Layout& layout) {
  return rankByRank(o, layout, [](int p, int, int m, int r) { return zbvRank(p, m, r); });
}

RankLists generateDualPipeV(const ScheduleOptions& o, const Layout& layout) {
  const int p = o.stages;
  const int m = o.microbatches;
  if (m < 2 * p) {
    fail("dualpipev needs at least as many microbatches as stages (2p = " + str(2 * p) +
         " for p=" + str(p) + " ranks, got m=" + str(m) + "); use m=" + str(2 * p) +
         " or schedule 'zbv'");
  }
  return rankByRank(o, layout, [](int p, int, int m, int r) { return dualPipeVRank(p, m, r); });
}

RankLists generateInterleavedZb(const ScheduleOptions& o, const Layout& layout) {
  checkEqualRounds(o);
  return rankByRank(o, layout, interleavedZbRank);
}

// --- the registry -------------------------------------------------------------
//
// One row per schedule: its traits (what it means; traits.h documents every
// field) and its generator. Nothing else maps a name to a schedule:
// buildSchedule, scheduleTraits(), scheduleNames() and Python's
// schedules.names(), synchronous_names() and asynchronous_names() all read
// these rows, in this order.
//
// To add a schedule: write its generator above (a ScheduleGenerator: fill
// every rank's compute list on the layout buildSchedule made from the traits,
// and throw std::invalid_argument naming the fix for what only this schedule
// rules out), then add one row: a name and traits (a family below, or its
// own). tests/cpp/test_registry.cpp builds and validates every row; add the
// schedule to the validity grid (tests/cpp/test_helpers.h) and its golden
// order to test_generators.cpp.

ScheduleTraits named(ScheduleTraits traits, const char* name) {
  traits.name = name;
  return traits;
}

std::vector<RegisteredSchedule> makeRegistry() {
  ScheduleTraits flush;  // one chunk per rank, the caller steps once per batch
  flush.supportsReplicas = true;
  ScheduleTraits zeroBubble = flush;  // backward split into I and W
  zeroBubble.splitBackward = true;
  zeroBubble.plannerStraight = true;
  ScheduleTraits interleaved;  // several chunks per rank, round robin
  interleaved.multiChunk = true;
  interleaved.plannerStraight = true;
  ScheduleTraits interleavedZb = interleaved;
  interleavedZb.splitBackward = true;
  ScheduleTraits vShape = interleavedZb;  // exactly 2 chunks per rank, in a V
  vShape.fixedChunks = 2;
  vShape.chunkPlacement = ChunkPlacement::kV;
  ScheduleTraits noFlush;  // the pipeline steps the optimizer; forwards read stashed versions
  noFlush.asynchronous = true;
  noFlush.supportsReplicas = true;
  noFlush.stashWeights = true;
  noFlush.streaming = true;
  ScheduleTraits perMinibatch = noFlush;  // a step after every minibatch, replicas average
  perMinibatch.updateRule = UpdateRule::kPerMinibatch;
  perMinibatch.replicaReduction = ReplicaReduction::kMean;
  perMinibatch.supportsVerticalSync = true;
  ScheduleTraits twoVersions = noFlush;  // a step per batch, two weight versions
  twoVersions.updateRule = UpdateRule::kPerBatch;
  twoVersions.plannerTwoVersions = true;
  return {
      {named(flush, "gpipe"), everyBatch<gpipeBatch>},
      {named(flush, "1f1b"), everyBatch<oneFOneBBatch>},
      {named(interleaved, "interleaved-1f1b"), generateInterleaved},
      {named(zeroBubble, "zb-h1"), everyBatch<zbH1Batch>},
      {named(vShape, "zbv"), generateZbv},
      {named(vShape, "dualpipev"), generateDualPipeV},
      {named(interleavedZb, "interleaved-zb"), generateInterleavedZb},
      {named(perMinibatch, "pipedream"), generatePipeDream},
      {named(twoVersions, "pipedream-2bw"), generateTwoBw},
  };
}

// The row of `name`; throws std::invalid_argument naming the known schedules.
const RegisteredSchedule& registeredSchedule(const std::string& name) {
  // allScheduleTraits() is the registry's traits, row by row.
  const ScheduleTraits& traits = scheduleTraits(name);
  return scheduleRegistry()[static_cast<size_t>(&traits - allScheduleTraits().data())];
}

}  // namespace

const std::vector<RegisteredSchedule>& scheduleRegistry() {
  static const std::vector<RegisteredSchedule> rows = makeRegistry();
  return rows;
}

const std::vector<ScheduleTraits>& allScheduleTraits() {
  static const std::vector<ScheduleTraits> column = [] {
    std::vector<ScheduleTraits> traits;
    for (const auto& row : scheduleRegistry()) traits.push_back(row.traits);
    return traits;
  }();
  return column;
}

const ScheduleTraits& scheduleTraits(const std::string& name) {
  for (const auto& traits : allScheduleTraits()) {
    if (traits.name == name) return traits;
  }
  std::string list;
  for (const auto& traits : allScheduleTraits()) list += (list.empty() ? "" : ", ") + traits.name;
  throw std::invalid_argument("unknown schedule '" + name + "'; choose one of: " + list);
}

std::vector<std::string> scheduleNames() {
  std::vector<std::string> names;
  for (const auto& row : scheduleRegistry()) names.push_back(row.traits.name);
  return names;
}

int numOptimalActiveMinibatches(const std::vector<int>& replicas, int stage) {
  const int downstream = std::accumulate(replicas.begin() + stage, replicas.end(), 0);
  return (downstream + replicas[stage] - 1) / replicas[stage];
}

Schedule buildSchedule(const ScheduleOptions& o) {
  const RegisteredSchedule& row = registeredSchedule(o.name);
  const ScheduleTraits& traits = row.traits;
  checkPositive("stages", o.stages);
  checkPositive("microbatches", o.microbatches);
  checkPositive("chunks", o.chunks);
  checkPositive("batches", o.batches);
  checkOptionsAgainstTraits(o, traits);
  const Layout layout = traits.multiChunk
                            ? Layout::chunked(o.stages, o.chunks, traits.chunkPlacement)
                            : Layout::straight(o.stages, o.replicas);
  if (!traits.multiChunk) checkReplicasHaveMicrobatches(o, layout, traits);
  return Schedule(o.name, layout, o.microbatches, row.generate(o, layout), o.batches);
}

}  // namespace pipedream
