#include "planner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace pipedream {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

struct Cell {
  double t = kInf;
  int k = -1;      // split state (-1: one stage over `rep` units)
  int mPrev = -1;  // worker index (count - 1) of the prefix before the split
  int rep = 0;     // units of the last stage
};

inline long ceilDiv(long a, long b) { return (a + b - 1) / b; }

// A stage with data parallelism inside it (docs/planner.md, "Planning with data
// parallelism and sharding"): its d ranks each run their own minibatches
// (compute C each), then synchronise the stage's gradients once for those d
// minibatches, moving 2 (d-1)/d P bytes per rank (a ring all-reduce, or FSDP's
// reduce-scatter of the gradients plus all-gather of the weights). A flush
// schedule can hide neither behind compute (the reduction follows the last
// backward, the all-gather precedes the first forward), so they add.
double dataParallelStageTime(const DataParallelOptions& dp, double C, double P) {
  const double d = dp.degree;
  const double sync = dp.degree > 1 ? 2.0 * (d - 1) * P / (d * dp.bandwidth) : 0.0;
  return (C + sync) / d;
}

// Weights, gradients and optimizer state of a stage of P weight bytes per rank:
// one weight version (flush schedules), divided among the ranks under FSDP.
double dataParallelStateBytes(const DataParallelOptions& dp, double P) {
  const double state = (2.0 + dp.optimizerState) * P;
  return dp.sharding == Sharding::Fsdp ? state / dp.degree : state;
}

// Seconds of TP communication per byte of layer output per minibatch: each
// of `allReducesPerLayer` ring all-reduces (or SP's all-gather plus
// reduce-scatter, the same bytes) moves 2 (t-1)/t of the output per rank.
double tensorParallelSecondsPerByte(const TensorParallelOptions& tp) {
  if (!tp.enabled()) return 0.0;
  const double t = tp.degree;
  return tp.allReducesPerLayer * 2.0 * (t - 1) / (t * tp.bandwidth);
}

// Bytes per tp rank of activations (stashed or sent across a cut): sharded
// with sequence parallelism, else every tp rank holds them whole.
double perTensorRankActivation(const TensorParallelOptions& tp, double bytes) {
  return tp.enabled() && tp.sequenceParallel ? bytes / tp.degree : bytes;
}

double perTensorRankWeights(const TensorParallelOptions& tp, double bytes) {
  return tp.enabled() ? bytes / tp.degree : bytes;
}

struct Table {
  int n = 0, N = 0, rows = 0;
  std::vector<Cell> cells;
  Cell& at(int row, int j, int m) { return cells[(static_cast<size_t>(row) * n + j) * N + m]; }
  const Cell& at(int row, int j, int m) const {
    return cells[(static_cast<size_t>(row) * n + j) * N + m];
  }
};

struct Segment {
  int startRow;  // 0: from the start; r: after state r - 1
  int end;       // last state
  std::vector<int> ranks;
  double time;   // level-0 stage time (per minibatch, inside its unit)
  int level0Reps;
  double tensorParallelSeconds;  // the TP all-reduces the DP charged it, per minibatch
};

class Solver {
 public:
  Solver(const PlanningStates& s, const Topology& topo, const PlannerOptions& opt)
      : s_(s), topo_(topo), opt_(opt), n_(s.size()) {}

  double run() {
    const int L = static_cast<int>(topo_.levels.size());
    tables_.resize(L);
    for (int l = 0; l < L; ++l) {
      if (opt_.costModel == CostModel::PipeDream) {
        solveLevel<true>(l, l == L - 1);
      } else {
        solveLevel<false>(l, l == L - 1);
      }
    }
    return tables_[L - 1].at(0, n_ - 1, tables_[L - 1].N - 1).t;
  }

  // Final stages in pipeline order, ranks absolute.
  std::vector<Segment> segments() const {
    const int L = static_cast<int>(topo_.levels.size());
    return expand(L - 1, 0, n_ - 1, tables_[L - 1].N - 1);
  }

