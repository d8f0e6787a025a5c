#include "split_backward.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
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
// memory (fresh pages from the OS, each a page fault: 10-15% of a GPT stage's
// backward).
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

// What I's one walk over a stage's graph finds: the input path (the nodes from
// which an input is reachable), its frontier nodes (input-path nodes with an
// edge to a node off the input path from which a leaf is reachable: a weight
// branch) with their edges into the input path, and the other input-path nodes.
struct GraphWalk {
  struct Mark {
    bool onPath = false;       // an input is reachable from it (or it is one)
    bool reachesLeaf = false;  // a leaf (gradient accumulator) is reachable from it
  };
  std::unordered_map<Node*, Mark> marks;  // every node reached
  std::vector<std::pair<NodePtr, std::vector<uint32_t>>> frontier;
  std::vector<Node*> pathOnly;  // input-path nodes W does not run (inputs excluded)
};

// Post-order over node->next_edges() from `roots`, not going past `inputs` (the
// stage's graph ends there), each node visited once: a node's marks follow from
// its children's.
GraphWalk walkGraph(const edge_list& roots, const std::unordered_set<Node*>& inputs) {
  GraphWalk walk;
  walk.marks.reserve(512);
  struct Frame {
    const NodePtr* node;  // in its parent's next_edges() or `roots`: stable during the walk
    size_t next = 0;      // the next child to visit
  };
  std::vector<Frame> stack;
  auto visit = [&](const NodePtr& node) {
    if (!walk.marks.try_emplace(node.get()).second) return;  // done (a DAG: never on the stack)
    if (inputs.count(node.get())) {
      walk.marks[node.get()].onPath = true;
    } else {
      stack.push_back(Frame{&node});
    }
  };
  for (const auto& root : roots) {
    if (root.function) visit(root.function);
    while (!stack.empty()) {
      Node* node = stack.back().node->get();
      const auto& next = node->next_edges();
      if (stack.back().next < next.size()) {
        const Edge& edge = next[stack.back().next++];
        if (edge.function) visit(edge.function);
        continue;
      }
      GraphWalk::Mark mark;
      mark.reachesLeaf = next.empty() && dynamic_cast<AccumulateGrad*>(node) != nullptr;
      std::vector<uint32_t> pathEdges;
      bool branches = false;  // an edge into a weight branch
      for (uint32_t i = 0; i < next.size(); ++i) {
        if (!next[i].function) continue;
        const GraphWalk::Mark& child = walk.marks.at(next[i].function.get());
        mark.reachesLeaf |= child.reachesLeaf;
        if (child.onPath) {
          mark.onPath = true;
          pathEdges.push_back(i);
        } else if (child.reachesLeaf) {
          branches = true;
        }
      }
      walk.marks[node] = mark;
      if (mark.onPath && branches) {
        walk.frontier.emplace_back(*stack.back().node, std::move(pathEdges));
      } else if (mark.onPath) {
        walk.pathOnly.push_back(node);
      }
      stack.pop_back();
    }
  }
  return walk;
}

}  // namespace

SplitBackward::~SplitBackward() = default;

std::vector<at::Tensor> SplitBackward::inputPass(const std::vector<at::Tensor>& roots,
                                                 const std::vector<at::Tensor>& grads,
                                                 const std::vector<at::Tensor>& inputs,
                                                 const std::vector<at::Tensor>& /*weights*/,
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
  edge_list inputEdges;
  std::vector<size_t> inputIndex;
  std::unordered_set<Node*> inputNodes;
  for (size_t k = 0; k < inputs.size(); ++k) {
    if (!inputs[k].requires_grad()) continue;
    inputEdges.push_back(impl::gradient_edge(inputs[k]));
    inputIndex.push_back(k);
    inputNodes.insert(inputEdges.back().function.get());
  }
  std::vector<at::Tensor> gradInputs(inputs.size());
  if (inputEdges.empty()) {  // a first stage: no input path, W is the whole backward
    state.rootEdges_ = std::move(rootEdges);
    state.rootGrads_ = std::move(rootGrads);
    return gradInputs;
  }
  const GraphWalk walk = walkGraph(rootEdges, inputNodes);
  for (size_t k = 0; k < rootEdges.size(); ++k) {
    if (!walk.marks.at(rootEdges[k].function.get()).onPath) {
      state.rootEdges_.push_back(rootEdges[k]);
      state.rootGrads_.push_back(rootGrads[k]);
    }
  }
  HookScope hooks;
  for (const auto& [node, pathEdges] : walk.frontier) {
    auto f = std::make_unique<Frontier>();
    f->node = node;
    f->inputPathEdges = pathEdges;
    hooks.add(node, std::make_unique<CaptureHook>(&f->captured));
    state.frontier_.push_back(std::move(f));
  }
  for (Node* node : walk.pathOnly) hooks.add(node, std::make_unique<ReleaseHook>(node));
  if (!rootEdges.empty()) {
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
  if (!edges.empty()) {
    // A backward from the frontier nodes, whose edges into the input path are
    // cut, and the roots off it: only the weight branches run, and the weights'
    // gradients accumulate into .grad, into every leaf the graph reaches off the
    // input path, as a full backward's do. The engine starts at our one root
    // node, which then owns the gradients; its own input (checked against the
    // first gradient's shape, then dropped) is a one-element stand-in.
    const at::Tensor& first = grads.front();
    const variable_list token{at::zeros({}, first.options()).expand(first.sizes())};
    const edge_list root{Edge(makeNode<HandOverRoot>(std::move(edges), std::move(grads)), 0)};
    torch::autograd::Engine::get_default_engine().execute(
        root, token, /*keep_graph=*/false, /*create_graph=*/false, /*accumulate_grad=*/true);
  }
  frontier_.clear();
  rootEdges_.clear();
}

}  // namespace pipedream
