// The planner's DP against exhaustive search, golden plans, path selection.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>

#include "planner.h"
#include "test_helpers.h"

namespace pipedream {
namespace {

using testing_helpers::errorOf;

constexpr double kInf = std::numeric_limits<double>::infinity();

std::string dataPath(const std::string& name) {
  return std::string(PIPEDREAM_SOURCE_DIR) + "/tests/data/profiles/" + name;
}

GraphNode makeNode(const std::string& id, const std::string& desc, double f, double b, double a,
                   double p) {
  GraphNode n;
  n.id = id;
  n.description = desc;
  n.forwardMs = f;
  n.backwardMs = b;
  n.activationBytes = a;
  n.parameterBytes = p;
  return n;
}

ProfileGraph randomChain(std::mt19937& rng, int layers) {
  std::uniform_real_distribution<double> ms(0.5, 20.0), bytes(1e5, 5e7);
  ProfileGraph g;
  g.addNode(makeNode("node0", "Input", 0, 0, bytes(rng), 0));
  for (int i = 1; i <= layers; ++i) {
    double p = (rng() % 3 == 0) ? 0.0 : bytes(rng);
    g.addNode(makeNode("node" + std::to_string(i), "Layer", ms(rng), ms(rng), bytes(rng), p));
    g.addEdge(i - 1, i);
  }
  return g;
}

// Input then `nodes` layers; each layer has 1-2 predecessors among earlier ones.
ProfileGraph randomDag(std::mt19937& rng, int nodes) {
  std::uniform_real_distribution<double> ms(0.5, 20.0), bytes(1e5, 5e7);
  ProfileGraph g;
  g.addNode(makeNode("node0", "Input", 0, 0, bytes(rng), 0));
  for (int i = 1; i <= nodes; ++i) {
    double p = (rng() % 3 == 0) ? 0.0 : bytes(rng);
    g.addNode(makeNode("node" + std::to_string(i), "Layer", ms(rng), ms(rng), bytes(rng), p));
    if (i == 1) {
      g.addEdge(0, 1);
      continue;
    }
    int a = 1 + static_cast<int>(rng() % (i - 1));
    g.addEdge(a, i);
    int b = 1 + static_cast<int>(rng() % (i - 1));
    if (b != a && rng() % 2 == 0) g.addEdge(b, i);
  }
  return g;
}

bool isSubset(const PlanningStates& s, int k, int j) {
  if (k == j) return false;
  for (int w = 0; w < s.words; ++w) {
    if (s.member[k][w] & ~s.member[j][w]) return false;
  }
  return true;
}

// Exhaustive search over every sequence of nested states, replica counts and
// (with fewer workers) unused gaps, written from the cost model's definition
// in docs/planner.md independently of the DP.
struct Brute {
  const PlanningStates& s;
  int N;
  double B, mem;
  PlannerOptions o;
  double best = kInf;

  double stage(int prev, int e, int r, long prefixWorkers) const {
    const int n = s.size();
    double T = s.computeSeconds[e] - (prev >= 0 ? s.computeSeconds[prev] : 0.0);
    double P = s.parameterBytes[e] - (prev >= 0 ? s.parameterBytes[prev] : 0.0);
    double A = s.activationBytes[e] - (prev >= 0 ? s.activationBytes[prev] : 0.0);
    bool pd = o.costModel == CostModel::PipeDream;
    // docs/planner.md, tensor parallelism: per tp rank 1/t of the compute plus
    // the all-reduces of the layers' outputs, 1/t of the weights, and with SP
    // 1/t of the activations and of the boundary sends.
    const TensorParallelOptions& tp = o.tensorParallel;
    const double tpDiv = tp.enabled() ? tp.degree : 1.0;
    const double actDiv = tp.enabled() && tp.sequenceParallel ? tpDiv : 1.0;
    if (tp.enabled()) {
      T = T / tpDiv + tp.allReducesPerLayer * 2.0 * (tpDiv - 1) / (tpDiv * tp.bandwidth) * A;
      P /= tpDiv;
      A /= actDiv;
    }
    const DataParallelOptions& dp = o.dataParallel;
    const double d = dp.enabled() ? dp.degree : 1.0;
    if (dp.enabled() && mem > 0) {
      // docs/planner.md: (2 + o) P [/ d under FSDP] + in-flight minibatches x A.
      double state = (2.0 + dp.optimizerState) * P / (dp.sharding == Sharding::Fsdp ? d : 1.0);
      if (state + static_cast<double>(N - prefixWorkers + 1) * A > mem) return kInf;
    } else if (mem > 0) {
      if (pd) {
        double stash = std::ceil(static_cast<double>(N - prefixWorkers) / r) * (A + P);
        if (stash > mem) return kInf;
      } else {
        double inflight = std::ceil(static_cast<double>(N - prefixWorkers + r) / r);
        double versions = o.twoBw ? std::min(2.0, inflight) : inflight;
        if (versions * P + inflight * A > mem) return kInf;
      }
    }
    double t = pd ? (T + 4.0 * (r - 1) * P / (r * B)) / r
                  : std::max(T, 2.0 * (r - 1) * P / (r * B)) / r;
    if (dp.enabled()) t = (T + (d > 1 ? 2.0 * (d - 1) * P / (d * dp.bandwidth) : 0.0)) / d;
    bool paid = !pd || o.compression > 0;
    if (paid && prev >= 0) {
      double c = o.compression > 0 ? o.compression : 1.0;
      auto bnd = [&](int st) { return (pd ? s.antichainBytes[st] : s.liveBytes[st]) / actDiv; };
      t = std::max(t, 2.0 * bnd(prev) / (c * B * r * d));
      if (e < n - 1) t = std::max(t, 2.0 * bnd(e) / (c * B * r * d));
    }
    return t;
  }

