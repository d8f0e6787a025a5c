// The runtime (csrc/runtime): its statistics, the split backward, the
// NCCL-rules test backend and the pipeline executor.
#include <torch/extension.h>

#include <chrono>
#include <map>
#include <memory>
#include <optional>

#include "bindings/bindings.h"
#include "core/runtime_stats.h"
#include "runtime/overlap.h"
#include "runtime/comm_engine.h"
#include "runtime/executor.h"
#include "runtime/nccl_rules_backend.h"
#include "runtime/split_backward.h"

namespace py = pybind11;

namespace pipedream {
namespace {

using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;

// Deletes an executor from Python (the GIL held): its process group handles go
// first with the GIL released (see PipelineExecutor::releaseCommunication), the
// rest, which holds Python callbacks, with it.
struct ExecutorDeleter {
  void operator()(PipelineExecutor* executor) const {
    {
      py::gil_scoped_release noGil;
      executor->releaseCommunication();
    }
    delete executor;
  }
};

using ExecutorPtr = std::unique_ptr<PipelineExecutor, ExecutorDeleter>;

std::chrono::milliseconds toMilliseconds(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

// RuntimeStats.as_dict(): every read-only property of the class, by its name, so
// the schema is spelled once (the properties below).
py::dict statsToDict(const py::object& self) {
  py::dict d;
  const py::object property = py::module_::import("builtins").attr("property");
  for (auto item : py::type::of(self).attr("__dict__").cast<py::dict>()) {
    if (py::isinstance(item.second, property)) d[item.first] = self.attr(item.first);
  }
  return d;
}

std::string statsRepr(const RuntimeStats& s) {
  return "RuntimeStats(steps=" + std::to_string(s.steps) + ", actions=" + std::to_string(s.actions) +
         ", busy_s=" + std::to_string(s.busySeconds) + ", bytes_sent=" + std::to_string(s.bytesSent) +
         ")";
}

void bindRuntimeStats(py::module_& m) {
  using S = RuntimeStats;
  py::class_<RuntimeStats>(m, "RuntimeStats",
                           "What one rank's runtime did (csrc/core/runtime_stats.h); a read-only "
                           "snapshot. RuntimeStats() is empty.")
      .def(py::init<>())
      .def_property_readonly("compute_s", [](const S& s) { return s.computeSeconds; },
                             "Seconds in F/B/I/W (and recomputation) and U callbacks.")
      .def_property_readonly("wait_s", [](const S& s) { return s.waitSeconds; },
                             "Seconds blocked on peers: receives, sends, all-reduces.")
      .def_property_readonly("busy_s", [](const S& s) { return s.busySeconds; },
                             "Wall seconds inside the executor's run calls.")
      .def_property_readonly("actions", [](const S& s) { return s.actions; })
      .def_property_readonly("steps", [](const S& s) { return s.steps; })
      .def_property_readonly("seconds_by_kind", [](const S& s) { return s.secondsByKind; },
                             "Seconds per action kind ('F', 'B', 'RECV_F' waits, 'SEND_WAIT', ...).")
      .def_property_readonly("bytes_sent", [](const S& s) { return s.bytesSent; })
      .def_property_readonly("bytes_received", [](const S& s) { return s.bytesReceived; })
      .def_property_readonly("sends", [](const S& s) { return s.sends; })
      .def_property_readonly("receives", [](const S& s) { return s.receives; })
      .def_property_readonly("messages_sent", [](const S& s) { return s.messagesSent; },
                             "Messages on the wire, data and side channel.")
      .def_property_readonly("preposted_receives", [](const S& s) { return s.prePostedReceives; },
                             "Receives whose data was posted before their consumer waited.")
      .def_property_readonly("redirected_sends", [](const S& s) { return s.redirectedSends; },
                             "Sends larger than their slot's capacity (payload on the side channel).")
      .def_property_readonly("padding_bytes", [](const S& s) { return s.paddingBytes; })
      .def_property_readonly("host_syncs", [](const S& s) { return s.hostSyncs; },
                             "Device-to-host copies the communication made (Gloo carrying CUDA tensors).")
      .def_property_readonly("peak_activations", [](const S& s) { return s.peakActivations; })
      .def_property_readonly("peak_sends_in_flight", [](const S& s) { return s.peakSendsInFlight; })
      .def_property_readonly("peak_weight_versions", [](const S& s) { return s.peakWeightVersions; },
                             "Per local stage (asynchronous schedules); empty otherwise.")
      .def_property_readonly("weight_bytes_copied", [](const S& s) { return s.weightBytesCopied; })
      .def_property_readonly("overlap_yields", [](const S& s) { return s.overlapYields; },
                             "Turns the halves of overlapped F&B pairs passed each other.")
      .def_property_readonly("bubble_fraction", &RuntimeStats::bubbleFraction,
                             "1 - compute_s / busy_s; 0 when busy_s is 0.")
      .def("merge", &RuntimeStats::merge, py::arg("other"),
           "A new RuntimeStats: sums; peaks and per-stage versions take the maximum; "
           "seconds_by_kind adds per kind.")
      .def("with_wait", &RuntimeStats::withWait, py::arg("kind"), py::arg("seconds"),
           "A new RuntimeStats with seconds waited outside the executor: they add to "
           "seconds_by_kind[kind], wait_s and busy_s.")
      .def("as_dict", &statsToDict, "A dict with exactly the property names as keys.")
      .def("__repr__", &statsRepr);
}

std::vector<at::Tensor> inputPass(SplitBackward& self, const std::vector<at::Tensor>& roots,
                                  std::vector<std::optional<at::Tensor>> grads,
                                  const std::vector<at::Tensor>& inputs,
                                  const std::vector<at::Tensor>& weights) {
  TORCH_CHECK(grads.size() == roots.size(), "input_pass: ", grads.size(), " gradients for ",
              roots.size(), " roots");
  std::vector<at::Tensor> g;
  for (auto& t : grads) g.push_back(t.has_value() ? *t : at::Tensor());
  py::gil_scoped_release noGil;
  return SplitBackward::inputPass(roots, g, inputs, weights, self);
}

void bindSplitBackward(py::module_& m) {
  py::class_<SplitBackward>(m, "SplitBackward",
                            "A backward split into I (input gradients) and W (weight gradients)\n"
                            "that does no work twice (csrc/runtime/split_backward.h); the executor's\n"
                            "I and W actions, bound for single-process tests.")
      .def(py::init<>())
      .def("input_pass", &inputPass, py::arg("roots"), py::arg("grads"), py::arg("inputs"),
           py::arg("weights"),
           "I: gradients of `inputs` (None where none); grads[k] is roots[k]'s (None: ones).")
      .def(
          "weight_pass",
          [](SplitBackward& self) {
            py::gil_scoped_release noGil;
            self.weightPass();
          },
          "W: accumulates the weights' gradients into .grad.")
      .def_property_readonly("num_frontier_nodes", &SplitBackward::numFrontierNodes,
                             "Nodes where weight branches leave the input path (W starts there).");
}

void bindNcclRulesBackend(py::module_& m) {
  py::class_<NcclRulesBackend, c10d::Backend, c10::intrusive_ptr<NcclRulesBackend>>(
      m, "NcclRulesBackend",
      "A CPU backend with NCCL's point-to-point rules (csrc/runtime/nccl_rules_backend.h); made\n"
      "by pipedream_ext.testing.register_nccl_rules_backend().")
      .def(py::init([](const c10::intrusive_ptr<c10d::Backend>& gloo, int rank, int size,
                       double timeoutSeconds) {
             return c10::make_intrusive<NcclRulesBackend>(gloo, rank, size,
                                                          toMilliseconds(timeoutSeconds));
           }),
           py::arg("gloo"), py::arg("rank"), py::arg("size"), py::arg("timeout_seconds"),
           py::call_guard<py::gil_scoped_release>());
}

// PipelineExecutor(...) from Python: the callbacks re-acquire the GIL, the
// only calls into Python.
ExecutorPtr makeExecutor(const Schedule& lowered, int rank, const ProcessGroupPtr& group,
                         const ProcessGroupPtr& side, double timeoutSeconds, py::function forward,
                         std::map<int, std::vector<at::Tensor>> parameters, const std::string& device,
                         py::object update, std::map<int, ProcessGroupPtr> replicaGroups,
                         bool recompute, const std::string& protocol, bool overlap,
                         py::object pair) {
  auto engine = std::make_shared<CommEngine>(group, side, toMilliseconds(timeoutSeconds),
                                             at::Device(device), parseProtocol(protocol));
  auto fn = [forward](int stage, int microbatch, const std::vector<at::Tensor>& inputs,
                      const std::vector<at::Tensor>& weights) {
    py::gil_scoped_acquire gil;
    return forward(stage, microbatch, inputs, weights).cast<std::vector<at::Tensor>>();
  };
  PipelineExecutor::UpdateFn updateFn;
  if (!update.is_none()) {
    updateFn = [update](int stage, int version) {
      py::gil_scoped_acquire gil;
      update(stage, version);
    };
  }
  PipelineExecutor::PairFn pairFn;
  if (!pair.is_none()) {
    pairFn = [pair](int fStage, int fMicrobatch, const std::vector<at::Tensor>& inputs, int bStage,
                    int bMicrobatch, const std::vector<at::Tensor>& roots,
                    const std::vector<at::Tensor>& grads) {
      py::gil_scoped_acquire gil;
      return pair(fStage, fMicrobatch, inputs, bStage, bMicrobatch, roots, grads)
          .cast<std::vector<at::Tensor>>();
    };
  }
  return ExecutorPtr(new PipelineExecutor(lowered, rank, std::move(engine), std::move(fn),
                                          std::move(parameters), std::move(updateFn),
                                          std::move(replicaGroups), recompute, overlap,
                                          std::move(pairFn)));
}

// take_action_log(): the spans as (name, category, start_us, duration_us).
py::list takeActionLog(PipelineExecutor& e) {
  py::list out;
  for (const auto& t : e.takeActionLog()) {
    out.append(py::make_tuple(t.name, t.category, t.startUs, t.durationUs));
  }
  return out;
}

void bindPipelineExecutor(py::module_& m) {
  py::class_<PipelineExecutor, ExecutorPtr>(m, "PipelineExecutor")
      .def(py::init(&makeExecutor), py::arg("lowered_schedule"), py::arg("rank"), py::arg("group"),
           py::arg("side_group"), py::arg("timeout_seconds"), py::arg("forward"),
           py::arg("stage_parameters"), py::arg("device") = "cpu", py::arg("update") = py::none(),
           py::arg("replica_groups") = std::map<int, ProcessGroupPtr>{},
           py::arg("recompute") = false, py::arg("protocol") = "fused", py::arg("overlap") = false,
           py::arg("pair") = py::none(),
           "Executes `lowered_schedule` (in transfer order: order_transfers) for `rank`; stashing, "
           "streaming and replica reduction follow the schedule's traits (schedule_traits(name)). "
           "`side_group`: a Gloo group over the same ranks (csrc/runtime/comm_engine.h); "
           "`protocol`: 'fused' or 'split'. `update(stage, version)` steps the optimizer and is "
           "required when the traits stash weights. `overlap`: the list's F&B pairs "
           "(pair_forward_backward) run their halves together: by `pair(f_stage, f_microbatch, "
           "inputs, b_stage, b_microbatch, roots, grads) -> outputs` if given, else on two threads "
           "taking turns at overlap_yield().")
      .def("run", &PipelineExecutor::run, py::arg("inputs"), py::call_guard<py::gil_scoped_release>(),
           "Runs one step; returns the scaled loss of each microbatch whose last stage ran here.")
      .def("run_forward", &PipelineExecutor::runForward, py::arg("inputs"),
           py::call_guard<py::gil_scoped_release>())
      .def("run_until", &PipelineExecutor::runUntil, py::arg("end"), py::arg("inputs"),
           py::call_guard<py::gil_scoped_release>())
      .def("append_actions", &PipelineExecutor::appendActions, py::arg("actions"))
      .def("wait_sends", &PipelineExecutor::waitSends, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("position", &PipelineExecutor::position)
      .def_property_readonly("size", &PipelineExecutor::size)
      .def_property_readonly("protocol",
                             [](const PipelineExecutor& e) { return std::string(protocolName(e.protocol())); })
      .def("stats", &PipelineExecutor::stats,
           "A RuntimeStats snapshot since construction or reset_stats().")
      .def("reset_stats", &PipelineExecutor::resetStats,
           "Starts stats() over: times, counts, peaks, the engine's bytes and transfers, "
           "the weight stores' copies.")
      .def_property("action_logging", &PipelineExecutor::actionLogging,
                    &PipelineExecutor::setActionLogging,
                    "Whether every action (and wait) is recorded for take_action_log().")
      .def("take_action_log", &takeActionLog,
           "The spans recorded since the last call (then cleared), in execution order, as\n"
           "(name, category, start_us, duration_us) tuples: name is the action's text\n"
           "('1F3', '0RECV_B2') or 'wait for sends'; category is 'compute', 'wait', 'send',\n"
           "'update' or 'allreduce'; start_us is wall-clock microseconds since the Unix\n"
           "epoch; duration_us is microseconds.");
}

}  // namespace

void bindRuntime(py::module_& m) {
  m.def("overlap_yield",
        [](int direction) {
          TORCH_CHECK(direction == 0 || direction == 1, "overlap_yield: direction ", direction,
                      " must be 0 (forward) or 1 (backward)");
          return overlapYield(static_cast<OverlapTurn::Role>(direction));
        },
        py::arg("direction"), py::call_guard<py::gil_scoped_release>(),
        "Inside an overlapped F&B pair's forward (direction 0) or backward (1), right after "
        "issuing an asynchronous collective: lets the pair's other half run until it yields or "
        "ends (csrc/runtime/overlap.h). Returns whether it did; False at once elsewhere.");
  bindRuntimeStats(m);
  bindSplitBackward(m);
  bindNcclRulesBackend(m);
  bindPipelineExecutor(m);
}

}  // namespace pipedream