  // The time the DP charged for a level-0 stage: boundary transfers only for
  // the stages it added by a split (the first stage of a row has none).
  double stageTime0(int startRow, int end, int reps, bool splitStage) const {
    const TopologyLevel& lv = topo_.levels[0];
    double C = segT(0, startRow, end), P = rankP(startRow, end);
    double t = dpOn() ? dataParallelStageTime(opt_.dataParallel, C, P)
                      : compute(C, P, reps, lv.bandwidth, 1.0);
    if (boundariesPaid() && splitStage) {
      double c = opt_.compression > 0 ? opt_.compression : 1.0;
      const double links = reps * dpSide();
      t = std::max(t, 2.0 * bnd(startRow - 1) / (c * lv.bandwidth * links));
      if (end < n_ - 1) t = std::max(t, 2.0 * bnd(end) / (c * lv.bandwidth * links));
    }
    return t;
  }

 private:
  bool dpOn() const { return opt_.dataParallel.enabled(); }
  // Minibatches a stage runs side by side on its dp ranks, each crossing its
  // own boundary link (1 without data parallelism).
  double dpSide() const { return dpOn() ? opt_.dataParallel.degree : 1.0; }
  bool boundariesPaid() const {
    return opt_.costModel == CostModel::Default || opt_.compression > 0;
  }
  // Boundary bytes of `state` each rank sends (sharded by sequence parallelism).
  double bnd(int state) const {
    const double bytes =
        opt_.costModel == CostModel::PipeDream ? s_.antichainBytes[state] : s_.liveBytes[state];
    return perTensorRankActivation(opt_.tensorParallel, bytes);
  }
  // Cumulative differences (PipeDream's compute_times / activation_sizes /
  // parameter_sizes matrices: row r > 0 subtracts state r - 1 whatever the
  // order relation, which is one of its quirks).
  double segT(int level, int row, int j) const {
    if (level == 0) {
      const double C = s_.computeSeconds[j] - (row > 0 ? s_.computeSeconds[row - 1] : 0.0);
      const TensorParallelOptions& tp = opt_.tensorParallel;
      if (!tp.enabled()) return C;
      return C / tp.degree + tensorParallelSecondsPerByte(tp) * segA(row, j);
    }
    const Table& prev = tables_[level - 1];
    return prev.at(row, j, prev.N - 1).t;
  }
  double segA(int row, int j) const {
    return s_.activationBytes[j] - (row > 0 ? s_.activationBytes[row - 1] : 0.0);
  }
  double segP(int row, int j) const {
    return s_.parameterBytes[j] - (row > 0 ? s_.parameterBytes[row - 1] : 0.0);
  }
  // What one rank of a segment holds: its tp shard of the weights and of the
  // activations (the latter only with sequence parallelism).
  double rankA(int row, int j) const {
    return perTensorRankActivation(opt_.tensorParallel, segA(row, j));
  }
  double rankP(int row, int j) const {
    return perTensorRankWeights(opt_.tensorParallel, segP(row, j));
  }
  double unitWorkers(int level) const {
    if (level == 0) return 1.0;
    if (opt_.costModel == CostModel::PipeDream) return topo_.levels[level - 1].workers;
    double k = 1.0;
    for (int l = 0; l < level; ++l) k *= topo_.levels[l].workers;
    return k;
  }
  // Time of one stage of compute C and weights P over `reps` units.
  double compute(double C, double P, int reps, double B, double K) const {
    if (opt_.costModel == CostModel::PipeDream) {
      return (C + 4.0 * (reps - 1) * P / (reps * B) / K) / reps;
    }
    return std::max(C, 2.0 * (reps - 1) * P / (reps * B * K)) / reps;
  }
  bool memoryOk(double A, double P, long N, long prefixWorkers, long reps) const {
    if (topo_.memoryBytes <= 0) return true;
    if (dpOn()) {
      long inflight = ceilDiv(N - prefixWorkers + reps, reps);
      return dataParallelStateBytes(opt_.dataParallel, P) + inflight * A <= topo_.memoryBytes;
    }
    if (opt_.costModel == CostModel::PipeDream) {
      return static_cast<double>(ceilDiv(N - prefixWorkers, reps)) * (A + P) <= topo_.memoryBytes;
    }
    long inflight = ceilDiv(N - prefixWorkers + reps, reps);
    long versions = opt_.twoBw ? std::min<long>(2, inflight) : inflight;
    return versions * P + inflight * A <= topo_.memoryBytes;
  }

