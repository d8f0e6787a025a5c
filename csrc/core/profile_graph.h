// A layer profile graph in PipeDream's graph.txt format, and the planning
// states derived from it.
//
// graph.txt (msr-fiddle/pipedream, graph/graph.py): one node a line,
//   nodeN -- <description> -- forward_compute_time=<ms>, backward_compute_time=<ms>,
//            activation_size=<bytes or [b; b; ...]>, parameter_size=<bytes>[ -- stage_id=<s>]
// then one edge a line, tab-indented: "\tnodeA -- nodeB". The file has no
// trailing newline (PipeDream joins lines with "\n").
//
// Planning states (see docs/planner.md):
//   - Antichain: PipeDream's states, the downward-closed node sets reachable
//     from the first source by repeatedly adding a node (with its ancestors)
//     that has a predecessor in the set. Used while their number stays under a
//     cap.
//   - TopologicalCut: the prefixes of one topological order; what crosses a cut
//     is the set of live activations. Always polynomial (one state per node).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace pipedream {

struct GraphNode {
  std::string id;           // "node12"
  std::string description;  // "Conv2d(...)", "Input0", ...
  double forwardMs = 0.0;
  double backwardMs = 0.0;
  double activationBytes = 0.0;  // sum when the file lists several outputs
  std::string activationText;    // as written in the file ("" -> "%.3f")
  double parameterBytes = 0.0;
  int stageId = -1;  // optional " -- stage_id=N" suffix, -1 when absent

  bool isInput() const { return description.rfind("Input", 0) == 0; }
};

class ProfileGraph {
 public:
  // Parses graph.txt text; `source` names the file in error messages.
  static ProfileGraph parse(const std::string& text, const std::string& source = "<string>");
  static ProfileGraph load(const std::string& path);
  // PipeDream's text form (nodes, then edges, "\n"-joined, no trailing newline).
  std::string toString() const;
  void save(const std::string& path) const;

  // Returns the new node's index; throws on a duplicate id or negative value.
  int addNode(const GraphNode& node);
  void addEdge(const std::string& from, const std::string& to);
  void addEdge(int from, int to);

  int numNodes() const { return static_cast<int>(nodes_.size()); }
  const GraphNode& node(int index) const { return nodes_.at(index); }
  const std::vector<GraphNode>& nodes() const { return nodes_; }
  const std::vector<std::pair<int, int>>& edges() const { return edges_; }
  const std::vector<int>& successors(int index) const { return succ_.at(index); }
  const std::vector<int>& predecessors(int index) const { return pred_.at(index); }
  int indexOf(const std::string& id) const;  // -1 when absent

  // Kahn's order, ties broken by file order; throws on a cycle.
  std::vector<int> topologicalOrder() const;
  // A single path (every node at most one predecessor and one successor,
  // connected). Returns the nodes in path order in `order` when true.
  bool isChain(std::vector<int>* order = nullptr) const;

 private:
  std::vector<GraphNode> nodes_;
  std::vector<std::pair<int, int>> edges_;
  std::vector<std::vector<int>> succ_, pred_;
};

enum class StateKind { Antichain, TopologicalCut };
const char* stateKindName(StateKind kind);

// The node sets the planner cuts between. State j is a downward-closed set of
// planning nodes; states are indexed in a topological order (a subset gets a
// smaller index), the last state holds every planning node.
struct PlanningStates {
  StateKind kind = StateKind::Antichain;
  // Graph node indices the planner sees: Input sources and __getitem__ sinks
  // are removed as in PipeDream (they are placed afterwards).
  std::vector<int> planNodes;
  int words = 0;                              // 64-bit words per membership set
  std::vector<std::vector<uint64_t>> member;  // state -> bitset over planNodes positions
  std::vector<double> computeSeconds;         // cumulative (fwd + bwd) / 1000
  std::vector<double> activationBytes;        // cumulative activation bytes
  std::vector<double> parameterBytes;         // cumulative weight bytes
  std::vector<double> antichainBytes;         // PipeDream: outputs of its augmented antichain
  std::vector<double> liveBytes;              // outputs consumed outside the set
  std::vector<std::vector<int>> preds;        // strict subsets, ascending

  int size() const { return static_cast<int>(computeSeconds.size()); }
  bool contains(int state, int position) const {
    return (member[state][position >> 6] >> (position & 63)) & 1ULL;
  }
};

// PipeDream's antichain states. Returns false (and leaves `out` unspecified)
// when more than `maxStates` states exist.
bool enumerateAntichainStates(const ProfileGraph& graph, int maxStates, PlanningStates* out);
// Prefixes of a topological order; `maxStates` > 0 coarsens the order into at
// most that many states (cuts kept at the smallest live activation inside
// equal-compute buckets); 0 keeps one state per planning node.
PlanningStates topologicalCutStates(const ProfileGraph& graph, int maxStates = 0);

}  // namespace pipedream