  void rec(int prev, long used, double curMax) {
    const int n = s.size();
    for (int e = 0; e < n; ++e) {
      if (prev >= 0 && !isSubset(s, prev, e)) continue;
      const int maxR = (o.straight || o.dataParallel.enabled()) ? 1 : N;
      for (int r = 1; r <= maxR; ++r) {
        const int maxGap = (o.fewerWorkers && prev >= 0) ? N : 0;
        for (int g = 0; g <= maxGap; ++g) {
          long budget = used + g + r;
          if (budget > N) break;
          double v = std::max(curMax, stage(prev, e, r, budget));
          if (v == kInf) continue;
          if (e == n - 1) {
            if (o.fewerWorkers || budget == N) best = std::min(best, v);
          } else {
            rec(e, budget, v);
          }
        }
      }
    }
  }
};

double bruteForce(const PlanningStates& s, int N, double B, double mem, const PlannerOptions& o) {
  Brute b{s, N, B, mem, o};
  b.rec(-1, 0, 0.0);
  return b.best;
}

void compareWithBruteForce(const ProfileGraph& g, const PlanningStates& states, std::mt19937& rng,
                           const std::string& what) {
  for (CostModel model : {CostModel::PipeDream, CostModel::Default}) {
    for (int variant = 0; variant < 6; ++variant) {
      PlannerOptions o;
      o.costModel = model;
      o.straight = variant == 1;
      o.fewerWorkers = variant == 2 || variant == 5;
      o.compression = variant == 3 ? 2.0 : 0.0;
      o.twoBw = variant == 4;
      Topology t;
      const int N = 1 + static_cast<int>(rng() % 4);
      t.levels = std::vector<TopologyLevel>{{N, (rng() % 2) ? 1.25e9 : 16e9}};
      // A memory limit that binds for some candidates (variants 4 and 5).
      double total = states.parameterBytes.back() + states.activationBytes.back();
      t.memoryBytes = (variant >= 4) ? total * (0.6 + 0.8 * (rng() % 100) / 100.0) : 0.0;
      double expected = bruteForce(states, N, t.levels[0].bandwidth, t.memoryBytes, o);
      std::string ctx = what + " model=" + costModelName(model) + " variant=" +
                        std::to_string(variant) + " N=" + std::to_string(N);
      if (expected == kInf) {
        EXPECT_THROW(planOnStates(g, states, t, o), std::invalid_argument) << ctx;
        continue;
      }
      Plan p = planOnStates(g, states, t, o);
      EXPECT_NEAR(p.timePerStage, expected, 1e-12 * std::max(1.0, expected)) << ctx;
      // The returned partition achieves the optimum it reports.
      double worst = 0;
      for (const PlanStage& st : p.stages) worst = std::max(worst, st.time);
      EXPECT_NEAR(worst, p.timePerStage, 1e-12 * std::max(1.0, worst)) << ctx;
      int used = 0;
      for (const PlanStage& st : p.stages) used += st.replicas;
      if (o.fewerWorkers) {
        EXPECT_LE(used, N) << ctx;
      } else {
        EXPECT_EQ(used, N) << ctx;
      }
      if (o.straight) {
        for (const PlanStage& st : p.stages) EXPECT_EQ(st.replicas, 1) << ctx;
      }
    }
  }
}

// Plans `a` and `b` cut alike: the same times, and every stage the same nodes, ranks and time.
void expectSameCuts(const Plan& a, const Plan& b, const std::string& name) {
  EXPECT_EQ(a.timePerStage, b.timePerStage) << name;
  EXPECT_EQ(a.dataParallelTime, b.dataParallelTime) << name;
  ASSERT_EQ(a.stages.size(), b.stages.size()) << name;
  for (size_t j = 0; j < a.stages.size(); ++j) {
    EXPECT_EQ(a.stages[j].nodes, b.stages[j].nodes) << name;
    EXPECT_EQ(a.stages[j].ranks, b.stages[j].ranks) << name;
    EXPECT_EQ(a.stages[j].time, b.stages[j].time) << name;
  }
}

TEST(PlannerBruteForce, RandomChainsMatchExhaustiveSearch) {
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 25; ++trial) {
    ProfileGraph g = randomChain(rng, 2 + static_cast<int>(rng() % 5));
    PlanningStates s;
    ASSERT_TRUE(enumerateAntichainStates(g, 1000, &s));
    compareWithBruteForce(g, s, rng, "chain trial " + std::to_string(trial));
  }
}

// Data parallelism inside stages: the DP against the exhaustive search, for dp
// degrees 1-3, both shardings, with and without a binding memory limit, and
// tensor parallelism of degree 1-3 with and without sequence parallelism.
void compareDataParallelWithBruteForce(const ProfileGraph& g, const PlanningStates& states,
                                       std::mt19937& rng, const std::string& what) {
  for (int variant = 0; variant < 6; ++variant) {
    PlannerOptions o;
    o.dataParallel.degree = 1 + variant % 3;
    o.dataParallel.sharding = variant % 2 ? Sharding::Fsdp : Sharding::Replicate;
    o.dataParallel.bandwidth = (rng() % 2) ? 1e9 : 16e9;
    o.dataParallel.optimizerState = static_cast<double>(rng() % 3);
    o.fewerWorkers = variant == 5;
    o.tensorParallel.degree = 1 + static_cast<int>(rng() % 3);
    o.tensorParallel.sequenceParallel = rng() % 2;
    o.tensorParallel.bandwidth = (rng() % 2) ? 1e9 : 1e11;
    o.tensorParallel.allReducesPerLayer = static_cast<double>(rng() % 5);
    Topology t;
    const int N = 1 + static_cast<int>(rng() % 4);
    t.levels = std::vector<TopologyLevel>{{N, (rng() % 2) ? 1.25e9 : 16e9}};
    double total = states.parameterBytes.back() + states.activationBytes.back();
    const double perRank = total / o.tensorParallel.degree;
    t.memoryBytes = (variant >= 3) ? perRank * (0.6 + 2.0 * (rng() % 100) / 100.0) : 0.0;
    double expected = bruteForce(states, N, t.levels[0].bandwidth, t.memoryBytes, o);
    std::string ctx = what + " dp variant=" + std::to_string(variant) + " N=" + std::to_string(N) +
                      " tp=" + std::to_string(o.tensorParallel.degree) +
                      (o.tensorParallel.sequenceParallel ? " sp" : "");
    if (expected == kInf) {
      EXPECT_THROW(planOnStates(g, states, t, o), std::invalid_argument) << ctx;
      continue;
    }
    Plan p = planOnStates(g, states, t, o);
    EXPECT_NEAR(p.timePerStage, expected, 1e-12 * std::max(1.0, expected)) << ctx;
    double worst = 0;
    for (const PlanStage& st : p.stages) {
      worst = std::max(worst, st.time);
      EXPECT_EQ(st.replicas, 1) << ctx;
      if (t.memoryBytes > 0) EXPECT_LE(st.memoryBytes, t.memoryBytes * (1 + 1e-12)) << ctx;
    }
    EXPECT_NEAR(worst, p.timePerStage, 1e-12 * std::max(1.0, worst)) << ctx;
  }
}

TEST(PlannerBruteForce, DataParallelMatchesExhaustiveSearch) {
  std::mt19937 rng(2024);
  for (int trial = 0; trial < 25; ++trial) {
    ProfileGraph chain = randomChain(rng, 2 + static_cast<int>(rng() % 5));
    PlanningStates s;
    ASSERT_TRUE(enumerateAntichainStates(chain, 1000, &s));
    compareDataParallelWithBruteForce(chain, s, rng, "chain trial " + std::to_string(trial));
    ProfileGraph dag = randomDag(rng, 3 + static_cast<int>(rng() % 4));
    ASSERT_TRUE(enumerateAntichainStates(dag, 1000, &s));
    compareDataParallelWithBruteForce(dag, s, rng, "dag trial " + std::to_string(trial));
  }
}

TEST(PlannerBruteForce, RandomDagsMatchExhaustiveSearchOnBothStateKinds) {
  std::mt19937 rng(99);
  for (int trial = 0; trial < 25; ++trial) {
    ProfileGraph g = randomDag(rng, 3 + static_cast<int>(rng() % 4));
    PlanningStates s;
    ASSERT_TRUE(enumerateAntichainStates(g, 1000, &s));
    compareWithBruteForce(g, s, rng, "dag antichain trial " + std::to_string(trial));
    compareWithBruteForce(g, topologicalCutStates(g), rng, "dag cuts trial " + std::to_string(trial));
  }
}

// A literal port of PipeDream's optimizer_graph_hierarchical.py main loop and
// compute_partitioning (loop order i, m, j, k, m'; None as std::optional),
// with the default model's formulas swapped in when asked. Checks the
// restructured, hierarchical DP in planner.cpp level by level.
double pipedreamReference(const PlanningStates& s, const Topology& topo, const PlannerOptions& o) {
  using Opt = std::optional<double>;
  struct Entry {
    Opt t;
  };
  const int n = s.size();
  const bool pd = o.costModel == CostModel::PipeDream;
  const bool useMem = topo.memoryBytes > 0;
  const double c = o.compression > 0 ? o.compression : 1.0;
  auto out = [&](int st) { return pd ? s.antichainBytes[st] : s.liveBytes[st]; };
  auto isPred = [&](int k, int j) {
    return std::find(s.preds[j].begin(), s.preds[j].end(), k) != s.preds[j].end();
  };
  // compute_times / activation_sizes / parameter_sizes: rows 0..n, cols 0..n-1.
  std::vector<std::vector<Opt>> ct(n + 1, std::vector<Opt>(n));
  auto diff = [&](const std::vector<double>& v, int i, int j) {
    return i == 0 ? v[j] : v[j] - v[i - 1];
  };
  for (int i = 0; i <= n; ++i) {
    for (int j = 0; j < n; ++j) {
      if (i == 0 || j > i - 1) ct[i][j] = diff(s.computeSeconds, i, j);
    }
  }
  double unit = 1.0, product = 1.0;
  std::vector<std::vector<std::vector<Entry>>> A;
  const int L = static_cast<int>(topo.levels.size());
  for (int level = 0; level < L; ++level) {
    const int N = topo.levels[level].workers;
    const double B = topo.levels[level].bandwidth;
    const double K = pd ? unit : product;
    const bool finalLevel = level == L - 1;
    A.assign(n + 1, std::vector<std::vector<Entry>>(n, std::vector<Entry>(N)));
    for (int i = 0; i <= n; ++i) {
      for (int j = i; j < n; ++j) {
        const double Aa = diff(s.activationBytes, i, j), P = diff(s.parameterBytes, i, j);
        const int maxM = o.straight ? 1 : N;
        for (int m = 0; m < maxM; ++m) {
          double stash;
          if (pd) {
            stash = std::ceil(static_cast<double>(N - (m + 1)) / (m + 1)) * (Aa + P);
          } else {
            double inflight = std::ceil(static_cast<double>(N) / (m + 1));
            stash = (o.twoBw ? std::min(2.0, inflight) : inflight) * P + inflight * Aa;
          }
          if (useMem && stash > topo.memoryBytes) continue;
          if (!ct[i][j]) continue;
          double t = pd ? (*ct[i][j] + 4.0 * m * P / (B * (m + 1)) / K) / (m + 1)
                        : std::max(*ct[i][j], 2.0 * m * P / ((m + 1) * B * K)) / (m + 1);
          A[i][j][m].t = t;
        }
      }
    }
    const int maxI = finalLevel ? 1 : n + 1;
    for (int i = 0; i < maxI; ++i) {
      for (int m = 1; m < N; ++m) {
        for (int j = i + 1; j < n; ++j) {
          Opt best = A[i][j][m].t;
          if (o.fewerWorkers && m > 0 && (!best || (A[i][j][m - 1].t && *A[i][j][m - 1].t < *best))) {
            best = A[i][j][m - 1].t;
          }
          for (int k : s.preds[j]) {
            if (i > 0 && isPred(k, i - 1)) continue;
            const int maxMp = o.straight ? 2 : m + 1;
            for (int mp = 1; mp < maxMp; ++mp) {
              double in = 2.0 * out(k) / (B * mp);
              Opt outT;
              if (j < n - 1) outT = 2.0 * out(j) / (B * mp);
              if (!ct[k + 1][j]) continue;
              const double lastP = diff(s.parameterBytes, k + 1, j);
              const double lastA = diff(s.activationBytes, k + 1, j);
              double stash;
              if (pd) {
                stash = (lastA + lastP) * std::ceil(static_cast<double>(N - (m + 1)) / mp);
              } else {
                double inflight = std::ceil(static_cast<double>(N - (m + 1) + mp) / mp);
                stash = (o.twoBw ? std::min(2.0, inflight) : inflight) * lastP + inflight * lastA;
              }
              if (useMem && stash > topo.memoryBytes) continue;
              double last = pd ? (*ct[k + 1][j] + 4.0 * (mp - 1) * lastP / (B * mp)) / mp
                               : std::max(*ct[k + 1][j], 2.0 * (mp - 1) * lastP / (mp * B * K)) / mp;
              if (!A[i][k][m - mp].t) continue;
              double pt = std::max(*A[i][k][m - mp].t, last);
              if (!pd || o.compression > 0) {
                pt = std::max(pt, in / c);
                if (outT) pt = std::max(pt, *outT / c);
              }
              if (!best || *best > pt) best = pt;
            }
          }
          A[i][j][m].t = best;
        }
      }
    }
    for (int i = 0; i <= n; ++i) {
      for (int j = 0; j < n; ++j) ct[i][j] = A[i][j][N - 1].t;
    }
    unit = N;
    product *= N;
  }
  Opt r = A[0][n - 1].back().t;
  return r ? *r : kInf;
}

TEST(PlannerHierarchy, MatchesALiteralPortOfPipeDreamsLoops) {
  std::mt19937 rng(2024);
  const std::vector<std::vector<int>> shapes = {{2, 2}, {3, 2}, {2, 3}, {1, 3}, {3, 1}, {2, 2, 2}};
  int compared = 0, infeasible = 0;
  for (int trial = 0; trial < 30; ++trial) {
    ProfileGraph g = (trial % 3 == 0) ? randomChain(rng, 3 + static_cast<int>(rng() % 4))
                                      : randomDag(rng, 3 + static_cast<int>(rng() % 4));
    PlanningStates s;
    ASSERT_TRUE(enumerateAntichainStates(g, 1000, &s));
    const std::vector<int>& shape = shapes[trial % shapes.size()];
    for (CostModel model : {CostModel::PipeDream, CostModel::Default}) {
      for (int variant = 0; variant < 5; ++variant) {
        PlannerOptions o;
        o.costModel = model;
        o.straight = variant == 1;
        o.fewerWorkers = variant == 2 || variant == 4;
        o.compression = variant == 3 ? 1.5 : 0.0;
        Topology t;
        const double bws[3] = {16e9, 1.25e9, 0.5e9};
        for (size_t l = 0; l < shape.size(); ++l) t.levels.push_back({shape[l], bws[l]});
        double total = s.parameterBytes.back() + s.activationBytes.back();
        t.memoryBytes = variant == 4 ? total * (0.5 + (rng() % 100) / 100.0) : 0.0;
        const double expected = pipedreamReference(s, t, o);
        std::string ctx = "trial " + std::to_string(trial) + " model " + costModelName(model) +
                          " variant " + std::to_string(variant);
        if (expected == kInf) {
          ++infeasible;
          EXPECT_THROW(planOnStates(g, s, t, o), std::invalid_argument) << ctx;
          continue;
        }
        ++compared;
        Plan p = planOnStates(g, s, t, o);
        EXPECT_NEAR(p.timePerStage, expected, 1e-12 * std::max(1.0, std::fabs(expected))) << ctx;
      }
    }
  }
  EXPECT_GT(compared, 200);
  EXPECT_GT(infeasible, 0);
}

// Input -> a -> b with heavy weights on a slow link: splitting wins.
ProfileGraph twoHeavyLayers() {
  ProfileGraph g;
  g.addNode(makeNode("node1", "Input", 0, 0, 1e6, 0));
  g.addNode(makeNode("node2", "a", 10, 20, 1e6, 1e9));
  g.addNode(makeNode("node3", "b", 10, 20, 1e6, 1e9));
  g.addEdge(0, 1);
  g.addEdge(1, 2);
  return g;
}

TEST(PlannerGolden, TwoHeavyLayersSplitOnTwoWorkers) {
  Topology t;
  t.levels = std::vector<TopologyLevel>{{2, 1e9}};
  PlannerOptions o;
  o.costModel = CostModel::PipeDream;
  Plan p = planPartition(twoHeavyLayers(), t, o);
  ASSERT_EQ(p.stages.size(), 2u);
  EXPECT_EQ(p.stages[0].nodes, (std::vector<int>{0, 1}));
  EXPECT_EQ(p.stages[1].nodes, (std::vector<int>{2}));
  EXPECT_EQ(p.stages[0].ranks, (std::vector<int>{0}));
  EXPECT_EQ(p.stages[1].ranks, (std::vector<int>{1}));
  EXPECT_DOUBLE_EQ(p.timePerStage, 0.03);
  // Data parallel: (0.06 + 4 * 1 * 2e9 / (2 * 1e9)) / 2 = 2.03.
  EXPECT_NEAR(p.dataParallelTime, 2.03, 1e-12);
  EXPECT_NEAR(p.speedupOverDp, 2.03 / 0.03, 1e-9);
  EXPECT_TRUE(p.chain);
  EXPECT_EQ(p.stages[0].layerStart, 0);
  EXPECT_EQ(p.stages[0].layerEnd, 1);
  EXPECT_EQ(p.stages[1].layerStart, 1);
  EXPECT_EQ(p.stages[1].layerEnd, 2);
  // Memory per worker: stage 0 keeps 2 in-flight versions of 1e9 + 2 x 1e6.
  EXPECT_DOUBLE_EQ(p.stages[0].memoryBytes, 2 * 1e9 + 2 * 1e6);
  EXPECT_DOUBLE_EQ(p.stages[1].memoryBytes, 1e9 + 1e6);
}

TEST(PlannerGolden, WeightlessLayerIsReplicated) {
  // a: 90 ms, no weights; b: 30 ms, 1 GB of weights. Best on 4 workers:
  // a over 3 replicas (0.03 s each), b alone (0.03 s).
  ProfileGraph g;
  g.addNode(makeNode("node1", "Input", 0, 0, 1e3, 0));
  g.addNode(makeNode("node2", "a", 30, 60, 1e3, 0));
  g.addNode(makeNode("node3", "b", 10, 20, 1e3, 1e9));
  g.addEdge(0, 1);
  g.addEdge(1, 2);
  Topology t;
  t.levels = std::vector<TopologyLevel>{{4, 1e9}};
  for (CostModel model : {CostModel::PipeDream, CostModel::Default}) {
    PlannerOptions o;
    o.costModel = model;
    Plan p = planPartition(g, t, o);
    ASSERT_EQ(p.stages.size(), 2u) << costModelName(model);
    EXPECT_EQ(p.stages[0].replicas, 3);
    EXPECT_EQ(p.stages[0].ranks, (std::vector<int>{0, 1, 2}));
    EXPECT_EQ(p.stages[1].ranks, (std::vector<int>{3}));
    EXPECT_NEAR(p.timePerStage, 0.03, 1e-9) << costModelName(model);
  }
  // Straight pipelines cannot replicate: 2 stages on 2 workers (3 and 4
  // workers would need more stages than layers).
  PlannerOptions straight;
  straight.straight = true;
  t.levels = std::vector<TopologyLevel>{{2, 1e9}};
  Plan p = planPartition(g, t, straight);
  ASSERT_EQ(p.stages.size(), 2u);
  EXPECT_NEAR(p.timePerStage, 0.09, 1e-12);
}

TEST(PlannerGolden, FewerWorkersLeavesWorkersIdle) {
  Topology t;
  t.levels = std::vector<TopologyLevel>{{5, 1e9}};
  PlannerOptions o;
  o.costModel = CostModel::PipeDream;
  o.straight = true;
  // Two layers cannot fill 5 straight stages.
  EXPECT_THROW(planPartition(twoHeavyLayers(), t, o), std::invalid_argument);
  o.fewerWorkers = true;
  Plan p = planPartition(twoHeavyLayers(), t, o);
  EXPECT_EQ(p.usedWorkers, 2);
  EXPECT_EQ(p.numWorkers, 5);
  EXPECT_DOUBLE_EQ(p.timePerStage, 0.03);
}

TEST(PlannerGolden, MemoryLimitForcesASplit) {
  ProfileGraph g;
  g.addNode(makeNode("node1", "Input", 0, 0, 0, 0));
  g.addNode(makeNode("node2", "a", 1, 1, 0, 1e9));
  g.addNode(makeNode("node3", "b", 3, 3, 0, 6e9));
  g.addEdge(0, 1);
  g.addEdge(1, 2);
  Topology t;
  t.levels = std::vector<TopologyLevel>{{2, 1e15}};
  // Default model, unlimited: data parallel (0.004 s) beats a|b (0.006 s).
  PlannerOptions o;
  Plan free = planPartition(g, t, o);
  EXPECT_EQ(free.stages.size(), 1u);
  EXPECT_NEAR(free.timePerStage, 0.004, 1e-9);
  // Both replicas would hold 7 GB; a|b holds 2 x 1 GB and 1 x 6 GB.
  t.memoryBytes = 6.5e9;
  Plan limited = planPartition(g, t, o);
  ASSERT_EQ(limited.stages.size(), 2u);
  EXPECT_NEAR(limited.timePerStage, 0.006, 1e-12);
  EXPECT_DOUBLE_EQ(limited.stages[0].memoryBytes, 2e9);
  EXPECT_DOUBLE_EQ(limited.stages[1].memoryBytes, 6e9);
  t.memoryBytes = 1e9;
  EXPECT_THROW(planPartition(g, t, o), std::invalid_argument);
}

ProfileGraph fourHeavyLayers() {
  ProfileGraph g;
  g.addNode(makeNode("node1", "Input", 0, 0, 1e6, 0));
  for (int i = 0; i < 4; ++i) {
    g.addNode(makeNode("node" + std::to_string(i + 2), "layer", 10, 20, 1e6, 1e9));
    g.addEdge(i, i + 1);
  }
  return g;
}

TEST(PlannerDataParallel, TimesAndMemoryPerRank) {
  Topology t;
  t.levels = std::vector<TopologyLevel>{{2, 1e12}};
  PlannerOptions o;
  o.dataParallel.degree = 2;
  o.dataParallel.sharding = Sharding::Fsdp;
  o.dataParallel.bandwidth = 1e10;
  Plan p = planPartition(fourHeavyLayers(), t, o);
  ASSERT_EQ(p.stages.size(), 2u);
  // (0.06 s + 2 * 1/2 * 2e9 B / 1e10 B/s) / 2 = 0.13 s per minibatch.
  EXPECT_NEAR(p.timePerStage, 0.13, 1e-12);
  for (size_t j = 0; j < 2; ++j) {
    const PlanStage& st = p.stages[j];
    EXPECT_EQ(st.replicas, 1);
    EXPECT_NEAR(st.time, 0.13, 1e-12);
    EXPECT_DOUBLE_EQ(st.modelStateBytes, 4 * 2e9 / 2);  // weights, gradients, 2 AdamW moments
    EXPECT_DOUBLE_EQ(st.stashedActivationBytes, (2 - j) * 2e6);
    EXPECT_DOUBLE_EQ(st.memoryBytes, st.modelStateBytes + st.stashedActivationBytes);
  }
  // 5e9 bytes per rank: FSDP fits (4.004e9 on stage 0), replicating does not.
  t.memoryBytes = 5e9;
  EXPECT_NEAR(planPartition(fourHeavyLayers(), t, o).timePerStage, 0.13, 1e-12);
  o.dataParallel.sharding = Sharding::Replicate;
  try {
    planPartition(fourHeavyLayers(), t, o);
    ADD_FAILURE() << "replicated stages should not fit 5e9 bytes per rank";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("use sharding 'fsdp'"), std::string::npos) << e.what();
  }
}

