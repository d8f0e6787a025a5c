// The pybind11 bindings of pipedream_ext._C, one function per area; module.cpp
// holds the PYBIND11_MODULE that calls them in this order (a type is bound
// before the functions whose signatures name it).
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

namespace pipedream {

// Actions, layouts, schedules, their traits, building, lowering, transfer
// order, validation and the asynchronous action feed (csrc/core).
void bindSchedules(pybind11::module_& m);
// Stage costs, the simulator and its Chrome trace (csrc/core/simulate.h).
void bindSimulator(pybind11::module_& m);
// Profile graphs and the partition planner (csrc/core/profile_graph.h, planner.h).
void bindPlanner(pybind11::module_& m);
// The whole-configuration search and its cost model, over dicts (csrc/core/configure.h).
void bindConfigure(pybind11::module_& m);
// Runtime statistics, the split backward, the NCCL-rules test backend and the
// pipeline executor (csrc/runtime).
void bindRuntime(pybind11::module_& m);

}  // namespace pipedream
