// graph.txt parsing/writing and planning-state enumeration.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>

#include "profile_graph.h"

namespace pipedream {
namespace {

std::string dataPath(const std::string& name) {
  return std::string(PIPEDREAM_SOURCE_DIR) + "/tests/data/profiles/" + name;
}

std::string readFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string line(const std::string& id, const std::string& desc, double f, double b, double a,
                 double p) {
  std::ostringstream os;
  os << id << " -- " << desc << " -- forward_compute_time=" << f << ", backward_compute_time=" << b
     << ", activation_size=" << a << ", parameter_size=" << p << "\n";
  return os.str();
}

// Input -> a -> {b, c} -> d (a diamond after the input).
ProfileGraph diamond() {
  std::string text = line("node1", "Input", 0, 0, 10, 0) + line("node2", "a", 1, 2, 100, 5) +
                     line("node3", "b", 1, 1, 20, 1) + line("node4", "c", 3, 3, 30, 2) +
                     line("node5", "d", 1, 1, 40, 3) +
                     "\tnode1 -- node2\n\tnode2 -- node3\n\tnode2 -- node4\n\tnode3 -- node5\n"
                     "\tnode4 -- node5";
  return ProfileGraph::parse(text, "diamond.txt");
}

TEST(GraphIO, RoundTripsShippedProfilesByteForByte) {
  for (const char* name : {"alexnet.txt", "resnet18.txt", "gnmt.txt"}) {
    std::string text = readFile(dataPath(name));
    ASSERT_FALSE(text.empty()) << name;
    ProfileGraph g = ProfileGraph::parse(text, name);
    EXPECT_EQ(g.toString(), text) << name;
  }
}

TEST(GraphIO, ParsesFieldsAndSumsActivationLists) {
  ProfileGraph g = ProfileGraph::load(dataPath("gnmt.txt"));
  EXPECT_EQ(g.numNodes(), 48);
  int lstm = g.indexOf("node7");
  ASSERT_GE(lstm, 0);
  EXPECT_EQ(g.node(lstm).description, "LSTM(2048, 1024)");
  EXPECT_DOUBLE_EQ(g.node(lstm).forwardMs, 3.190);
  EXPECT_DOUBLE_EQ(g.node(lstm).backwardMs, 5.348);
  EXPECT_DOUBLE_EQ(g.node(lstm).activationBytes, 6291456.0 + 131072.0 + 131072.0);
  EXPECT_DOUBLE_EQ(g.node(lstm).parameterBytes, 50364416.0);
  EXPECT_TRUE(g.node(g.indexOf("node1")).isInput());
}

TEST(GraphIO, WritesNewGraphsInPipeDreamFormat) {
  ProfileGraph g;
  GraphNode in{"node1", "Input", 0, 0, 12, "", 0};
  GraphNode lin{"node2", "Linear(in_features=4, out_features=2)", 1.5, 2.25, 32, "", 40};
  g.addNode(in);
  g.addNode(lin);
  g.addEdge("node1", "node2");
  EXPECT_EQ(g.toString(),
            "node1 -- Input -- forward_compute_time=0.000, backward_compute_time=0.000, "
            "activation_size=12.000, parameter_size=0.000\n"
            "node2 -- Linear(in_features=4, out_features=2) -- forward_compute_time=1.500, "
            "backward_compute_time=2.250, activation_size=32.000, parameter_size=40.000\n"
            "\tnode1 -- node2");
  ProfileGraph back = ProfileGraph::parse(g.toString());
  EXPECT_EQ(back.numNodes(), 2);
  EXPECT_EQ(back.toString(), g.toString());
  std::vector<int> order;
  EXPECT_TRUE(back.isChain(&order));
  EXPECT_EQ(order, (std::vector<int>{0, 1}));
  EXPECT_THROW(g.addEdge("node1", "node9"), std::invalid_argument);
  EXPECT_THROW(g.addNode(in), std::invalid_argument);
}

// Found by the profile_graph fuzz target: "%.3f" of a value >= 1e60 was cut
// to 63 characters, so toString() wrote a different (and smaller) number.
TEST(GraphIO, WritesHugeValuesInFull) {
  ProfileGraph g;
  g.addNode(GraphNode{"node1", "Linear", 1e300, 1e65, 0, "", 123456789e60});
  const std::string text = g.toString();
  ProfileGraph back = ProfileGraph::parse(text);
  EXPECT_EQ(back.node(0).forwardMs, 1e300);
  EXPECT_EQ(back.node(0).backwardMs, 1e65);
  EXPECT_EQ(back.node(0).parameterBytes, 123456789e60);
  EXPECT_EQ(back.toString(), text);
}

void expectParseError(const std::string& text, const std::vector<std::string>& parts) {
  try {
    ProfileGraph::parse(text, "bad.txt");
    FAIL() << "no error for:\n" << text;
  } catch (const std::invalid_argument& e) {
    for (const std::string& p : parts) {
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos)
          << "'" << p << "' missing from: " << e.what();
    }
  }
}

TEST(GraphIO, ParseErrorsNameFileLineAndField) {
  std::string ok = line("node1", "Input", 0, 0, 1, 0);
  expectParseError(ok + "node2 -- L -- forward_compute_time=abc, backward_compute_time=1, "
                        "activation_size=1, parameter_size=1",
                   {"bad.txt:2", "forward_compute_time", "abc"});
  expectParseError(ok + "node2 -- L -- forward_compute_time=1, backward_compute_time=1, "
                        "activation_size=[1; x], parameter_size=1",
                   {"bad.txt:2", "activation_size"});
  expectParseError(ok + "node2 -- L -- forward_compute_time=1, backward_compute_time=1, "
                        "parameter_size=1",
                   {"bad.txt:2", "4 comma-separated"});
  expectParseError(ok + "node2 -- L -- forward_compute_time=1, backward_compute_time=-1, "
                        "activation_size=1, parameter_size=1",
                   {"bad.txt:2", "backward_compute_time", "negative"});
  expectParseError(ok + "node2 L forward", {"bad.txt:2", "expected"});
  expectParseError(ok + "\tnode1 -- node7", {"bad.txt:2", "node7"});
  expectParseError(ok + ok, {"bad.txt:2", "duplicate"});
  expectParseError(ok + line("node2", "a", 1, 1, 1, 1) + "\tnode1 -- node2\n\tnode2 -- node1",
                   {"bad.txt", "cycle"});
  expectParseError("", {"bad.txt", "no nodes"});
  EXPECT_THROW(ProfileGraph::load("/nonexistent/graph.txt"), std::invalid_argument);
}

TEST(GraphStates, AntichainStatesOfADiamond) {
  ProfileGraph g = diamond();
  PlanningStates s;
  ASSERT_TRUE(enumerateAntichainStates(g, 100, &s));
  EXPECT_EQ(s.kind, StateKind::Antichain);
  // Input removed; ideals containing a: {a}, {a,b}, {a,c}, {a,b,c}, {a,b,c,d}.
  ASSERT_EQ(s.size(), 5);
  EXPECT_EQ(s.planNodes.size(), 4u);
  EXPECT_DOUBLE_EQ(s.computeSeconds[0], 0.003);
  EXPECT_NEAR(s.computeSeconds[4], 0.013, 1e-15);
  EXPECT_DOUBLE_EQ(s.parameterBytes[4], 11.0);
  // {a,b}: antichain {b}; PipeDream augments it with a (a also feeds c), so
  // its boundary is a + b; live outputs are a and b as well.
  int ab = -1;
  for (int j = 0; j < s.size(); ++j) {
    if (s.parameterBytes[j] == 6.0) ab = j;
  }
  ASSERT_GE(ab, 0);
  EXPECT_DOUBLE_EQ(s.antichainBytes[ab], 120.0);
  EXPECT_DOUBLE_EQ(s.liveBytes[ab], 120.0);
  // {a,b} and {a,c} are incomparable: neither is a predecessor of the other.
  for (int j = 0; j < s.size(); ++j) {
    for (int k : s.preds[j]) {
      for (int q = 0; q < static_cast<int>(s.planNodes.size()); ++q) {
        if (s.contains(k, q)) {
          EXPECT_TRUE(s.contains(j, q));
        }
      }
    }
  }
  EXPECT_EQ(s.preds[4].size(), 4u);
  EXPECT_FALSE(enumerateAntichainStates(g, 3, &s));
}

TEST(GraphStates, TopologicalCutsCarryLiveActivations) {
  ProfileGraph g = diamond();
  PlanningStates s = topologicalCutStates(g);
  EXPECT_EQ(s.kind, StateKind::TopologicalCut);
  ASSERT_EQ(s.size(), 4);  // a | b | c | d in file order
  EXPECT_DOUBLE_EQ(s.liveBytes[0], 100.0);  // a
  EXPECT_DOUBLE_EQ(s.liveBytes[1], 120.0);  // a still feeds c, plus b
  EXPECT_DOUBLE_EQ(s.liveBytes[2], 50.0);   // b and c feed d
  EXPECT_DOUBLE_EQ(s.liveBytes[3], 0.0);
  for (int j = 0; j < s.size(); ++j) EXPECT_EQ(static_cast<int>(s.preds[j].size()), j);
}

TEST(GraphStates, MultiSourceGraphsEndWithTheFullSet) {
  ProfileGraph g = ProfileGraph::load(dataPath("gnmt.txt"));
  PlanningStates s;
  ASSERT_TRUE(enumerateAntichainStates(g, 4096, &s));
  EXPECT_EQ(s.size(), 99);
  double total = 0;
  for (int q : s.planNodes) total += g.node(q).forwardMs + g.node(q).backwardMs;
  EXPECT_NEAR(s.computeSeconds.back(), total / 1000.0, 1e-12);
  // Inputs and dangling __getitem__ sinks are not planning nodes.
  for (int q : s.planNodes) EXPECT_FALSE(g.node(q).isInput());
}

TEST(GraphStates, CoarsenedCutsStayNestedAndEndWithTheFullSet) {
  ProfileGraph g = ProfileGraph::load(dataPath("resnet18.txt"));
  PlanningStates full = topologicalCutStates(g, 0);
  PlanningStates coarse = topologicalCutStates(g, 10);
  EXPECT_LE(coarse.size(), 10);
  EXPECT_GE(coarse.size(), 2);
  EXPECT_DOUBLE_EQ(coarse.computeSeconds.back(), full.computeSeconds.back());
  for (int j = 1; j < coarse.size(); ++j) {
    EXPECT_LT(coarse.computeSeconds[j - 1], coarse.computeSeconds[j] + 1e-15);
  }
}

}  // namespace
}  // namespace pipedream