TEST(PlannerDataParallel, DegreeOneEqualsTheStraightPlan) {
  for (const char* name : {"resnet18.txt", "gnmt.txt"}) {
    ProfileGraph g = ProfileGraph::load(dataPath(name));
    Topology t;
    t.levels = std::vector<TopologyLevel>{{4, 16e9}, {2, 1.25e9}};
    PlannerOptions straight;
    straight.straight = true;
    PlannerOptions dp;
    dp.dataParallel.degree = 1;
    Plan a = planPartition(g, t, straight), b = planPartition(g, t, dp);
    expectSameCuts(a, b, name);
  }
}

TEST(PlannerHierarchy, DegenerateLevelsMatchFlatPlans) {
  ProfileGraph g = ProfileGraph::load(dataPath("resnet18.txt"));
  for (CostModel model : {CostModel::PipeDream, CostModel::Default}) {
    PlannerOptions o;
    o.costModel = model;
    Topology flat, outer, inner;
    flat.levels = std::vector<TopologyLevel>{{8, 1.25e9}};
    outer.levels = std::vector<TopologyLevel>{{1, 16e9}, {8, 1.25e9}};  // 8 servers of one worker
    inner.levels = std::vector<TopologyLevel>{{8, 1.25e9}, {1, 16e9}};  // one server of 8 workers
    double f = planPartition(g, flat, o).timePerStage;
    EXPECT_NEAR(planPartition(g, outer, o).timePerStage, f, 1e-12) << costModelName(model);
    EXPECT_NEAR(planPartition(g, inner, o).timePerStage, f, 1e-12) << costModelName(model);
  }
}

