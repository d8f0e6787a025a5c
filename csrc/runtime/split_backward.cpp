#include "split_backward.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <deque>
#include <unordered_map>
#include <unordered_set>
#include <tuple>
#include <type_traits>
#include <utility>

namespace pipedream {

using torch::autograd::AccumulateGrad;
using torch::autograd::Edge;
using torch::autograd::edge_list;
using torch::autograd::FunctionPostHook;
using torch::autograd::FunctionPreHook;
using torch::autograd::Node;
using torch::autograd::variable_list;
using NodePtr = SplitBackward::NodePtr;

namespace {

// I: records the gradient arriving at a frontier node, unchanged.
class CaptureHook : public FunctionPreHook {
 public:
  explicit CaptureHook(variable_list* slot) : slot_(slot) {}
  variable_list operator()(const variable_list& grads) override {
    *slot_ = grads;
    return grads;
  }

 private:
  variable_list* slot_;  // owned by the SplitBackward, which outlives the hook
};

// I: frees the saved tensors of an input-path node that is no frontier node
// once it has run, as a full backward does (keep_graph=false): W never runs it,
// and its tensors (attention's, activations') would otherwise stay until the
// graph goes, so the input gradients computed after it could not reuse their
// memory (fresh pages from the OS: a third more time on a GPT stage).
class ReleaseHook : public FunctionPostHook {
 public:
  explicit ReleaseHook(Node* node) : node_(node) {}
  variable_list operator()(const variable_list& outputs, const variable_list& /*inputs*/) override {
    node_->release_variables();
    return outputs;
  }

 private:
  Node* node_;  // the node holding this hook
};

// Hooks installed for one engine call, removed when the scope ends (also on an
// exception), so the graph never keeps a hook pointing at freed state.
class HookScope {
 public:
  HookScope() = default;
  HookScope(const HookScope&) = delete;
  HookScope& operator=(const HookScope&) = delete;
  ~HookScope() {
    for (auto& [node, hook] : pre_) {
      auto& hooks = node->pre_hooks();
      hooks.erase(std::remove_if(hooks.begin(), hooks.end(),
                                 [hook = hook](const auto& h) { return h.get() == hook; }),
                  hooks.end());
    }
    for (auto& [node, key] : post_) node->del_post_hook(key);
  }
  void add(const NodePtr& node, std::unique_ptr<FunctionPreHook> hook) {
    pre_.emplace_back(node, hook.get());
    node->add_pre_hook(std::move(hook));
  }
  // `node` belongs to the graph, which outlives the scope (the caller holds its roots).
  void add(Node* node, std::unique_ptr<FunctionPostHook> hook) {
    post_.emplace_back(node, node->add_post_hook(std::move(hook)));
  }

 private:
  std::vector<std::pair<NodePtr, FunctionPreHook*>> pre_;
  std::vector<std::pair<Node*, uintptr_t>> post_;
};

// W's graph root: hands the captured gradients over to the frontier nodes and
// keeps none of them (torch's GraphRoot returns a copy and holds them until the
// engine call ends), so each is freed once its frontier node has run, as in a
// full backward, and the weight gradients can reuse its memory.
struct HandOverRoot : torch::autograd::GraphRoot {
  using GraphRoot::GraphRoot;
  variable_list apply(variable_list&& /*inputs*/) override { return std::move(outputs); }
};

// A new node behind a NodePtr (std::shared_ptr before torch 2.12, c10::intrusive_ptr after).
template <typename T, typename... Args>
NodePtr makeNode(Args&&... args) {
  if constexpr (std::is_constructible_v<NodePtr, std::shared_ptr<T>>) {
    return std::make_shared<T>(std::forward<Args>(args)...);
  } else {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  }
}

// W: the frontier nodes' edges into the input path, cut for one engine call and
// restored when the scope ends (also on an exception).
class EdgeCut {
 public:
  EdgeCut() = default;
  EdgeCut(const EdgeCut&) = delete;
  EdgeCut& operator=(const EdgeCut&) = delete;
  ~EdgeCut() {
    for (auto& [node, index, edge] : cut_) node->next_edges()[index] = std::move(edge);
  }
  void cut(const NodePtr& node, uint32_t index) {
    cut_.emplace_back(node, index, std::move(node->next_edges()[index]));
    node->next_edges()[index] = Edge();
  }