  template <bool PD>
  void solveLevel(int level, bool finalLevel) {
    const TopologyLevel& lv = topo_.levels[level];
    const int N = lv.workers;
    const double B = lv.bandwidth;
    // PipeDream divides only the single-stage all-reduce by the unit size.
    const double K = unitWorkers(level);
    const double Ksplit = PD ? 1.0 : K;
    const bool paid = boundariesPaid();
    const double c = opt_.compression > 0 ? opt_.compression : 1.0;
    // Data parallelism: level-0 stages pay their dp synchronisation; every
    // level divides boundary transfers among the dp ranks' links.
    const bool dp0 = dpOn() && level == 0;
    const double side = dpSide();
    Table& A = tables_[level];
    A.n = n_;
    A.N = N;
    A.rows = finalLevel ? 1 : n_ + 1;
    A.cells.assign(static_cast<size_t>(A.rows) * n_ * N, Cell{});
    const int maxSingle = opt_.straight ? 1 : N;
    const int maxRep = opt_.straight ? 1 : N - 1;
    std::vector<Cell> split(N);
    for (int row = 0; row < A.rows; ++row) {
      for (int j = row; j < n_; ++j) {
        double C = segT(level, row, j);
        double Aa = rankA(row, j), P = rankP(row, j);
        for (int m = 0; m < maxSingle; ++m) {
          const int M = m + 1;
          if (!memoryOk(Aa, P, N, M, M)) continue;
          double t = PD ? (C + 4.0 * m * P / (B * M) / K) / M
                        : std::max(C, 2.0 * m * P / (M * B * K)) / M;
          if (dp0) t = dataParallelStageTime(opt_.dataParallel, C, P);  // M = 1: straight
          A.at(row, j, m) = Cell{t, -1, -1, M};
        }
        if (j == row) continue;
        // Splits: prefix [row .. k] then a last stage (k, j] on m' units.
        std::fill(split.begin(), split.end(), Cell{});
        const std::vector<int>& preds = s_.preds[j];
        auto kBegin = std::lower_bound(preds.begin(), preds.end(), row);
        const double outB = (paid && j < n_ - 1) ? 2.0 * bnd(j) / (c * B) : 0.0;
        for (auto it = kBegin; it != preds.end(); ++it) {
          const int k = *it;
          const double Ck = segT(level, k + 1, j);
          if (Ck == kInf) continue;
          const double Ak = rankA(k + 1, j), Pk = rankP(k + 1, j);
          const double inB = paid ? 2.0 * bnd(k) / (c * B) : 0.0;
          const Cell* prefix = &A.at(row, k, 0);
          for (int mp = 1; mp <= maxRep; ++mp) {
            double last = PD ? (Ck + 4.0 * (mp - 1) * Pk / (mp * B)) / mp
                             : std::max(Ck, 2.0 * (mp - 1) * Pk / (mp * B * Ksplit)) / mp;
            if (dp0) last = dataParallelStageTime(opt_.dataParallel, Ck, Pk);  // mp = 1
            last = std::max(last, std::max(inB, outB) / (mp * side));
            for (int m = std::max(mp, 1); m < N; ++m) {
              const double pre = prefix[m - mp].t;
              if (pre == kInf) continue;
              const double v = std::max(pre, last);
              if (v < split[m].t) {
                if (!memoryOk(Ak, Pk, N, m + 1, mp)) continue;
                split[m] = Cell{v, k, m - mp, mp};
              }
            }
          }
        }
        for (int m = 0; m < N; ++m) {
          Cell cell = A.at(row, j, m);
          if (opt_.fewerWorkers && m > 0) {
            const Cell& fewer = A.at(row, j, m - 1);
            if (cell.t == kInf || fewer.t < cell.t) cell = fewer;
          }
          if (m >= 1 && split[m].t < cell.t) cell = split[m];
          A.at(row, j, m) = cell;
        }
      }
    }
  }

