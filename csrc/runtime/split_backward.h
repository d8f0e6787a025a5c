// A stage's backward split into I (input gradients) and W (weight gradients)
// without doing any of the work twice.
//
// Autograd computes a weight's gradient from the gradient arriving where the
// weight's branch leaves the path to the stage inputs. I runs the backward
// from the stage outputs to the inputs only (autograd then skips every weight
// branch: each node computes just the outputs the graph task needs) and, with
// pre-hooks, captures the gradient arriving at each *frontier* node, an
// input-path node with an edge into a weight branch. W starts the engine at
// the frontier nodes with the captured gradients and runs the weight branches;
// for that one call the frontier nodes' edges into the input path are cut
// (restored after), so no frontier node computes an input-path gradient again
// and nothing of the input path runs twice. (torch.distributed.pipelining's
// _backward.py starts W at the same nodes but keeps those edges, so it runs W
// per group of weights and re-runs the input path between nested frontier
// nodes of one group.)
//
//   outputs ──► N1 ──► N2 ──► input        input path (I runs it)
//               │      │
//               ▼      ▼
//               w1     w2                  weight branches (W runs them)
//
// Memory is freed as a full backward frees it, so that the gradients computed
// later reuse it instead of fresh pages from the OS (each a page fault: a GPT
// stage's I + W took 1.10-1.15x its backward when everything stayed until W):
// I releases the saved tensors of every input-path node W does not run once it
// has run (the graph is kept only for the frontier nodes and weight branches),
// and W's root node hands the captured gradients over to the engine, so each
// goes once its frontier node has run.
//
// Outputs that do not depend on the inputs (every output of the first stage,
// whose inputs need no gradient) start their weight branches directly: W feeds
// them the output gradients, so W is then the whole backward and I is empty.
//
// Threading: used by the executor's thread only, between one I and its W.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>  // Node; torch 2.11 ships no node.h

#include <memory>
#include <utility>
#include <vector>

namespace pipedream {

class SplitBackward {
 public:
  // std::shared_ptr<Node> before torch 2.12, c10::intrusive_ptr<Node> after.
  using NodePtr = decltype(std::declval<torch::autograd::Edge>().function);

  SplitBackward() = default;
  SplitBackward(SplitBackward&&) noexcept = default;
  SplitBackward& operator=(SplitBackward&&) noexcept = default;
  ~SplitBackward();

  // I: the gradients of `inputs` (undefined where an input needs none or gets
  // none), keeping the graph's weight side and the frontier gradients for
  // weightPass(). The weights are every leaf the graph reaches off the input
  // path, as a full backward accumulates into them: `weights` (the stage's
  // parameters) and any others, so a forward that ran on other tensors than the
  // registered parameters (FSDP2's unsharded copies) still gets its weight
  // gradients. `grads[k]` is the gradient of `roots[k]` (undefined: ones, for a
  // scalar loss).
  static std::vector<at::Tensor> inputPass(const std::vector<at::Tensor>& roots,
                                           const std::vector<at::Tensor>& grads,
                                           const std::vector<at::Tensor>& inputs,
                                           const std::vector<at::Tensor>& weights,
                                           SplitBackward& state);

  // W: accumulates the gradients of the weights into their .grad and frees the
  // graph parts it ran. Call once.
  void weightPass();

  // Frontier nodes whose gradients I captured; for tests.
  size_t numFrontierNodes() const { return frontier_.size(); }

 private:
  struct Frontier {
    NodePtr node;
    std::vector<at::Tensor> captured;      // the gradient arriving at it in I
    std::vector<uint32_t> inputPathEdges;  // its next edges into the input path
  };
  std::vector<std::unique_ptr<Frontier>> frontier_;  // stable addresses for the hooks
  // Roots off the input path and their gradients.
  torch::autograd::edge_list rootEdges_;
  std::vector<at::Tensor> rootGrads_;
};

}  // namespace pipedream
