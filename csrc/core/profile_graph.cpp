#include "profile_graph.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

namespace pipedream {
namespace {

std::vector<std::string> splitOn(const std::string& s, const std::string& sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    size_t pos = s.find(sep, start);
    if (pos == std::string::npos) {
      out.push_back(s.substr(start));
      return out;
    }
    out.push_back(s.substr(start, pos - start));
    start = pos + sep.size();
  }
}

std::string strip(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

std::string where(const std::string& source, int line) {
  return source + ":" + std::to_string(line) + ": ";
}

double parseNumber(const std::string& text, const std::string& field, const std::string& source,
                   int line) {
  std::string t = strip(text);
  errno = 0;
  char* end = nullptr;
  double v = t.empty() ? 0.0 : std::strtod(t.c_str(), &end);
  if (t.empty() || end != t.c_str() + t.size() || errno == ERANGE || !std::isfinite(v)) {
    throw std::invalid_argument(where(source, line) + "field '" + field + "': cannot parse '" + t +
                                "' as a number (expected e.g. " + field + "=1.250)");
  }
  if (v < 0) {
    throw std::invalid_argument(where(source, line) + "field '" + field + "' is negative (" + t +
                                "); profiles hold non-negative times and sizes");
  }
  return v;
}

// activation_size: one number, or "[a; b; ...]" (one per output) summed.
double parseActivationSize(const std::string& value, const char* key, const std::string& source,
                           int lineNo) {
  std::string v = strip(value);
  if (v.empty() || v.front() != '[') return parseNumber(v, key, source, lineNo);
  if (v.back() != ']') {
    throw std::invalid_argument(where(source, lineNo) + "field 'activation_size': list '" + v +
                                "' lacks its closing ']'");
  }
  double sum = 0.0;
  for (const std::string& part : splitOn(v.substr(1, v.size() - 2), ";")) {
    sum += parseNumber(part, key, source, lineNo);
  }
  return sum;
}

// "forward_compute_time=..., backward_compute_time=..., activation_size=...,
// parameter_size=..." into `node`.
void parseNodeFields(const std::string& list, GraphNode& node, const std::string& source, int lineNo) {
  std::vector<std::string> fields = splitOn(list, ", ");
  static const char* kKeys[4] = {"forward_compute_time", "backward_compute_time", "activation_size",
                                 "parameter_size"};
  if (fields.size() != 4) {
    throw std::invalid_argument(where(source, lineNo) + "expected 4 comma-separated fields (" +
                                "forward_compute_time, backward_compute_time, activation_size, " +
                                "parameter_size) but got " + std::to_string(fields.size()) +
                                " in '" + list + "'");
  }
  for (int f = 0; f < 4; ++f) {
    size_t eq = fields[f].find('=');
    std::string key = eq == std::string::npos ? strip(fields[f]) : strip(fields[f].substr(0, eq));
    if (key != kKeys[f] || eq == std::string::npos) {
      throw std::invalid_argument(where(source, lineNo) + "field " + std::to_string(f + 1) +
                                  " should be '" + kKeys[f] + "=<value>' but is '" + fields[f] + "'");
    }
    std::string value = fields[f].substr(eq + 1);
    if (f == 2) {
      node.activationText = value;
      node.activationBytes = parseActivationSize(value, kKeys[f], source, lineNo);
      continue;
    }
    double x = parseNumber(value, kKeys[f], source, lineNo);
    if (f == 0) node.forwardMs = x;
    if (f == 1) node.backwardMs = x;
    if (f == 3) node.parameterBytes = x;
  }
}

// A node line: "nodeN -- <description> -- <fields>[ -- stage_id=K]"; the
// description may itself contain " -- ".
GraphNode parseNodeLine(const std::string& line, const std::string& source, int lineNo) {
  std::vector<std::string> tok = splitOn(line, " -- ");
  if (tok.size() < 3) {
    throw std::invalid_argument(
        where(source, lineNo) + "expected 'nodeN -- <description> -- forward_compute_time=..., "
        "backward_compute_time=..., activation_size=..., parameter_size=...' but got '" + line + "'");
  }
  GraphNode node;
  node.id = strip(tok[0]);
  size_t last = tok.size() - 1;
  if (tok[last].rfind("stage_id=", 0) == 0) {
    node.stageId = static_cast<int>(parseNumber(tok[last].substr(9), "stage_id", source, lineNo));
    --last;
  }
  if (last < 2) {
    throw std::invalid_argument(where(source, lineNo) + "missing the metadata field list in '" + line +
                                "'");
  }
  std::string desc = tok[1];
  for (size_t t = 2; t < last; ++t) desc += " -- " + tok[t];
  node.description = desc;
  parseNodeFields(tok[last], node, source, lineNo);
  return node;
}

std::string formatFixed3(double v) {
  // Sized from snprintf: "%.3f" of a large value runs to 300+ digits.
  std::string out(static_cast<size_t>(std::snprintf(nullptr, 0, "%.3f", v)), '\0');
  std::snprintf(&out[0], out.size() + 1, "%.3f", v);
  return out;
}

struct BitsetHash {
  size_t operator()(const std::vector<uint64_t>& v) const {
    uint64_t h = 1469598103934665603ULL;
    for (uint64_t w : v) {
      h ^= w + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    }
    return static_cast<size_t>(h);
  }
};

// Planning nodes (PipeDream: drop Input sources, then __getitem__ sinks) and
// their adjacency in position space.
struct PlanView {
  std::vector<int> planNodes;
  std::vector<int> positionOf;  // graph index -> position, -1 if removed
  std::vector<std::vector<int>> succ, pred;
};

PlanView makePlanView(const ProfileGraph& g) {
  const int n = g.numNodes();
  std::vector<char> removed(n, 0);
  for (int v = 0; v < n; ++v) {
    if (g.node(v).isInput() && g.predecessors(v).empty()) removed[v] = 1;
  }
  for (int v = 0; v < n; ++v) {
    if (removed[v]) continue;
    if (g.successors(v).empty() && g.node(v).description.rfind("__getitem__", 0) == 0) {
      removed[v] = 1;
    }
  }
  PlanView view;
  view.positionOf.assign(n, -1);
  for (int v = 0; v < n; ++v) {
    if (!removed[v]) {
      view.positionOf[v] = static_cast<int>(view.planNodes.size());
      view.planNodes.push_back(v);
    }
  }
  if (view.planNodes.empty()) {
    throw std::invalid_argument(
        "profile graph has no layers to plan (only Input nodes); profile a model with at least "
        "one layer");
  }
  const int p = static_cast<int>(view.planNodes.size());
  view.succ.assign(p, {});
  view.pred.assign(p, {});
  for (const auto& e : g.edges()) {
    int a = view.positionOf[e.first], b = view.positionOf[e.second];
    if (a < 0 || b < 0) continue;
    view.succ[a].push_back(b);
    view.pred[b].push_back(a);
  }
  return view;
}

// Ancestor sets (each including the node itself) of the planning nodes, as
// bitsets over planning positions, built in topological order.
std::vector<std::vector<uint64_t>> ancestorSets(const ProfileGraph& g, const PlanView& view) {
  const int p = static_cast<int>(view.planNodes.size());
  const int words = (p + 63) / 64;
  std::vector<std::vector<uint64_t>> anc(p, std::vector<uint64_t>(words, 0));
  for (int v : g.topologicalOrder()) {
    const int q = view.positionOf[v];
    if (q < 0) continue;
    anc[q][q >> 6] |= 1ULL << (q & 63);
    for (int r : view.pred[q]) {
      for (int w = 0; w < words; ++w) anc[q][w] |= anc[r][w];
    }
  }
  return anc;
}

// Fills cumulative sums, boundary sizes and (optionally) preds for the states.
void finishStates(const ProfileGraph& g, const PlanView& view, PlanningStates* s,
                  bool chainPreds) {
  const int n = static_cast<int>(s->member.size());
  const int p = static_cast<int>(view.planNodes.size());
  s->computeSeconds.assign(n, 0.0);
  s->activationBytes.assign(n, 0.0);
  s->parameterBytes.assign(n, 0.0);
  s->antichainBytes.assign(n, 0.0);
  s->liveBytes.assign(n, 0.0);
  // For PipeDream's augmented antichains below.
  const std::vector<std::vector<uint64_t>> ancestors = ancestorSets(g, view);
  auto has = [](const std::vector<uint64_t>& bits, int q) { return (bits[q >> 6] >> (q & 63)) & 1ULL; };
  std::vector<char> extra(p);
  for (int j = 0; j < n; ++j) {
    std::fill(extra.begin(), extra.end(), 0);
    for (int q = 0; q < p; ++q) {
      if (!s->contains(j, q)) continue;
      const GraphNode& node = g.node(view.planNodes[q]);
      s->computeSeconds[j] += (node.forwardMs + node.backwardMs) / 1000.0;
      s->activationBytes[j] += node.activationBytes;
      s->parameterBytes[j] += node.parameterBytes;
      bool inside = false, outside = false;
      for (int r : view.succ[q]) (s->contains(j, r) ? inside : outside) = true;
      if (!inside) {
        s->antichainBytes[j] += node.activationBytes;
        // PipeDream's augment_antichain: an ancestor a of this antichain node
        // q that feeds a node outside q's ancestors (other than q) is part of
        // the state's boundary too, even when that consumer is inside the set.
        for (int a = 0; a < p; ++a) {
          if (a == q || !has(ancestors[q], a) || extra[a]) continue;
          for (int o : view.succ[a]) {
            if (o != q && !has(ancestors[q], o)) {
              extra[a] = 1;
              break;
            }
          }
        }
      }
      if (outside) s->liveBytes[j] += node.activationBytes;
    }
    for (int a = 0; a < p; ++a) {
      if (extra[a]) s->antichainBytes[j] += g.node(view.planNodes[a]).activationBytes;
    }
  }
  s->preds.assign(n, {});
  for (int j = 0; j < n; ++j) {
    for (int k = 0; k < j; ++k) {
      bool subset = true;
      if (!chainPreds) {
        for (int w = 0; w < s->words && subset; ++w) {
          subset = (s->member[k][w] & ~s->member[j][w]) == 0;
        }
      }
      if (subset) s->preds[j].push_back(k);
    }
  }
}

}  // namespace

const char* stateKindName(StateKind kind) {
  return kind == StateKind::Antichain ? "antichain" : "topological_cut";
}

// ---- ProfileGraph -----------------------------------------------------------

int ProfileGraph::indexOf(const std::string& id) const {
  for (int i = 0; i < numNodes(); ++i) {
    if (nodes_[i].id == id) return i;
  }
  return -1;
}

int ProfileGraph::addNode(const GraphNode& node) {
  if (node.id.empty() || node.id.find_first_of(" \t\n") != std::string::npos) {
    throw std::invalid_argument("node id '" + node.id +
                                "' is empty or contains whitespace; use ids like node3");
  }
  if (indexOf(node.id) >= 0) {
    throw std::invalid_argument("duplicate node id '" + node.id + "'; every node id must be unique");
  }
  for (double v : {node.forwardMs, node.backwardMs, node.activationBytes, node.parameterBytes}) {
    if (!(v >= 0) || !std::isfinite(v)) {
      throw std::invalid_argument("node '" + node.id + "' has a negative or non-finite value (" +
                                  std::to_string(v) + "); times and sizes must be >= 0");
    }
  }
  nodes_.push_back(node);
  succ_.emplace_back();
  pred_.emplace_back();
  return numNodes() - 1;
}

void ProfileGraph::addEdge(int from, int to) {
  if (from < 0 || to < 0 || from >= numNodes() || to >= numNodes() || from == to) {
    throw std::invalid_argument("edge " + std::to_string(from) + " -> " + std::to_string(to) +
                                " is invalid; both ends must be distinct existing nodes");
  }
  edges_.emplace_back(from, to);
  succ_[from].push_back(to);
  pred_[to].push_back(from);
}

void ProfileGraph::addEdge(const std::string& from, const std::string& to) {
  int a = indexOf(from), b = indexOf(to);
  if (a < 0 || b < 0) {
    throw std::invalid_argument("edge " + from + " -- " + to + " names an unknown node ('" +
                                (a < 0 ? from : to) + "'); add the node first");
  }
  addEdge(a, b);
}

ProfileGraph ProfileGraph::parse(const std::string& text, const std::string& source) {
  ProfileGraph g;
  std::unordered_map<std::string, int> index;
  std::vector<std::pair<std::string, int>> pendingEdges;  // "a -- b", line
  std::istringstream in(text);
  std::string raw;
  int lineNo = 0;
  while (std::getline(in, raw)) {
    ++lineNo;
    if (!raw.empty() && raw.back() == '\r') raw.pop_back();
    std::string line = strip(raw);
    if (line.empty()) continue;
    if (raw[0] == '\t' || raw[0] == ' ') {
      pendingEdges.emplace_back(line, lineNo);
      continue;
    }
    GraphNode node = parseNodeLine(line, source, lineNo);
    if (index.count(node.id)) {
      throw std::invalid_argument(where(source, lineNo) + "duplicate node id '" + node.id + "'");
    }
    index[node.id] = static_cast<int>(g.nodes_.size());
    g.nodes_.push_back(node);
    g.succ_.emplace_back();
    g.pred_.emplace_back();
  }
  for (const auto& pe : pendingEdges) {
    std::vector<std::string> tok = splitOn(pe.first, " -- ");
    if (tok.size() != 2) {
      throw std::invalid_argument(where(source, pe.second) + "edge should be '\\tnodeA -- nodeB' but is '" +
                                  pe.first + "'");
    }
    std::string a = strip(tok[0]), b = strip(tok[1]);
    auto ia = index.find(a), ib = index.find(b);
    if (ia == index.end() || ib == index.end()) {
      throw std::invalid_argument(where(source, pe.second) + "edge names unknown node '" +
                                  (ia == index.end() ? a : b) + "'; declare it on a node line");
    }
    if (ia->second == ib->second) {
      throw std::invalid_argument(where(source, pe.second) + "self edge on '" + a + "'");
    }
    g.edges_.emplace_back(ia->second, ib->second);
    g.succ_[ia->second].push_back(ib->second);
    g.pred_[ib->second].push_back(ia->second);
  }
  if (g.nodes_.empty()) {
    throw std::invalid_argument(source + ": no nodes found; is this a PipeDream graph.txt?");
  }
  try {
    g.topologicalOrder();
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(source + ": " + e.what());
  }
  return g;
}

ProfileGraph ProfileGraph::load(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    throw std::invalid_argument("cannot open profile '" + path +
                                "'; pass the path of a graph.txt written by `profile`");
  }
  std::stringstream ss;
  ss << f.rdbuf();
  return parse(ss.str(), path);
}