  // Stages of [row .. j] on m + 1 units of `level`; ranks relative to the
  // first worker of those units.
  std::vector<Segment> expand(int level, int row, int j, int m) const {
    const Table& A = tables_[level];
    // Backtrack this level: (startRow, end, reps) in pipeline order.
    struct Piece {
      int startRow, end, reps;
      bool split;
    };
    std::vector<Piece> pieces;
    int curJ = j, curM = m;
    while (true) {
      const Cell& cell = A.at(row, curJ, curM);
      if (cell.t == kInf) throw std::logic_error("planner: backtracking reached an empty cell");
      if (cell.k < 0) {
        pieces.push_back({row, curJ, cell.rep, false});
        break;
      }
      pieces.push_back({cell.k + 1, curJ, cell.rep, true});
      curJ = cell.k;
      curM = cell.mPrev;
    }
    std::reverse(pieces.begin(), pieces.end());
    long unitSize = 1;
    for (int l = 0; l < level; ++l) unitSize *= topo_.levels[l].workers;
    std::vector<Segment> out;
    int offset = 0;
    for (const Piece& pc : pieces) {
      if (level == 0) {
        const double tpSeconds =
            tensorParallelSecondsPerByte(opt_.tensorParallel) * segA(pc.startRow, pc.end);
        Segment seg{pc.startRow, pc.end, {}, stageTime0(pc.startRow, pc.end, pc.reps, pc.split),
                    pc.reps, tpSeconds};
        for (int r = 0; r < pc.reps; ++r) seg.ranks.push_back(offset + r);
        out.push_back(seg);
      } else {
        std::vector<Segment> inner =
            expand(level - 1, pc.startRow, pc.end, tables_[level - 1].N - 1);
        for (Segment& seg : inner) {
          std::vector<int> ranks;
          for (int u = offset; u < offset + pc.reps; ++u) {
            for (int r : seg.ranks) ranks.push_back(static_cast<int>(u * unitSize + r));
          }
          seg.ranks = ranks;
          out.push_back(seg);
        }
      }
      offset += pc.reps;
    }
    return out;
  }

  const PlanningStates& s_;
  const Topology& topo_;
  const PlannerOptions& opt_;
  const int n_;
  std::vector<Table> tables_;
};

double repWork(int N, bool straight) {
  if (straight) return N - 1;
  return 0.5 * N * (N - 1);
}

}  // namespace

CostModel parseCostModel(const std::string& name) {
  if (name == "pipedream") return CostModel::PipeDream;
  if (name == "default") return CostModel::Default;
  throw std::invalid_argument("unknown cost model '" + name + "'; use 'pipedream' or 'default'");
}

const char* costModelName(CostModel model) {
  return model == CostModel::PipeDream ? "pipedream" : "default";
}

Sharding parseSharding(const std::string& name) {
  if (name == "replicate") return Sharding::Replicate;
  if (name == "fsdp") return Sharding::Fsdp;
  throw std::invalid_argument("unknown sharding '" + name + "'; use 'fsdp' or 'replicate'");
}

const char* shardingName(Sharding sharding) {
  return sharding == Sharding::Fsdp ? "fsdp" : "replicate";
}

double estimateWork(const PlanningStates& states, const Topology& topology, bool straight) {
  double pairs = 0, weighted = 0;
  for (int j = 0; j < states.size(); ++j) {
    for (int k : states.preds[j]) {
      pairs += 1;
      weighted += k + 1;
    }
  }
  const int L = static_cast<int>(topology.levels.size());
  double n = states.size();
  double work = 0;
  for (int l = 0; l < L; ++l) {
    int N = topology.levels[l].workers;
    if (l == L - 1) {
      work += pairs * repWork(N, straight) + n * N;
    } else {
      work += (pairs + weighted) * repWork(N, straight) + n * n * N;
    }
  }
  return work;
}

