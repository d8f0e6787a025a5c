// The simulator (csrc/core/simulate.h): stage costs, its result and timeline,
// and the simulated schedule's Chrome trace.
#include <torch/extension.h>

#include "bindings/bindings.h"
#include "core/simulate.h"

namespace py = pybind11;

namespace pipedream {

void bindSimulator(py::module_& m) {
  py::class_<StageCosts>(m, "StageCosts")
      .def(py::init<>())
      .def_readwrite("forward", &StageCosts::forward)
      .def_readwrite("backward", &StageCosts::backward)
      .def_readwrite("weight", &StageCosts::weight)
      .def_readwrite("comm", &StageCosts::comm)
      .def_readwrite("all_reduce", &StageCosts::allReduce);

  py::class_<TimedAction>(m, "TimedAction")
      .def_readonly("rank", &TimedAction::rank)
      .def_readonly("step", &TimedAction::step)
      .def_readonly("action", &TimedAction::action)
      .def_readonly("start", &TimedAction::start)
      .def_readonly("end", &TimedAction::end);

  py::class_<SimulationResult>(m, "SimulationResult")
      .def_readonly("makespan", &SimulationResult::makespan)
      .def_readonly("bubble_fraction", &SimulationResult::bubbleFraction)
      .def_readonly("bubble_fraction_per_rank", &SimulationResult::bubbleFractionPerRank)
      .def_readonly("busy_time_per_rank", &SimulationResult::busyTimePerRank)
      .def_readonly("peak_activations", &SimulationResult::peakActivations)
      .def_readonly("peak_activations_per_rank", &SimulationResult::peakActivationsPerRank)
      .def_readonly("peak_deferred_weight_grads", &SimulationResult::peakDeferredWeightGrads)
      .def_readonly("peak_weight_versions", &SimulationResult::peakWeightVersions)
      .def_readonly("timeline", &SimulationResult::timeline);

  m.def("simulate", py::overload_cast<const Schedule&, const StageCosts&>(&simulate),
        py::arg("schedule"), py::arg("costs"),
        py::call_guard<py::gil_scoped_release>());
  m.def("to_chrome_trace", &toChromeTrace, py::arg("schedule"), py::arg("result"));
}

}  // namespace pipedream