std::string ProfileGraph::toString() const {
  std::string out;
  bool first = true;
  auto emit = [&](const std::string& line) {
    if (!first) out += "\n";
    out += line;
    first = false;
  };
  for (const GraphNode& n : nodes_) {
    // Descriptions are written as given (the shipped profiles keep commas);
    // only line breaks would corrupt the format.
    std::string desc = n.description;
    std::replace(desc.begin(), desc.end(), '\n', ' ');
    std::string act = n.activationText.empty() ? formatFixed3(n.activationBytes) : n.activationText;
    std::string line = n.id + " -- " + desc + " -- forward_compute_time=" + formatFixed3(n.forwardMs) +
                       ", backward_compute_time=" + formatFixed3(n.backwardMs) +
                       ", activation_size=" + act + ", parameter_size=" + formatFixed3(n.parameterBytes);
    if (n.stageId >= 0) line += " -- stage_id=" + std::to_string(n.stageId);
    emit(line);
  }
  for (const auto& e : edges_) emit("\t" + nodes_[e.first].id + " -- " + nodes_[e.second].id);
  return out;
}

void ProfileGraph::save(const std::string& path) const {
  std::ofstream f(path, std::ios::binary);
  if (!f) throw std::invalid_argument("cannot write profile '" + path + "'; check the directory");
  f << toString();
}