TEST(PlannerHierarchy, RanksPartitionTheClusterAndStayInsideServers) {
  ProfileGraph g = ProfileGraph::load(dataPath("gnmt.txt"));
  Topology t;
  t.levels = std::vector<TopologyLevel>{{4, 16e9}, {4, 1.25e9}};
  for (CostModel model : {CostModel::PipeDream, CostModel::Default}) {
    PlannerOptions o;
    o.costModel = model;
    Plan p = planPartition(g, t, o);
    std::set<int> seen;
    for (const PlanStage& st : p.stages) {
      EXPECT_EQ(static_cast<int>(st.ranks.size()), st.replicas);
      for (int r : st.ranks) EXPECT_TRUE(seen.insert(r).second) << "rank " << r << " reused";
      // Replicas come in equal groups per server (in-server replicas times
      // servers), consecutive inside each server.
      std::map<int, std::vector<int>> perServer;
      for (int r : st.ranks) perServer[r / 4].push_back(r);
      for (const auto& kv : perServer) {
        EXPECT_EQ(kv.second.size(), perServer.begin()->second.size());
        EXPECT_EQ(kv.second.back() - kv.second.front() + 1, static_cast<int>(kv.second.size()));
      }
    }
    EXPECT_EQ(static_cast<int>(seen.size()), 16);
    EXPECT_GT(p.speedupOverDp, 0.0);
    // Every node is in exactly one stage.
    size_t nodes = 0;
    for (const PlanStage& st : p.stages) nodes += st.nodes.size();
    EXPECT_EQ(nodes, static_cast<size_t>(g.numNodes()));
  }
}