namespace {
double chainWork(double L, const Topology& topology, bool straight) {
  double pairs = L * (L - 1) / 2, weighted = (L - 1) * L * (L + 1) / 6;
  const int levels = static_cast<int>(topology.levels.size());
  double work = 0;
  for (int l = 0; l < levels; ++l) {
    int N = topology.levels[l].workers;
    work += (l == levels - 1) ? pairs * repWork(N, straight) + L * N
                              : (pairs + weighted) * repWork(N, straight) + L * L * N;
  }
  return work;
}
// Data parallelism over every worker under the same cost model.
// With data parallelism inside stages, its ranks are the innermost level.
double dataParallelTime(const PlanningStates& states, const Topology& topology,
                        const PlannerOptions& options) {
  const CostModel model = options.costModel;
  const int n = states.size();
  const double totalP = states.parameterBytes[n - 1];
  double dp = states.computeSeconds[n - 1], unit = 1.0;
  std::vector<TopologyLevel> levels = topology.levels;
  if (options.dataParallel.degree > 1) {
    levels.insert(levels.begin(), {options.dataParallel.degree, options.dataParallel.bandwidth});
  }
  if (options.tensorParallel.enabled()) {
    const TensorParallelOptions& tp = options.tensorParallel;
    levels.insert(levels.begin(), {tp.degree, tp.bandwidth});
  }
  for (const TopologyLevel& lv : levels) {
    const double N = lv.workers;
    if (model == CostModel::PipeDream) {
      dp = (dp + 4.0 * (N - 1) * totalP / (lv.bandwidth * N) / unit) / N;
      unit = N;
    } else {
      dp = std::max(dp, 2.0 * (N - 1) * totalP / (N * lv.bandwidth * unit)) / N;
      unit *= N;
    }
  }
  return dp;
}

// The stage of every graph node: what a segment's end state adds
// (PipeDream's assignment), then Input sources to stage 0 and dropped sinks
// beside their producers.
std::vector<int> stageOfNodes(const ProfileGraph& graph, const PlanningStates& states,
                              const std::vector<Segment>& segs) {
  const int p = static_cast<int>(states.planNodes.size());
  std::vector<int> stageOf(graph.numNodes(), -1);
  for (size_t s = 0; s < segs.size(); ++s) {
    for (int q = 0; q < p; ++q) {
      int v = states.planNodes[q];
      if (stageOf[v] < 0 && states.contains(segs[s].end, q)) stageOf[v] = static_cast<int>(s);
    }
  }
  for (int v : graph.topologicalOrder()) {
    if (stageOf[v] >= 0) continue;
    int st = 0;
    for (int u : graph.predecessors(v)) st = std::max(st, stageOf[u]);
    stageOf[v] = st;
  }
  return stageOf;
}

// One PlanStage per segment (ranks, replicas, time); returns the workers used.
int makeStages(const std::vector<Segment>& segs, Plan& plan) {
  plan.stages.resize(segs.size());
  int used = 0;
  for (size_t s = 0; s < segs.size(); ++s) {
    PlanStage& st = plan.stages[s];
    st.replicas = static_cast<int>(segs[s].ranks.size());
    st.ranks = segs[s].ranks;
    std::sort(st.ranks.begin(), st.ranks.end());
    // Cross-unit replicas divide the in-unit time (see docs/planner.md).
    st.time = segs[s].time * segs[s].level0Reps / st.replicas;
    st.tensorParallelSeconds = segs[s].tensorParallelSeconds;
    used += st.replicas;
  }
  return used;
}

// Each stage's nodes and their compute, parameter and activation totals
// (Input sources count for nothing).
void addNodes(const ProfileGraph& graph, const std::vector<int>& stageOf, Plan& plan) {
  for (int v = 0; v < graph.numNodes(); ++v) {
    PlanStage& st = plan.stages[stageOf[v]];
    st.nodes.push_back(v);
    const GraphNode& node = graph.node(v);
    if (node.isInput() && graph.predecessors(v).empty()) continue;
    st.computeSeconds += (node.forwardMs + node.backwardMs) / 1000.0;
    st.parameterBytes += node.parameterBytes;
    st.activationBytes += node.activationBytes;
  }
}

// Each stage's memory: weight versions and activations of the microbatches
// in flight from it to the end of the pipeline.
void estimateStageMemory(Plan& plan, const PlannerOptions& options) {
  const TensorParallelOptions& tp = options.tensorParallel;
  long workersFrom = plan.usedWorkers;
  for (PlanStage& st : plan.stages) {
    const double P = perTensorRankWeights(tp, st.parameterBytes);
    long inflight = ceilDiv(workersFrom, st.replicas);
    long versions = (options.costModel == CostModel::Default && options.twoBw)
                        ? std::min<long>(2, inflight)
                        : inflight;
    st.modelStateBytes = options.dataParallel.enabled()
                             ? dataParallelStateBytes(options.dataParallel, P)
                             : versions * P;
    st.stashedActivationBytes = inflight * perTensorRankActivation(tp, st.activationBytes);
    st.memoryBytes = st.modelStateBytes + st.stashedActivationBytes;
    workersFrom -= st.replicas;
  }
}

// Throws std::invalid_argument naming a data-parallel option the planner
// cannot honour and the fix.
void checkDataParallel(const PlannerOptions& options) {
  const DataParallelOptions& dp = options.dataParallel;
  if (dp.degree < 0 || dp.degree > 65536) {
    throw std::invalid_argument("data-parallel degree " + std::to_string(dp.degree) +
                                " is invalid; use 1 or more ranks per stage, or 0 for none");
  }
  if (!dp.enabled()) return;
  if (options.costModel != CostModel::Default) {
    throw std::invalid_argument(
        "data parallelism inside stages is planned with the default cost model, not '" +
        std::string(costModelName(options.costModel)) + "'; use cost model 'default'");
  }
  if (options.twoBw) {
    throw std::invalid_argument(
        "two weight versions (2BW) describe asynchronous PipeDream-2BW, but data parallelism "
        "inside stages assumes a flush schedule (one version); drop two_bw");
  }
  if (dp.degree > 1 && (!(dp.bandwidth > 0) || !std::isfinite(dp.bandwidth))) {
    throw std::invalid_argument("data-parallel bandwidth " + std::to_string(dp.bandwidth) +
                                " bytes/s is invalid; use a positive number such as 16e9");
  }
  if (!(dp.optimizerState >= 0) || !std::isfinite(dp.optimizerState)) {
    throw std::invalid_argument("optimizer state " + std::to_string(dp.optimizerState) +
                                " bytes per weight byte is invalid; use 2 for AdamW, 1 for SGD "
                                "with momentum, 0 for plain SGD");
  }
}

// Throws std::invalid_argument naming a tensor-parallel option the planner
// cannot honour and the fix.
void checkTensorParallel(const PlannerOptions& options) {
  const TensorParallelOptions& tp = options.tensorParallel;
  if (tp.degree < 1 || tp.degree > 65536) {
    throw std::invalid_argument("tensor-parallel degree " + std::to_string(tp.degree) +
                                " is invalid; use 1 or more ranks per stage (1: none)");
  }
  if (!tp.enabled()) return;
  if (!options.dataParallel.enabled()) {
    throw std::invalid_argument(
        "tensor parallelism inside stages plans a (pp, dp, tp) mesh; turn data parallelism "
        "on too (degree 1 for a mesh without a dp dimension)");
  }
  if (!(tp.bandwidth > 0) || !std::isfinite(tp.bandwidth)) {
    throw std::invalid_argument("tensor-parallel bandwidth " + std::to_string(tp.bandwidth) +
                                " bytes/s is invalid; use a positive number such as 1e11 "
                                "(the tp ranks of a stage share a node)");
  }
  if (!(tp.allReducesPerLayer >= 0) || !std::isfinite(tp.allReducesPerLayer)) {
    throw std::invalid_argument("tensor-parallel all-reduces per layer " +
                                std::to_string(tp.allReducesPerLayer) +
                                " is invalid; use 4 for a transformer block (2 forward, 2 "
                                "backward), 0 to leave TP communication out");
  }
}

std::string memoryError(const Topology& topology, const PlannerOptions& options) {
  std::string msg = "no partition fits the memory limit of " +
                    std::to_string(topology.memoryBytes) + " bytes per worker (" +
                    std::to_string(topology.totalWorkers()) + " workers";
  const DataParallelOptions& dp = options.dataParallel;
  if (!dp.enabled()) return msg + "); raise the limit, add workers, or drop the limit";
  const TensorParallelOptions& tp = options.tensorParallel;
  const std::string tpRanks =
      tp.enabled() ? " x " + std::to_string(tp.degree) + " tensor-parallel ranks" +
                         (tp.sequenceParallel ? " with sequence parallelism" : "")
                   : std::string();
  msg += " x " + std::to_string(dp.degree) + " data-parallel ranks" + tpRanks + ", sharding '" +
         shardingName(dp.sharding) + "'); raise the limit, add pipeline workers, or drop the limit";
  if (tp.enabled() && !tp.sequenceParallel) {
    msg += ", or use sequence parallelism (divides stashed activations by " +
           std::to_string(tp.degree) + ")";
  }
  if (dp.sharding == Sharding::Replicate && dp.degree > 1) {
    msg += ", or use sharding 'fsdp' (divides weights, gradients and optimizer state by " +
           std::to_string(dp.degree) + ")";
  }
  return msg;
}

// For a chain graph: each stage's [layerStart, layerEnd) (Input excluded);
// a stage without layers gets an empty range where the previous one ended.
void assignLayers(const ProfileGraph& graph, Plan& plan) {
  std::vector<int> order;
  if (!graph.isChain(&order)) return;
  plan.chain = true;
  const int skip = graph.node(order[0]).isInput() ? 1 : 0;
  std::vector<int> layerOf(graph.numNodes(), -1);
  for (size_t i = skip; i < order.size(); ++i) layerOf[order[i]] = static_cast<int>(i) - skip;
  int next = 0;
  for (PlanStage& st : plan.stages) {
    int lo = -1, hi = -1;
    for (int v : st.nodes) {
      if (layerOf[v] < 0) continue;
      lo = lo < 0 ? layerOf[v] : std::min(lo, layerOf[v]);
      hi = std::max(hi, layerOf[v] + 1);
    }
    if (lo < 0) lo = hi = next;
    st.layerStart = lo;
    st.layerEnd = hi;
    next = hi;
  }
}

// The most stages a plan over `states` on `topology` can have. Every stage
// ends at a state of higher index than the one before, so at most one per
// state; on one level the stages follow the subset relation (preds), so at
// most the longest chain of states. (Lower levels of a hierarchy take
// PipeDream's segments "after state r - 1", which need not be subsets.)
int maxStages(const PlanningStates& states, const Topology& topology) {
  if (topology.levels.size() != 1) return states.size();
  std::vector<int> longest(states.size(), 1);
  for (int j = 0; j < states.size(); ++j) {
    for (int k : states.preds[j]) longest[j] = std::max(longest[j], longest[k] + 1);
  }
  return longest.empty() ? 0 : longest.back();
}

// The stages a plan must have: one per worker when it may neither replicate
// stages (straight, or data parallelism inside them) nor leave workers unused.
int stagesNeeded(const Topology& topology, const PlannerOptions& options) {
  const bool straight = options.straight || options.dataParallel.enabled();
  return straight && !options.fewerWorkers ? topology.totalWorkers() : 1;
}

// Throws std::invalid_argument when `states` cannot hold the stages a plan
// needs (a straight plan has a stage per worker, each at least one state).
void checkEnoughStates(const PlanningStates& states, const Topology& topology,
                       const PlannerOptions& options) {
  const int needed = stagesNeeded(topology, options);
  const int most = maxStages(states, topology);
  if (most >= needed) return;
  const bool dp = options.dataParallel.enabled();
  const std::string workers = dp ? "pipeline workers" : "workers";
  throw std::invalid_argument(
      "a straight plan on " + std::to_string(needed) + " " + workers + " needs " +
      std::to_string(needed) + " stages (one per worker, each at least one layer), but the profile "
      "splits into at most " + std::to_string(most) + " (" + std::to_string(states.size()) +
      " planning states, " + std::to_string(states.planNodes.size()) + " layers); plan on at most " +
      std::to_string(most) + " " + workers + ", pass fewer_workers=True" +
      (dp ? std::string() : std::string(", or allow replicated stages (straight=False)")));
}

// What no plan means: a memory limit no partition fits, or (without a limit)
// a case the checks before the search should have named.
std::string noPlanError(const PlanningStates& states, const Topology& topology,
                        const PlannerOptions& options) {
  if (topology.memoryBytes > 0) return memoryError(topology, options);
  return "no partition of the profile's " + std::to_string(states.size()) + " planning states over " +
         std::to_string(topology.totalWorkers()) + " workers exists (no memory limit was set; this is "
         "a planner bug, please report it with the profile)";
}
}  // namespace