std::vector<int> ProfileGraph::topologicalOrder() const {
  const int n = numNodes();
  std::vector<int> indeg(n, 0), order;
  for (const auto& e : edges_) ++indeg[e.second];
  // Smallest file index first: a min-heap over ready nodes.
  std::vector<int> ready;
  for (int v = 0; v < n; ++v) {
    if (indeg[v] == 0) ready.push_back(v);
  }
  std::make_heap(ready.begin(), ready.end(), std::greater<int>());
  while (!ready.empty()) {
    std::pop_heap(ready.begin(), ready.end(), std::greater<int>());
    int v = ready.back();
    ready.pop_back();
    order.push_back(v);
    for (int w : succ_[v]) {
      if (--indeg[w] == 0) {
        ready.push_back(w);
        std::push_heap(ready.begin(), ready.end(), std::greater<int>());
      }
    }
  }
  if (static_cast<int>(order.size()) != n) {
    for (int v = 0; v < n; ++v) {
      if (indeg[v] > 0) {
        throw std::invalid_argument("graph has a cycle through '" + nodes_[v].id +
                                    "'; a profile must be a DAG");
      }
    }
  }
  return order;
}

bool ProfileGraph::isChain(std::vector<int>* order) const {
  const int n = numNodes();
  int start = -1;
  for (int v = 0; v < n; ++v) {
    if (succ_[v].size() > 1 || pred_[v].size() > 1) return false;
    if (pred_[v].empty()) {
      if (start >= 0) return false;
      start = v;
    }
  }
  if (start < 0) return false;
  std::vector<int> path;
  for (int v = start;;) {
    path.push_back(v);
    if (succ_[v].empty()) break;
    v = succ_[v][0];
  }
  if (static_cast<int>(path.size()) != n) return false;
  if (order) *order = path;
  return true;
}