TEST(PlannerPaths, FallbackAnswersAndAgreesOnChains) {
  // On a chain antichain states and topological cuts are the same prefixes.
  std::mt19937 rng(7);
  ProfileGraph chain = randomChain(rng, 12);
  Topology t;
  t.levels = std::vector<TopologyLevel>{{4, 16e9}, {2, 1.25e9}};
  PlannerOptions o;
  o.costModel = CostModel::PipeDream;
  Plan a = planPartition(chain, t, o);
  EXPECT_EQ(a.stateKind, StateKind::Antichain);
  PlannerOptions cuts = o;
  cuts.maxAntichainStates = 2;  // force the fallback
  Plan b = planPartition(chain, t, cuts);
  EXPECT_EQ(b.stateKind, StateKind::TopologicalCut);
  EXPECT_FALSE(b.coarsened);
  EXPECT_DOUBLE_EQ(a.timePerStage, b.timePerStage);
  // A tiny work budget coarsens the cuts but still answers.
  PlannerOptions tiny = cuts;
  tiny.workBudget = 1e3;
  Plan c = planPartition(chain, t, tiny);
  EXPECT_TRUE(c.coarsened);
  EXPECT_LT(c.numStates, 13);
  EXPECT_GE(c.timePerStage, a.timePerStage);
}

