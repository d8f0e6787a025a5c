// The whole-configuration search (csrc/core/configure.h) over plain dicts:
// keys are the snake_case names of the C++ fields; a missing key takes the
// C++ default, an unknown one raises ValueError naming it.
#include <torch/extension.h>

#include <functional>
#include <map>
#include <stdexcept>
#include <string>

#include "bindings/bindings.h"
#include "core/configure.h"

namespace py = pybind11;

namespace pipedream {
namespace {

using Setter = std::function<void(py::handle)>;

// Applies each key of `d` through its setter; unknown keys raise.
void readDict(const py::dict& d, const std::map<std::string, Setter>& setters, const char* what) {
  for (auto item : d) {
    const std::string key = py::str(item.first);
    const auto found = setters.find(key);
    if (found == setters.end()) {
      std::string known;
      for (const auto& [name, setter] : setters) known += (known.empty() ? "" : ", ") + name;
      throw std::invalid_argument("unknown " + std::string(what) + " key '" + key +
                                  "'; known keys: " + known);
    }
    try {
      found->second(item.second);
    } catch (const py::cast_error&) {
      throw std::invalid_argument(std::string(what) + " key '" + key + "' has the wrong type (got " +
                                  std::string(py::str(py::repr(item.second))) + ")");
    }
  }
}

template <typename T>
Setter into(T& field) {
  return [&field](py::handle v) { field = v.cast<T>(); };
}

LayerCost layerFromDict(const py::dict& d) {
  LayerCost c;
  readDict(d,
           {{"forward_fixed", into(c.forwardFixed)},
            {"forward_per_sample", into(c.forwardPerSample)},
            {"backward_fixed", into(c.backwardFixed)},
            {"backward_per_sample", into(c.backwardPerSample)},
            {"weight_share", into(c.weightShare)},
            {"output_bytes_per_sample", into(c.outputBytesPerSample)},
            {"stash_bytes_per_sample", into(c.stashBytesPerSample)},
            {"input_bytes_per_sample", into(c.inputBytesPerSample)},
            {"parameter_bytes", into(c.parameterBytes)},
            {"parameter_tensors", into(c.parameterTensors)},
            {"largest_parameter_bytes", into(c.largestParameterBytes)},
            {"tp_collectives", into(c.tpCollectives)},
            {"tp_collective_bytes_per_sample", into(c.tpCollectiveBytesPerSample)},
            {"expert_parameter_bytes", into(c.expertParameterBytes)},
            {"all_to_all_calls", into(c.allToAllCalls)},
            {"all_to_all_bytes_per_sample", into(c.allToAllBytesPerSample)},
            {"optimizer_seconds", into(c.optimizerSeconds)}},
           "layer");
  return c;
}

std::vector<LayerCost> layersFromList(const py::list& layers) {
  std::vector<LayerCost> out;
  for (auto layer : layers) out.push_back(layerFromDict(layer.cast<py::dict>()));
  return out;
}

MachineCosts machineFromDict(const py::dict& d) {
  MachineCosts m;
  readDict(d,
           {{"action_seconds", into(m.actionSeconds)},
            {"send_seconds", into(m.sendSeconds)},
            {"send_seconds_per_byte", into(m.sendSecondsPerByte)},
            {"step_seconds", into(m.stepSeconds)},
            {"latency_seconds", into(m.latencySeconds)},
            {"bandwidth", into(m.bandwidth)},
            {"all_reduce_latency_seconds", into(m.allReduceLatencySeconds)},
            {"all_reduce_bandwidth", into(m.allReduceBandwidth)},
            {"optimizer_seconds_per_byte", into(m.optimizerSecondsPerByte)},
            {"optimizer_seconds_per_tensor", into(m.optimizerSecondsPerTensor)},
            {"cores", into(m.cores)},
            {"ranks_per_node", into(m.ranksPerNode)},
            {"fsdp_call_seconds", into(m.fsdpCallSeconds)},
            {"replicate_call_seconds", into(m.replicateCallSeconds)}},
           "machine");
  return m;
}

RecomputeChoice parseRecompute(const std::string& name) {
  if (name == "never") return RecomputeChoice::kNever;
  if (name == "always") return RecomputeChoice::kAlways;
  if (name == "search") return RecomputeChoice::kSearch;
  throw std::invalid_argument("recompute must be 'never', 'always' or 'search' (got '" + name +
                              "'); give a list of 0/1 per stage as recompute_stages");
}

SearchSpace spaceFromDict(const py::dict& d) {
  SearchSpace s;
  readDict(d,
           {{"world_size", into(s.worldSize)},
            {"batch_size", into(s.batchSize)},
            {"schedules", into(s.schedules)},
            {"interleaved_chunks", into(s.interleavedChunks)},
            {"microbatches", into(s.microbatches)},
            {"meshes", into(s.meshes)},
            {"balance", into(s.balance)},
            {"recompute", [&s](py::handle v) { s.recompute = parseRecompute(v.cast<std::string>()); }},
            {"recompute_stages", into(s.recomputeStages)},
            {"memory_bytes", into(s.memoryBytes)},
            {"optimizer_state_factor", into(s.optimizerStateFactor)},
            {"fsdp", into(s.fsdp)},
            {"ep", into(s.ep)},
            {"candidates", into(s.candidates)}},
           "space");
  return s;
}

Configuration configFromDict(const py::dict& d) {
  Configuration c;
  readDict(d,
           {{"schedule", into(c.schedule)},
            {"chunks", into(c.chunks)},
            {"microbatches", into(c.microbatches)},
            {"pp", into(c.pp)},
            {"dp", into(c.dp)},
            {"tp", into(c.tp)},
            {"ep", into(c.ep)},
            {"balance", into(c.balance)},
            {"replicas", into(c.replicas)},
            {"recompute", into(c.recompute)},
            // a configuration dict read back may carry its prediction: ignored
            {"prediction", [](py::handle) {}}},
           "configuration");
  return c;
}

py::dict predictionToDict(const Prediction& p) {
  py::dict d;
  d["step_seconds"] = p.stepSeconds;
  d["pipeline_seconds"] = p.pipelineSeconds;
  d["overhead_seconds"] = p.overheadSeconds;
  d["all_reduce_seconds"] = p.allReduceSeconds;
  d["compute_seconds"] = p.computeSeconds;
  d["wait_seconds"] = p.waitSeconds;
  d["transfer_seconds"] = p.transferSeconds;
  d["peak_bytes"] = p.peakBytes;
  d["bubble_fraction"] = p.bubbleFraction;
  d["fits"] = p.fits;
  return d;
}

py::dict configToDict(const Configuration& c) {
  py::dict d;
  d["schedule"] = c.schedule;
  d["chunks"] = c.chunks;
  d["microbatches"] = c.microbatches;
  d["pp"] = c.pp;
  d["dp"] = c.dp;
  d["tp"] = c.tp;
  d["ep"] = c.ep;
  d["balance"] = c.balance;
  d["replicas"] = c.replicas;
  d["recompute"] = c.recompute;
  d["prediction"] = predictionToDict(c.prediction);
  return d;
}

py::dict resultToDict(const SearchResult& r) {
  py::dict d;
  d["feasible"] = r.feasible;
  d["best"] = configToDict(r.best);
  py::list candidates;
  for (const auto& c : r.candidates) candidates.append(configToDict(c));
  d["candidates"] = candidates;
  d["evaluated"] = r.evaluated;
  d["pruned"] = r.pruned;
  return d;
}

using SearchFunction = SearchResult (*)(const std::vector<LayerCost>&, const MachineCosts&,
                                        const SearchSpace&);

template <SearchFunction search>
py::dict runSearch(const py::list& layers, const py::dict& machine, const py::dict& space) {
  const auto costs = layersFromList(layers);
  const MachineCosts m = machineFromDict(machine);
  const SearchSpace s = spaceFromDict(space);
  SearchResult result;
  {
    py::gil_scoped_release release;
    result = search(costs, m, s);
  }
  return resultToDict(result);
}

}  // namespace

void bindConfigure(py::module_& m) {
  m.def(
      "predict_configuration",
      [](const py::list& layers, int batchSize, const py::dict& machine, const py::dict& config,
         double memoryBytes, double optimizerStateFactor, bool fsdp) {
        const auto costs = layersFromList(layers);
        const MachineCosts mc = machineFromDict(machine);
        const Configuration c = configFromDict(config);
        return predictionToDict(
            predictConfiguration(costs, batchSize, mc, c, memoryBytes, optimizerStateFactor, fsdp));
      },
      py::arg("layers"), py::arg("batch_size"), py::arg("machine"), py::arg("config"),
      py::arg("memory_bytes") = 0.0, py::arg("optimizer_state_factor") = 2.0,
      py::arg("fsdp") = false);
  m.def("search_configurations", &runSearch<searchConfigurations>, py::arg("layers"),
        py::arg("machine"), py::arg("space"));
  m.def("enumerate_configurations", &runSearch<enumerateConfigurations>, py::arg("layers"),
        py::arg("machine"), py::arg("space"));
}

}  // namespace pipedream