// ---- states -------------------------------------------------------------------

bool enumerateAntichainStates(const ProfileGraph& graph, int maxStates, PlanningStates* out) {
  PlanView view = makePlanView(graph);
  const int p = static_cast<int>(view.planNodes.size());
  const int words = (p + 63) / 64;
  const std::vector<std::vector<uint64_t>> anc = ancestorSets(graph, view);
  // PipeDream starts from the first source in file order.
  int s0 = -1;
  for (int q = 0; q < p && s0 < 0; ++q) {
    if (view.pred[q].empty()) s0 = q;
  }
  std::vector<std::vector<uint64_t>> states;
  std::unordered_map<std::vector<uint64_t>, int, BitsetHash> seen;
  states.push_back(anc[s0]);
  seen.emplace(anc[s0], 0);
  std::vector<uint64_t> next(words);
  for (size_t head = 0; head < states.size(); ++head) {
    const std::vector<uint64_t> cur = states[head];
    for (int q = 0; q < p; ++q) {
      if (!((cur[q >> 6] >> (q & 63)) & 1ULL)) continue;
      for (int y : view.succ[q]) {
        if ((cur[y >> 6] >> (y & 63)) & 1ULL) continue;
        for (int w = 0; w < words; ++w) next[w] = cur[w] | anc[y][w];
        if (seen.count(next)) continue;
        if (static_cast<int>(states.size()) >= maxStates) return false;
        seen.emplace(next, static_cast<int>(states.size()));
        states.push_back(next);
      }
    }
  }
  // The full set must be a state (it is unless the graph is disconnected).
  std::vector<uint64_t> full(words, 0);
  for (int q = 0; q < p; ++q) full[q >> 6] |= 1ULL << (q & 63);
  if (!seen.count(full)) return false;
  // Index order: by size, then discovery (a strict subset is always smaller).
  std::vector<int> idx(states.size());
  std::vector<int> count(states.size());
  for (size_t i = 0; i < states.size(); ++i) {
    idx[i] = static_cast<int>(i);
    int c = 0;
    for (uint64_t w : states[i]) c += __builtin_popcountll(w);
    count[i] = c;
  }
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return count[a] < count[b]; });
  out->kind = StateKind::Antichain;
  out->planNodes = view.planNodes;
  out->words = words;
  out->member.clear();
  for (int i : idx) out->member.push_back(states[i]);
  finishStates(graph, view, out, /*chainPreds=*/false);
  return true;
}