TEST(PlannerPaths, AntichainOptimumIsNoWorseThanCutsOnBranchingGraphs) {
  ProfileGraph g = ProfileGraph::load(dataPath("resnet18.txt"));
  Topology t;
  t.levels = std::vector<TopologyLevel>{{16, 1.25e9}};
  for (CostModel model : {CostModel::PipeDream, CostModel::Default}) {
    PlannerOptions o;
    o.costModel = model;
    PlanningStates s;
    ASSERT_TRUE(enumerateAntichainStates(g, 4096, &s));
    Plan a = planOnStates(g, s, t, o);
    Plan b = planOnStates(g, topologicalCutStates(g), t, o);
    if (model == CostModel::PipeDream) {
      // Cuts of one order are a subset of the ideals.
      EXPECT_LE(a.timePerStage, b.timePerStage * (1 + 1e-12));
    }
    EXPECT_GT(b.timePerStage, 0.0);
  }
}

TEST(PlannerOptionsCheck, RejectsBadInput) {
  Topology t;
  EXPECT_THROW(planPartition(twoHeavyLayers(), t, {}), std::invalid_argument);
  t.levels = std::vector<TopologyLevel>{{0, 1e9}};
  EXPECT_THROW(planPartition(twoHeavyLayers(), t, {}), std::invalid_argument);
  t.levels = std::vector<TopologyLevel>{{2, -1}};
  EXPECT_THROW(planPartition(twoHeavyLayers(), t, {}), std::invalid_argument);
  EXPECT_THROW(parseCostModel("fast"), std::invalid_argument);
  EXPECT_EQ(parseCostModel("pipedream"), CostModel::PipeDream);
  EXPECT_THROW(parseSharding("zero"), std::invalid_argument);
  EXPECT_EQ(parseSharding("fsdp"), Sharding::Fsdp);
  t.levels = std::vector<TopologyLevel>{{2, 1e9}};
  auto dpOptions = [](int degree, double bandwidth) {
    PlannerOptions o;
    o.dataParallel.degree = degree;
    o.dataParallel.bandwidth = bandwidth;
    return o;
  };
  EXPECT_THROW(planPartition(twoHeavyLayers(), t, dpOptions(-1, 1e9)), std::invalid_argument);
  EXPECT_THROW(planPartition(twoHeavyLayers(), t, dpOptions(2, 0.0)), std::invalid_argument);
  EXPECT_NO_THROW(planPartition(twoHeavyLayers(), t, dpOptions(1, 0.0)));
  PlannerOptions o = dpOptions(2, 1e9);
  o.costModel = CostModel::PipeDream;
  EXPECT_THROW(planPartition(twoHeavyLayers(), t, o), std::invalid_argument);
  o = dpOptions(2, 1e9);
  o.twoBw = true;
  EXPECT_THROW(planPartition(twoHeavyLayers(), t, o), std::invalid_argument);
  o = dpOptions(2, 1e9);
  o.dataParallel.optimizerState = -1;
  EXPECT_THROW(planPartition(twoHeavyLayers(), t, o), std::invalid_argument);
}

// Input then `layers` equal layers (1 ms forward, 2 ms backward, 1 MB out, 1 MB of weights).
ProfileGraph uniformChain(int layers) {
  ProfileGraph g;
  g.addNode(makeNode("node0", "Input", 0, 0, 1e6, 0));
  for (int i = 1; i <= layers; ++i) {
    g.addNode(makeNode("node" + std::to_string(i), "Layer", 1, 2, 1e6, 1e6));
    g.addEdge(i - 1, i);
  }
  return g;
}