 private:
  std::vector<std::tuple<NodePtr, uint32_t, Edge>> cut_;
};

// Parents of every node reachable from the roots (the reverse of next_edges).
using Parents = std::unordered_map<Node*, std::vector<NodePtr>>;

// Fills `leaves` with the gradient accumulators of the leaves the graph reaches,
// in the order found.
Parents reverseGraph(const edge_list& roots, std::vector<NodePtr>& leaves) {
  Parents parents;
  std::unordered_set<Node*> seen;
  std::deque<NodePtr> queue;
  for (const auto& e : roots) {
    if (e.function && seen.insert(e.function.get()).second) queue.push_back(e.function);
  }
  while (!queue.empty()) {
    NodePtr node = queue.front();
    queue.pop_front();
    parents.try_emplace(node.get());
    if (dynamic_cast<AccumulateGrad*>(node.get()) != nullptr) leaves.push_back(node);
    for (const auto& next : node->next_edges()) {
      if (!next.function) continue;
      parents[next.function.get()].push_back(node);
      if (seen.insert(next.function.get()).second) queue.push_back(next.function);
    }
  }
  return parents;
}

// Nodes from which one of `starts` is reachable (the input-gradient path).
std::unordered_set<Node*> upwardClosure(const std::vector<Node*>& starts, const Parents& parents) {
  std::unordered_set<Node*> closure;
  std::deque<Node*> queue;
  for (Node* n : starts) {
    if (parents.count(n) && closure.insert(n).second) queue.push_back(n);
  }
  while (!queue.empty()) {
    Node* node = queue.front();
    queue.pop_front();
    for (const auto& p : parents.at(node)) {
      if (closure.insert(p.get()).second) queue.push_back(p.get());
    }
  }
  return closure;
}

// The weight branches: nodes off the input path from which a weight is
// reachable, found upwards from the weights; returns the input-path nodes where
// they meet the input path (the frontier), in the order found. Appends the
// weights' edges to `weightEdges`: those of `weights` the graph uses, and every
// other leaf off the input path (the graph may use other tensors than those
// given: FSDP2 runs the forward on unsharded copies of the parameters it
// registered, and a full backward accumulates into all of them).
std::vector<NodePtr> findFrontier(const std::vector<at::Tensor>& weights,
                                  const std::vector<NodePtr>& leaves, const Parents& parents,
                                  const std::unordered_set<Node*>& inputPath,
                                  edge_list& weightEdges) {
  std::unordered_set<Node*> branch;
  std::deque<Node*> queue;
  for (const auto& w : weights) {
    if (!w.requires_grad()) continue;
    Edge edge = torch::autograd::impl::gradient_edge(w);
    Node* accumulator = edge.function.get();
    if (!accumulator || !parents.count(accumulator)) continue;  // unused by this microbatch
    weightEdges.push_back(std::move(edge));
    if (branch.insert(accumulator).second) queue.push_back(accumulator);
  }
  for (const auto& leaf : leaves) {
    if (inputPath.count(leaf.get()) || !branch.insert(leaf.get()).second) continue;
    weightEdges.emplace_back(leaf, 0);
    queue.push_back(leaf.get());
  }
  std::vector<NodePtr> frontier;
  std::unordered_set<Node*> found;
  while (!queue.empty()) {
    Node* node = queue.front();
    queue.pop_front();
    for (const auto& p : parents.at(node)) {
      if (!inputPath.count(p.get())) {
        if (branch.insert(p.get()).second) queue.push_back(p.get());
      } else if (found.insert(p.get()).second) {
        frontier.push_back(p);
      }
    }
  }
  return frontier;
}

}  // namespace

SplitBackward::~SplitBackward() = default;

std::vector<at::Tensor> SplitBackward::inputPass(const std::vector<at::Tensor>& roots,
                                                 const std::vector<at::Tensor>& grads,
                                                 const std::vector<at::Tensor>& inputs,
                                                 const std::vector<at::Tensor>& weights,
                                                 SplitBackward& state) {
  namespace impl = torch::autograd::impl;
  state = SplitBackward();
  edge_list rootEdges;
  variable_list rootGrads;
  for (size_t k = 0; k < roots.size(); ++k) {
    if (!roots[k].requires_grad()) continue;
    rootEdges.push_back(impl::gradient_edge(roots[k]));
    rootGrads.push_back(grads[k].defined() ? grads[k] : at::ones_like(roots[k]));
  }
  std::vector<NodePtr> leaves;
  const Parents parents = reverseGraph(rootEdges, leaves);
  edge_list inputEdges;
  std::vector<size_t> inputIndex;
  std::vector<Node*> inputNodes;
  for (size_t k = 0; k < inputs.size(); ++k) {
    if (!inputs[k].requires_grad()) continue;
    inputEdges.push_back(impl::gradient_edge(inputs[k]));
    inputIndex.push_back(k);
    inputNodes.push_back(inputEdges.back().function.get());
  }
  const std::unordered_set<Node*> inputPath = upwardClosure(inputNodes, parents);
  for (size_t k = 0; k < rootEdges.size(); ++k) {
    if (!inputPath.count(rootEdges[k].function.get())) {
      state.rootEdges_.push_back(rootEdges[k]);
      state.rootGrads_.push_back(rootGrads[k]);
    }
  }

  std::unordered_set<Node*> untouchedByW(inputPath);  // input-path nodes W does not run
  for (const NodePtr& node : findFrontier(weights, leaves, parents, inputPath, state.weightEdges_)) {
    auto f = std::make_unique<Frontier>();
    f->node = node;
    const auto& next = node->next_edges();
    for (uint32_t i = 0; i < next.size(); ++i) {
      if (next[i].function && inputPath.count(next[i].function.get())) f->inputPathEdges.push_back(i);
    }
    untouchedByW.erase(node.get());
    state.frontier_.push_back(std::move(f));
  }
  for (Node* n : inputNodes) untouchedByW.erase(n);  // outputs of I, not run by it

  std::vector<at::Tensor> gradInputs(inputs.size());
  HookScope hooks;
  for (auto& f : state.frontier_) {
    hooks.add(f->node, std::make_unique<CaptureHook>(&f->captured));
  }
  for (Node* n : untouchedByW) hooks.add(n, std::make_unique<ReleaseHook>(n));
  if (!rootEdges.empty() && !inputEdges.empty()) {
    // torch::autograd::grad(roots, inputs, retain_graph=true, allow_unused=true),
    // on the engine directly: the same graph task, with our hooks in it.
    variable_list result = torch::autograd::Engine::get_default_engine().execute(
        rootEdges, rootGrads, /*keep_graph=*/true, /*create_graph=*/false,
        /*accumulate_grad=*/false, inputEdges);
    for (size_t n = 0; n < inputIndex.size(); ++n) gradInputs[inputIndex[n]] = result[n];
  }
  return gradInputs;
}

void SplitBackward::weightPass() {
  edge_list edges;
  variable_list grads;
  EdgeCut cut;
  for (const auto& f : frontier_) {
    for (uint32_t slot = 0; slot < f->captured.size(); ++slot) {
      if (!f->captured[slot].defined()) continue;
      edges.emplace_back(f->node, slot);
      grads.push_back(std::move(f->captured[slot]));
    }
    f->captured.clear();
    for (uint32_t index : f->inputPathEdges) cut.cut(f->node, index);
  }
  edges.insert(edges.end(), rootEdges_.begin(), rootEdges_.end());
  for (auto& g : rootGrads_) grads.push_back(std::move(g));
  rootGrads_.clear();
  if (!edges.empty() && !weightEdges_.empty()) {
    // Like backward(inputs=weights): only the weight branches run, and the
    // gradients accumulate into .grad. The engine starts at our one root node,
    // which then owns the gradients; its own input (checked against the first
    // gradient's shape, then dropped) is a one-element stand-in.
    const at::Tensor& first = grads.front();
    const variable_list token{at::zeros({}, first.options()).expand(first.sizes())};
    const edge_list root{Edge(makeNode<HandOverRoot>(std::move(edges), std::move(grads)), 0)};
    torch::autograd::Engine::get_default_engine().execute(
        root, token, /*keep_graph=*/false, /*create_graph=*/false, /*accumulate_grad=*/true,
        weightEdges_);
  }
  frontier_.clear();
  rootEdges_.clear();
  weightEdges_.clear();
}

}  // namespace pipedream