Plan planOnStates(const ProfileGraph& graph, const PlanningStates& states, const Topology& topology,
                  const PlannerOptions& requested) {
  topology.validate();
  if (requested.compression < 0 || !std::isfinite(requested.compression)) {
    throw std::invalid_argument("activation compression ratio " + std::to_string(requested.compression) +
                                " is invalid; use a positive ratio or leave it out");
  }
  checkDataParallel(requested);
  checkTensorParallel(requested);
  PlannerOptions options = requested;
  // Data parallelism inside stages replaces PipeDream's replicas.
  if (options.dataParallel.enabled()) options.straight = true;
  const int n = states.size();
  checkEnoughStates(states, topology, options);
  Solver solver(states, topology, options);
  const double best = solver.run();
  if (best == kInf) throw std::invalid_argument(noPlanError(states, topology, options));
  Plan plan;
  plan.costModel = options.costModel;
  plan.stateKind = states.kind;
  plan.numStates = n;
  plan.topology = topology;
  plan.numWorkers = topology.totalWorkers();
  plan.timePerStage = best;

  plan.dataParallelTime = dataParallelTime(states, topology, options);
  plan.singleWorkerTime = states.computeSeconds[n - 1];
  plan.speedupOverDp = best > 0 ? plan.dataParallelTime / best : kInf;

  const std::vector<Segment> segs = solver.segments();
  plan.usedWorkers = makeStages(segs, plan);
  addNodes(graph, stageOfNodes(graph, states, segs), plan);
  estimateStageMemory(plan, options);
  assignLayers(graph, plan);
  return plan;
}