TEST(PlannerStraight, CoarseningKeepsAStatePerWorker) {
  // 200 layers on 32 straight workers: the budget alone would keep about
  // sqrt(2 budget / 31) = 25 cuts, fewer than the 32 stages a straight plan has.
  Topology t;
  t.levels = std::vector<TopologyLevel>{{32, 1e9}};
  PlannerOptions o;
  o.straight = true;
  o.workBudget = 1e4;
  const Plan p = planPartition(uniformChain(200), t, o);
  EXPECT_TRUE(p.coarsened);
  EXPECT_EQ(p.stateKind, StateKind::TopologicalCut);
  EXPECT_GE(p.numStates, 32);
  EXPECT_LT(p.numStates, 200);
  ASSERT_EQ(p.stages.size(), 32u);
  EXPECT_EQ(p.usedWorkers, 32);
  int next = 0;
  for (const PlanStage& st : p.stages) {
    EXPECT_EQ(st.replicas, 1);
    EXPECT_EQ(st.layerStart, next);
    EXPECT_GT(st.layerEnd, st.layerStart);
    next = st.layerEnd;
  }
  EXPECT_EQ(next, 200);
  // Equal layers: the slowest stage holds ceil(200 / 32) = 7 layers at most
  // (the coarse cuts may not allow 7 everywhere; never fewer than 200 / 32).
  EXPECT_GE(p.timePerStage, 0.003 * 200 / 32 - 1e-12);
  // Replicas allowed: the budget applies as before.
  o.straight = false;
  EXPECT_NO_THROW(planPartition(uniformChain(200), t, o));
}

TEST(PlannerStraight, FewerLayersThanWorkersIsNamed) {
  // 100 layers cannot fill 128 straight stages: no memory limit is involved.
  Topology t;
  t.levels = std::vector<TopologyLevel>{{128, 1e9}};
  PlannerOptions o;
  o.straight = true;
  const std::string error = errorOf([&] { planPartition(uniformChain(100), t, o); });
  EXPECT_NE(error.find("a straight plan on 128 workers needs 128 stages (one per worker, each at "
                       "least one layer), but the profile splits into at most 100 (100 planning "
                       "states, 100 layers); plan on at most 100 workers, pass fewer_workers=True, "
                       "or allow replicated stages (straight=False)"),
            std::string::npos)
      << error;
  EXPECT_EQ(error.find("memory limit"), std::string::npos) << error;
  // Each fix it names plans.
  o.fewerWorkers = true;
  EXPECT_EQ(planPartition(uniformChain(100), t, o).stages.size(), 100u);
  o.fewerWorkers = false;
  t.levels[0].workers = 100;
  EXPECT_EQ(planPartition(uniformChain(100), t, o).stages.size(), 100u);
  t.levels[0].workers = 128;
  o.straight = false;
  EXPECT_NO_THROW(planPartition(uniformChain(100), t, o));
  // Data parallelism inside stages is straight too; it cannot drop straight.
  PlannerOptions dp;
  dp.dataParallel.degree = 2;
  dp.dataParallel.bandwidth = 1e9;
  const std::string dpError = errorOf([&] { planPartition(uniformChain(100), t, dp); });
  EXPECT_NE(dpError.find("a straight plan on 128 pipeline workers needs 128 stages"), std::string::npos)
      << dpError;
  EXPECT_EQ(dpError.find("straight=False"), std::string::npos) << dpError;
  // Two levels: 4 x 32 = 128 workers.
  t.levels = std::vector<TopologyLevel>{{4, 16e9}, {32, 1e9}};
  o.straight = true;
  EXPECT_NE(errorOf([&] { planPartition(uniformChain(100), t, o); }).find("needs 128 stages"),
            std::string::npos);
}

// Input then 4 layers of 1 s (250 ms forward, 750 ms backward), 2^20 output
// bytes and 2^30 weight bytes: every number below is exact in binary.
ProfileGraph fourExactLayers() {
  ProfileGraph g;
  g.addNode(makeNode("node1", "Input", 0, 0, 1 << 20, 0));
  for (int i = 0; i < 4; ++i) {
    g.addNode(makeNode("node" + std::to_string(i + 2), "block", 250, 750, 1 << 20, 1 << 30));
    g.addEdge(i, i + 1);
  }
  return g;
}

PlannerOptions tensorParallelOptions(int degree, bool sp) {
  PlannerOptions o;
  o.dataParallel.degree = 1;
  o.tensorParallel.degree = degree;
  o.tensorParallel.sequenceParallel = sp;
  o.tensorParallel.bandwidth = 1 << 30;
  return o;
}

TEST(PlannerTensorParallel, TimePerStageIsComputeOverTpPlusAllReduces) {
  Topology t;
  t.levels = std::vector<TopologyLevel>{{2, 1 << 30}};
  for (bool sp : {false, true}) {
    Plan p = planPartition(fourExactLayers(), t, tensorParallelOptions(2, sp));
    ASSERT_EQ(p.stages.size(), 2u);
    // Per stage: 2 s of compute / 2 tp ranks + 2 layers x 4 all-reduces x
    // 2 (2-1)/2 x 2^20 B / 2^30 B/s = 1 + 2^-7 s (with SP: all-gathers plus
    // reduce-scatters of the same bytes). The boundary (2 x 2^20 B, or 2^20
    // per tp rank with SP, over 2^30 B/s) is shorter.
    const double expected = 2.0 / 2 + 2 * 4 * (2.0 * (2 - 1) / 2) * (1 << 20) / (1 << 30);
    EXPECT_EQ(expected, 1.0078125);
    EXPECT_EQ(p.timePerStage, expected) << sp;
    for (size_t j = 0; j < 2; ++j) {
      const PlanStage& st = p.stages[j];
      EXPECT_EQ(st.time, expected) << sp;
      EXPECT_EQ(st.tensorParallelSeconds, 1.0 / 128) << sp;
      EXPECT_EQ(st.computeSeconds, 2.0) << sp;           // the profile's, one device
      EXPECT_EQ(st.parameterBytes, 2.0 * (1 << 30)) << sp;  // the stage's, unsharded
      // Replicated dp (degree 1): weights, gradients and 2 AdamW moments, 1/2 each.
      EXPECT_EQ(st.modelStateBytes, 4.0 * 2 * (1 << 30) / 2) << sp;
      const double inflight = 2 - j, perRank = sp ? (1 << 20) : 2 << 20;
      EXPECT_EQ(st.stashedActivationBytes, inflight * perRank) << sp;
      EXPECT_EQ(st.memoryBytes, st.modelStateBytes + st.stashedActivationBytes) << sp;
    }
    // Plain data parallelism on all 4 GPUs (tp level innermost): level 1
    // max(4, 2 x 1/2 x 2^32 / 2^30) / 2 = 2, level 2 max(2, 2^33 / 2^32) / 2 = 1.
    EXPECT_EQ(p.dataParallelTime, 1.0);
    EXPECT_EQ(p.singleWorkerTime, 4.0);
  }
  // Degree 4: 2 s / 4 + 2 layers x 4 all-reduces x 2 (4-1)/4 x 2^20 B / 2^30 B/s.
  Plan four = planPartition(fourExactLayers(), t, tensorParallelOptions(4, false));
  EXPECT_EQ(four.timePerStage, 0.5 + 2 * 4 * 1.5 / 1024);
  EXPECT_EQ(four.stages[0].modelStateBytes, 4.0 * 2 * (1 << 30) / 4);
}

