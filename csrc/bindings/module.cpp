// The one module pipedream_ext._C; each area binds itself (bindings.h).
#include <torch/extension.h>

#include "bindings/bindings.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pipedream_ext C++ core: schedules, simulator, planner, runtime";
  pipedream::bindSchedules(m);
  pipedream::bindSimulator(m);
  pipedream::bindPlanner(m);
  pipedream::bindConfigure(m);
  pipedream::bindRuntime(m);
}
