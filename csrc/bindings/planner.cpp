// The planner: layer profile graphs (csrc/core/profile_graph.h) and the
// partition planner (csrc/core/planner.h); plans come back as dicts.
#include <torch/extension.h>

#include <stdexcept>

#include "bindings/bindings.h"
#include "core/planner.h"
#include "core/profile_graph.h"
#include "core/topology.h"

namespace py = pybind11;

namespace pipedream {
namespace {

py::dict planStageToDict(const ProfileGraph& g, const Plan& p, const PlanStage& st) {
  py::dict d;
  py::list nodes;
  for (int v : st.nodes) nodes.append(g.node(v).id);
  d["nodes"] = nodes;
  d["replicas"] = st.replicas;
  d["ranks"] = st.ranks;
  d["time"] = st.time;
  d["compute_seconds"] = st.computeSeconds;
  d["parameter_bytes"] = st.parameterBytes;
  d["activation_bytes"] = st.activationBytes;
  d["memory_bytes"] = st.memoryBytes;
  d["model_state_bytes"] = st.modelStateBytes;
  d["stashed_activation_bytes"] = st.stashedActivationBytes;
  d["tensor_parallel_seconds"] = st.tensorParallelSeconds;
  if (p.chain) {
    d["layers"] = py::make_tuple(st.layerStart, st.layerEnd);
  } else {
    d["layers"] = py::none();
  }
  return d;
}

py::dict planToDict(const ProfileGraph& g, const Plan& p) {
  py::list stages;
  for (const PlanStage& st : p.stages) stages.append(planStageToDict(g, p, st));
  py::dict out;
  out["cost_model"] = costModelName(p.costModel);
  out["state_kind"] = stateKindName(p.stateKind);
  out["num_states"] = p.numStates;
  out["coarsened"] = p.coarsened;
  out["num_workers"] = p.numWorkers;
  out["used_workers"] = p.usedWorkers;
  out["chain"] = p.chain;
  out["time_per_stage"] = p.timePerStage;
  out["data_parallel_time"] = p.dataParallelTime;
  out["single_worker_time"] = p.singleWorkerTime;
  out["speedup_over_dp"] = p.speedupOverDp;
  out["stages"] = stages;
  return out;
}

int addGraphNode(ProfileGraph& g, const std::string& id, const std::string& description,
                 double forwardMs, double backwardMs, double activationBytes, double parameterBytes) {
  GraphNode n;
  n.id = id;
  n.description = description;
  n.forwardMs = forwardMs;
  n.backwardMs = backwardMs;
  n.activationBytes = activationBytes;
  n.parameterBytes = parameterBytes;
  return g.addNode(n);
}

py::list graphNodes(const ProfileGraph& g) {
  py::list out;
  for (const GraphNode& n : g.nodes()) {
    py::dict d;
    d["id"] = n.id;
    d["description"] = n.description;
    d["forward_ms"] = n.forwardMs;
    d["backward_ms"] = n.backwardMs;
    d["activation_bytes"] = n.activationBytes;
    d["parameter_bytes"] = n.parameterBytes;
    d["is_input"] = n.isInput();  // the planner's rule (an "Input..." description)
    out.append(d);
  }
  return out;
}

void bindProfileGraph(py::module_& m) {
  py::class_<ProfileGraph>(m, "ProfileGraph",
                           "A layer profile graph in PipeDream's graph.txt format.")
      .def(py::init<>())
      .def_static("parse", &ProfileGraph::parse, py::arg("text"), py::arg("source") = "<string>")
      .def_static("load", &ProfileGraph::load, py::arg("path"))
      .def("to_string", &ProfileGraph::toString)
      .def("save", &ProfileGraph::save, py::arg("path"))
      .def("add_node", &addGraphNode, py::arg("id"), py::arg("description"), py::arg("forward_ms"),
           py::arg("backward_ms"), py::arg("activation_bytes"), py::arg("parameter_bytes"))
      .def("add_edge",
           py::overload_cast<const std::string&, const std::string&>(&ProfileGraph::addEdge),
           py::arg("src"), py::arg("dst"))
      .def("__len__", &ProfileGraph::numNodes)
      .def("is_chain", [](const ProfileGraph& g) { return g.isChain(); })
      .def("nodes", &graphNodes,
           "One dict per node, in file order: id, description, forward_ms, backward_ms, "
           "activation_bytes, parameter_bytes and is_input (an 'Input...' source, which the "
           "planner places in stage 0).")
      .def("edges", [](const ProfileGraph& g) {
        std::vector<std::pair<std::string, std::string>> out;
        for (const auto& e : g.edges()) out.emplace_back(g.node(e.first).id, g.node(e.second).id);
        return out;
      });
}

// plan_graph(): the cluster as levels innermost first (workers and bandwidth
// per level), planned with the GIL released; data_parallel > 0 plans that many
// data-parallel ranks inside every stage, tensor_parallel > 1 that many tp
// ranks inside each of those.
py::dict planGraph(const ProfileGraph& g, const std::vector<int>& workers,
                   const std::vector<double>& bandwidth, double memory, bool straight, bool fewerWorkers,
                   const std::string& costModel, double compression, bool twoBw, int maxAntichainStates,
                   double workBudget, int dataParallel, const std::string& sharding,
                   double dataParallelBandwidth, double optimizerState, int tensorParallel,
                   bool sequenceParallel, double tensorParallelBandwidth,
                   double tensorParallelAllReduces) {
  if (workers.size() != bandwidth.size()) {
    throw std::invalid_argument("got " + std::to_string(workers.size()) + " worker counts but " +
                                std::to_string(bandwidth.size()) +
                                " bandwidths; give one bandwidth per level");
  }
  Topology t;
  for (size_t i = 0; i < workers.size(); ++i) t.levels.push_back({workers[i], bandwidth[i]});
  t.memoryBytes = memory;
  PlannerOptions o;
  o.costModel = parseCostModel(costModel);
  o.straight = straight;
  o.fewerWorkers = fewerWorkers;
  o.compression = compression;
  o.twoBw = twoBw;
  o.maxAntichainStates = maxAntichainStates;
  o.workBudget = workBudget;
  o.dataParallel.degree = dataParallel;
  o.dataParallel.sharding = parseSharding(sharding);
  o.dataParallel.bandwidth = dataParallelBandwidth;
  o.dataParallel.optimizerState = optimizerState;
  o.tensorParallel.degree = tensorParallel;
  o.tensorParallel.sequenceParallel = sequenceParallel;
  o.tensorParallel.bandwidth = tensorParallelBandwidth;
  o.tensorParallel.allReducesPerLayer = tensorParallelAllReduces;
  Plan p;
  {
    py::gil_scoped_release release;
    p = planPartition(g, t, o);
  }
  return planToDict(g, p);
}

}  // namespace

void bindPlanner(py::module_& m) {
  bindProfileGraph(m);
  m.def("plan_graph", &planGraph, py::arg("graph"), py::arg("workers"), py::arg("bandwidth"),
        py::arg("memory") = 0.0, py::arg("straight") = false, py::arg("fewer_workers") = false,
        py::arg("cost_model") = "default", py::arg("compression") = 0.0,
        py::arg("two_bw") = false, py::arg("max_antichain_states") = 4096,
        py::arg("work_budget") = 1.5e8, py::arg("data_parallel") = 0,
        py::arg("sharding") = "replicate", py::arg("data_parallel_bandwidth") = 0.0,
        py::arg("optimizer_state") = 2.0, py::arg("tensor_parallel") = 1,
        py::arg("sequence_parallel") = false, py::arg("tensor_parallel_bandwidth") = 0.0,
        py::arg("tensor_parallel_all_reduces") = 4.0,
        "Plans `graph` on a cluster (levels innermost first); returns a dict.");
  m.def(
      "count_antichain_states",
      [](const ProfileGraph& g, int cap) {
        PlanningStates s;
        return enumerateAntichainStates(g, cap, &s) ? s.size() : -1;
      },
      py::arg("graph"), py::arg("cap"),
      "PipeDream's state count, or -1 when it exceeds `cap`.");
}

}  // namespace pipedream