TEST(PlannerTensorParallel, SequenceParallelShardsTheBoundarySends) {
  // Stages 2^20 B/s apart: a cut's 2^20 B, sent forward and its gradient back,
  // take 2 s per minibatch on each tp rank's own link; with SP each sends its
  // half: 1 s, under the stage's 1 + 2^-7 s.
  Topology t;
  t.levels = std::vector<TopologyLevel>{{2, 1 << 20}};
  Plan full = planPartition(fourExactLayers(), t, tensorParallelOptions(2, false));
  EXPECT_EQ(full.timePerStage, 2.0);
  EXPECT_EQ(full.stages[1].time, 2.0);
  Plan sharded = planPartition(fourExactLayers(), t, tensorParallelOptions(2, true));
  EXPECT_EQ(sharded.timePerStage, 1.0078125);
}

TEST(PlannerTensorParallel, TpFitsAModelThatDidNotFitAndSpFitsTighter) {
  Topology t;
  t.levels = std::vector<TopologyLevel>{{2, 1 << 30}};
  // Any split has a stage of 2+ layers: 4 x 2^31 B of model state on one rank,
  // 2^32 at tp 2. Stage 0 stashes 2 minibatches of 2^21 B (2^20 per rank with SP).
  t.memoryBytes = 4294967296.0 + (1 << 23);
  auto plan = [&](int degree, bool sp) {
    return planPartition(fourExactLayers(), t, tensorParallelOptions(degree, sp));
  };
  const std::string noFit = errorOf([&] { plan(1, false); });
  EXPECT_NE(noFit.find("no partition fits the memory limit"), std::string::npos) << noFit;
  Plan tp = plan(2, false);
  EXPECT_EQ(tp.stages[0].memoryBytes, 4294967296.0 + (1 << 22));
  t.memoryBytes = 4294967296.0 + (1 << 21) + (1 << 20);
  const std::string needsSp = errorOf([&] { plan(2, false); });
  EXPECT_NE(needsSp.find("x 1 data-parallel ranks x 2 tensor-parallel ranks, sharding 'replicate'"),
            std::string::npos) << needsSp;
  EXPECT_NE(needsSp.find("or use sequence parallelism (divides stashed activations by 2)"),
            std::string::npos) << needsSp;
  Plan sp = plan(2, true);
  EXPECT_EQ(sp.stages[0].memoryBytes, 4294967296.0 + (1 << 21));
  EXPECT_EQ(sp.timePerStage, 1.0078125);
}

// Degree 1 is no tensor parallelism, whatever the other tp options say: the
// plans are bitwise those without them.
TEST(PlannerTensorParallel, DegreeOneIsBitwiseThePlanWithout) {
  for (const char* name : {"resnet18.txt", "gnmt.txt", "vgg16.txt"}) {
    ProfileGraph g = ProfileGraph::load(dataPath(name));
    Topology t;
    t.levels = std::vector<TopologyLevel>{{4, 16e9}, {2, 1.25e9}};
    t.memoryBytes = 64e9;
    PlannerOptions base;
    base.dataParallel.degree = 2;
    base.dataParallel.bandwidth = 16e9;
    base.dataParallel.sharding = Sharding::Fsdp;
    PlannerOptions one = base;
    one.tensorParallel.sequenceParallel = true;
    one.tensorParallel.bandwidth = 1e6;
    one.tensorParallel.allReducesPerLayer = 7;
    Plan a = planPartition(g, t, base), b = planPartition(g, t, one);
    expectSameCuts(a, b, name);
    for (size_t j = 0; j < a.stages.size() && j < b.stages.size(); ++j) {
      EXPECT_EQ(a.stages[j].memoryBytes, b.stages[j].memoryBytes) << name;
      EXPECT_EQ(a.stages[j].modelStateBytes, b.stages[j].modelStateBytes) << name;
      EXPECT_EQ(b.stages[j].tensorParallelSeconds, 0.0) << name;
    }
  }
}

TEST(PlannerTensorParallel, RejectsBadInput) {
  Topology t;
  t.levels = std::vector<TopologyLevel>{{2, 1 << 30}};
  auto message = [&](const PlannerOptions& o) {
    return errorOf([&] { planPartition(fourExactLayers(), t, o); });
  };
  PlannerOptions o = tensorParallelOptions(0, false);
  EXPECT_NE(message(o).find("tensor-parallel degree 0 is invalid"), std::string::npos);
  o = tensorParallelOptions(2, false);
  o.dataParallel.degree = 0;
  EXPECT_NE(message(o).find("turn data parallelism on too"), std::string::npos);
  o = tensorParallelOptions(2, false);
  o.tensorParallel.bandwidth = 0;
  EXPECT_NE(message(o).find("tensor-parallel bandwidth 0.000000 bytes/s is invalid"),
            std::string::npos);
  o = tensorParallelOptions(2, false);
  o.tensorParallel.allReducesPerLayer = -1;
  EXPECT_NE(message(o).find("all-reduces per layer -1.000000 is invalid"), std::string::npos);
  o = tensorParallelOptions(2, false);
  o.costModel = CostModel::PipeDream;
  EXPECT_NE(message(o).find("default cost model"), std::string::npos);
}

}  // namespace
}  // namespace pipedream