PlanningStates topologicalCutStates(const ProfileGraph& graph, int maxStates) {
  PlanView view = makePlanView(graph);
  const int p = static_cast<int>(view.planNodes.size());
  const int words = (p + 63) / 64;
  std::vector<int> topo;
  for (int v : graph.topologicalOrder()) {
    if (view.positionOf[v] >= 0) topo.push_back(view.positionOf[v]);
  }
  // Prefix lengths (1..p) that become states.
  std::vector<int> lengths;
  if (maxStates <= 0 || p <= maxStates) {
    for (int len = 1; len <= p; ++len) lengths.push_back(len);
  } else {
    // Live bytes and compute at every cut of the order.
    std::vector<char> in(p, 0);
    std::vector<int> remainingSucc(p);
    for (int q = 0; q < p; ++q) remainingSucc[q] = static_cast<int>(view.succ[q].size());
    std::vector<double> live(p), cum(p);
    double liveNow = 0.0, total = 0.0;
    for (int t = 0; t < p; ++t) {
      int q = topo[t];
      const GraphNode& node = graph.node(view.planNodes[q]);
      total += (node.forwardMs + node.backwardMs) / 1000.0;
      in[q] = 1;
      for (int r : view.pred[q]) {
        if (--remainingSucc[r] == 0) liveNow -= graph.node(view.planNodes[r]).activationBytes;
      }
      if (remainingSucc[q] > 0) liveNow += node.activationBytes;
      live[t] = liveNow;
      cum[t] = total;
    }
    const int buckets = maxStates;  // the last bucket ends at the full set
    std::vector<int> best(buckets, -1);
    for (int t = 0; t + 1 < p; ++t) {
      double frac = total > 0 ? cum[t] / total : static_cast<double>(t + 1) / p;
      int b = std::min(buckets - 2, static_cast<int>(frac * (buckets - 1)));
      if (b < 0) b = 0;
      if (best[b] < 0 || live[t] < live[best[b]]) best[b] = t;
    }
    for (int b = 0; b < buckets; ++b) {
      if (best[b] >= 0) lengths.push_back(best[b] + 1);
    }
    std::sort(lengths.begin(), lengths.end());
    lengths.erase(std::unique(lengths.begin(), lengths.end()), lengths.end());
    lengths.push_back(p);
  }
  PlanningStates s;
  s.kind = StateKind::TopologicalCut;
  s.planNodes = view.planNodes;
  s.words = words;
  std::vector<uint64_t> bits(words, 0);
  int done = 0;
  for (int len : lengths) {
    for (; done < len; ++done) bits[topo[done] >> 6] |= 1ULL << (topo[done] & 63);
    s.member.push_back(bits);
  }
  finishStates(graph, view, &s, /*chainPreds=*/true);
  return s;
}

}  // namespace pipedream