namespace {

// Topological cuts thinned to the work budget, but never below `needed`
// states (a straight plan's stages) while the full order has them.
PlanningStates coarsenedCuts(const ProfileGraph& graph, PlanningStates full, const Topology& topology,
                             bool straight, const PlannerOptions& options, int needed, bool* coarsened) {
  const int n = full.size();
  int L = n;
  while (L > 2 && chainWork(L, topology, straight) > options.workBudget) {
    L = static_cast<int>(L * 0.9);
  }
  const int floor = std::min(n, needed);
  L = std::max(L, floor);
  *coarsened = L < n;
  if (!*coarsened) return full;
  // Cuts are kept one per compute bucket: empty buckets give fewer states
  // than asked, so ask for more until a straight plan fits.
  PlanningStates states = topologicalCutStates(graph, L);
  while (states.size() < floor && L < n) {
    L = std::min(n, L + (floor - states.size()));
    states = topologicalCutStates(graph, L);
  }
  if (L >= n) *coarsened = false;
  return L >= n ? full : states;
}

}  // namespace

Plan planPartition(const ProfileGraph& graph, const Topology& topology,
                   const PlannerOptions& options) {
  topology.validate();
  const bool straight = options.straight || options.dataParallel.enabled();
  const int needed = stagesNeeded(topology, options);
  PlanningStates states;
  bool antichain = enumerateAntichainStates(graph, options.maxAntichainStates, &states) &&
                   estimateWork(states, topology, straight) <= options.workBudget &&
                   maxStages(states, topology) >= needed;
  bool coarsened = false;
  if (!antichain) {
    states = coarsenedCuts(graph, topologicalCutStates(graph, 0), topology, straight, options, needed,
                           &coarsened);
  }
  Plan plan = planOnStates(graph, states, topology, options);
  plan.coarsened = coarsened;
  return plan;
}

}  // namespace pipedream
