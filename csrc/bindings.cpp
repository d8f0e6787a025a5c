// The one pybind11 file: binds csrc/core (and later csrc/runtime) into
// pipedream_ext._C. Each subsystem has its own bind* function below.
#include <torch/extension.h>

#include "core/action.h"
#include "core/schedule.h"

namespace py = pybind11;

namespace pipedream {
namespace {

void bindSchedules(py::module_& m) {
  (void)m;  // filled in by the schedule engine
}

// ---- planner (csrc/core/graph.h, csrc/core/planner.h) ----------------------
void bindPlanner(py::module_& m) {
  (void)m;  // filled in by the planner
}

}  // namespace
}  // namespace pipedream

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pipedream_ext C++ core: schedules, simulator, planner, runtime";
  pipedream::bindSchedules(m);
  pipedream::bindPlanner(m);
}
