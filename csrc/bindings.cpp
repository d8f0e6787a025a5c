// The one pybind11 file: binds csrc/core (and later csrc/runtime) into
// pipedream_ext._C. Each subsystem has its own bind* function below.
#include <torch/extension.h>

#include <pybind11/stl.h>

#include "core/action.h"
#include "core/channels.h"
#include "core/generators.h"
#include "core/lower.h"
#include "core/schedule.h"
#include "core/simulate.h"
#include "core/stream.h"
#include "core/traits.h"
#include "core/validate.h"
#include "runtime/comm_engine.h"
#include "runtime/executor.h"
#include "runtime/nccl_rules_backend.h"
#include "runtime/split_backward.h"

namespace py = pybind11;

namespace pipedream {
namespace {

std::vector<std::string> actionStrings(const std::vector<Action>& actions) {
  std::vector<std::string> out;
  out.reserve(actions.size());
  for (const auto& a : actions) out.push_back(a.toString());
  return out;
}

void bindSchedules(py::module_& m) {
  py::enum_<ActionKind>(m, "ActionKind")
      .value("F", ActionKind::kForward)
      .value("B", ActionKind::kBackward)
      .value("I", ActionKind::kBackwardInput)
      .value("W", ActionKind::kBackwardWeight)
      .value("SEND_F", ActionKind::kSendForward)
      .value("RECV_F", ActionKind::kRecvForward)
      .value("SEND_B", ActionKind::kSendBackward)
      .value("RECV_B", ActionKind::kRecvBackward)
      .value("UPDATE", ActionKind::kUpdate)
      .value("ALLREDUCE", ActionKind::kAllReduce);

  py::class_<Action>(m, "Action")
      .def_readonly("stage", &Action::stage)
      .def_readonly("kind", &Action::kind)
      .def_readonly("microbatch", &Action::microbatch)
      .def_readonly("version", &Action::version)
      .def_static("parse", &Action::parse, py::arg("text"))
      .def("__str__", &Action::toString)
      .def("__repr__", [](const Action& a) { return "Action('" + a.toString() + "')"; })
      .def("__eq__", &Action::operator==);

  py::class_<Layout>(m, "Layout")
      .def_property_readonly("num_ranks", &Layout::numRanks)
      .def_property_readonly("num_stages", &Layout::numStages)
      .def("stage_ranks", &Layout::stageRanks, py::arg("stage"))
      .def("rank_for", &Layout::rankFor, py::arg("stage"), py::arg("microbatch"))
      .def("stages_of_rank", &Layout::stagesOfRank, py::arg("rank"))
      .def_property_readonly("replicas", &Layout::replicaCounts);

  py::class_<Schedule>(m, "Schedule")
      .def_property_readonly("name", &Schedule::name)
      .def_property_readonly("layout", &Schedule::layout)
      .def_property_readonly("num_ranks", &Schedule::numRanks)
      .def_property_readonly("num_stages", &Schedule::numStages)
      .def_property_readonly("microbatches", &Schedule::microbatches)
      .def_property_readonly("batches", &Schedule::batches)
      .def_property_readonly("is_lowered", &Schedule::isLowered)
      .def("actions", [](const Schedule& s, int rank) { return s.actions(rank); }, py::arg("rank"))
      .def("action_strings", [](const Schedule& s, int rank) { return actionStrings(s.actions(rank)); },
           py::arg("rank"))
      .def("to_text", &Schedule::toText)
      .def("to_csv", &Schedule::toCsv)
      .def("grid", [](const Schedule& s) { return s.grid(); })
      .def("with_actions_from_text", &Schedule::withActionsFromText, py::arg("text"))
      .def("with_actions_from_csv", &Schedule::withActionsFromCsv, py::arg("csv"));

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

  py::class_<AsyncStream>(m, "AsyncStream")
      .def(py::init([](const std::string& name, int stages, int microbatches, std::vector<int> replicas,
                       bool verticalSync) {
             ScheduleOptions o;
             o.name = name;
             o.stages = stages;
             o.microbatches = microbatches;
             o.replicas = std::move(replicas);
             o.verticalSync = verticalSync;
             return AsyncStream(o);
           }),
           py::arg("name"), py::arg("stages"), py::arg("microbatches") = 1,
           py::arg("replicas") = std::vector<int>{}, py::arg("vertical_sync") = false)
      .def("step_actions", &AsyncStream::stepActions, py::arg("rank"), py::arg("step"))
      .def("drain_actions", &AsyncStream::drainActions, py::arg("rank"), py::arg("steps"))
      .def_property_readonly("base", &AsyncStream::base)
      .def_property_readonly("period", &AsyncStream::period);

  py::class_<ScheduleTraits>(m, "ScheduleTraits",
                             "What a schedule means (csrc/core/traits.h); read-only.")
      .def_property_readonly("name", [](const ScheduleTraits& t) { return t.name; })
      .def_property_readonly("asynchronous", [](const ScheduleTraits& t) { return t.asynchronous; })
      .def_property_readonly("update_rule",
                             [](const ScheduleTraits& t) { return updateRuleName(t.updateRule); })
      .def_property_readonly(
          "replica_reduction",
          [](const ScheduleTraits& t) { return replicaReductionName(t.replicaReduction); })
      .def("microbatches_per_step", &ScheduleTraits::microbatchesPerStep, py::arg("m"))
      .def_property_readonly("multi_chunk", [](const ScheduleTraits& t) { return t.multiChunk; })
      .def_property_readonly("fixed_chunks", [](const ScheduleTraits& t) { return t.fixedChunks; })
      .def_property_readonly(
          "chunk_placement",
          [](const ScheduleTraits& t) { return chunkPlacementName(t.chunkPlacement); })
      .def_property_readonly("supports_replicas",
                             [](const ScheduleTraits& t) { return t.supportsReplicas; })
      .def_property_readonly("split_backward", [](const ScheduleTraits& t) { return t.splitBackward; })
      .def_property_readonly("stash_weights", [](const ScheduleTraits& t) { return t.stashWeights; })
      .def_property_readonly("streaming", [](const ScheduleTraits& t) { return t.streaming; })
      .def_property_readonly("supports_vertical_sync",
                             [](const ScheduleTraits& t) { return t.supportsVerticalSync; })
      .def_property_readonly("planner_straight",
                             [](const ScheduleTraits& t) { return t.plannerStraight; })
      .def_property_readonly("planner_two_versions",
                             [](const ScheduleTraits& t) { return t.plannerTwoVersions; })
      .def("__repr__", [](const ScheduleTraits& t) {
        auto flag = [](bool b) { return b ? "True" : "False"; };
        return "ScheduleTraits(name='" + t.name + "', asynchronous=" + flag(t.asynchronous) +
               ", update_rule='" + updateRuleName(t.updateRule) + "', replica_reduction='" +
               replicaReductionName(t.replicaReduction) + "', multi_chunk=" + flag(t.multiChunk) +
               ", fixed_chunks=" + std::to_string(t.fixedChunks) + ", chunk_placement='" +
               chunkPlacementName(t.chunkPlacement) + "', supports_replicas=" + flag(t.supportsReplicas) + ", split_backward=" +
               flag(t.splitBackward) + ", stash_weights=" + flag(t.stashWeights) +
               ", streaming=" + flag(t.streaming) + ", supports_vertical_sync=" +
               flag(t.supportsVerticalSync) + ", planner_straight=" + flag(t.plannerStraight) +
               ", planner_two_versions=" + flag(t.plannerTwoVersions) + ")";
      });
  // Copies: Python never holds a pointer into the static table.
  m.def("schedule_traits", [](const std::string& name) { return scheduleTraits(name); },
        py::arg("name"), "The traits of schedule `name`; ValueError naming the choices if unknown.");
  m.def("all_schedule_traits", &allScheduleTraits, "Every schedule's traits, in schedule_names() order.");
  m.def("schedule_names", &scheduleNames);
  m.def(
      "build_schedule",
      [](const std::string& name, int stages, int microbatches, int chunks,
         std::vector<int> replicas, int batches, bool verticalSync) {
        ScheduleOptions options;
        options.name = name;
        options.stages = stages;
        options.microbatches = microbatches;
        options.chunks = chunks;
        options.replicas = std::move(replicas);
        options.batches = batches;
        options.verticalSync = verticalSync;
        return buildSchedule(options);
      },
      py::arg("name"), py::arg("stages"), py::arg("microbatches"), py::arg("chunks") = 1,
      py::arg("replicas") = std::vector<int>{}, py::arg("batches") = 1,
      py::arg("vertical_sync") = false,
      "Builds the compute-only schedule (F/B/I/W, UPDATE, ALLREDUCE).");
  m.def("lower", &lower, py::arg("schedule"), "Inserts SEND/RECV actions.");
  m.def("strip_communication", &stripCommunication, py::arg("schedule"));
  m.def("order_transfers", &orderTransfers, py::arg("lowered"), py::arg("microbatches_per_step") = 0,
        "Moves RECVs to where they are issued so both ends of every pair of ranks issue the pair's "
        "transfers in one mirrored order (csrc/core/channels.h).");
  m.def("validate_channels", &validateChannels, py::arg("ordered"), py::arg("forward_only") = false,
        "Raises ValueError unless every pair's sequences mirror each other and the schedule cannot "
        "deadlock under NCCL's rules.");
  m.def("channels_to_text", &channelsToText, py::arg("ordered"),
        "One line per rank and peer: the operations it issues with that peer, in order.");
  m.def("validate", &validate, py::arg("schedule"),
        "Raises ValueError with a marked rank-by-step grid if the schedule is invalid.");
  m.def("simulate", &simulate, py::arg("schedule"), py::arg("costs"),
        py::call_guard<py::gil_scoped_release>());
  m.def("to_chrome_trace", &toChromeTrace, py::arg("schedule"), py::arg("result"));
}

// ---- planner (csrc/core/profile_graph.h, csrc/core/planner.h) -------------
}  // namespace
}  // namespace pipedream
#include "core/planner.h"
#include "core/profile_graph.h"
#include "core/topology.h"
namespace pipedream {
namespace {

py::dict planToDict(const ProfileGraph& g, const Plan& p) {
  py::list stages;
  for (const PlanStage& st : p.stages) {
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
    if (p.chain) {
      d["layers"] = py::make_tuple(st.layerStart, st.layerEnd);
    } else {
      d["layers"] = py::none();
    }
    stages.append(d);
  }
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

void bindPlanner(py::module_& m) {
  py::class_<ProfileGraph>(m, "ProfileGraph",
                           "A layer profile graph in PipeDream's graph.txt format.")
      .def(py::init<>())
      .def_static("parse", &ProfileGraph::parse, py::arg("text"), py::arg("source") = "<string>")
      .def_static("load", &ProfileGraph::load, py::arg("path"))
      .def("to_string", &ProfileGraph::toString)
      .def("save", &ProfileGraph::save, py::arg("path"))
      .def(
          "add_node",
          [](ProfileGraph& g, const std::string& id, const std::string& description,
             double forwardMs, double backwardMs, double activationBytes, double parameterBytes) {
            GraphNode n;
            n.id = id;
            n.description = description;
            n.forwardMs = forwardMs;
            n.backwardMs = backwardMs;
            n.activationBytes = activationBytes;
            n.parameterBytes = parameterBytes;
            return g.addNode(n);
          },
          py::arg("id"), py::arg("description"), py::arg("forward_ms"), py::arg("backward_ms"),
          py::arg("activation_bytes"), py::arg("parameter_bytes"))
      .def("add_edge",
           py::overload_cast<const std::string&, const std::string&>(&ProfileGraph::addEdge),
           py::arg("src"), py::arg("dst"))
      .def("__len__", &ProfileGraph::numNodes)
      .def("is_chain", [](const ProfileGraph& g) { return g.isChain(); })
      .def("nodes",
           [](const ProfileGraph& g) {
             py::list out;
             for (const GraphNode& n : g.nodes()) {
               py::dict d;
               d["id"] = n.id;
               d["description"] = n.description;
               d["forward_ms"] = n.forwardMs;
               d["backward_ms"] = n.backwardMs;
               d["activation_bytes"] = n.activationBytes;
               d["parameter_bytes"] = n.parameterBytes;
               out.append(d);
             }
             return out;
           })
      .def("edges", [](const ProfileGraph& g) {
        std::vector<std::pair<std::string, std::string>> out;
        for (const auto& e : g.edges()) out.emplace_back(g.node(e.first).id, g.node(e.second).id);
        return out;
      });

  m.def(
      "plan_graph",
      [](const ProfileGraph& g, const std::vector<int>& workers,
         const std::vector<double>& bandwidth, double memory, bool straight, bool fewerWorkers,
         const std::string& costModel, double compression, bool twoBw, int maxAntichainStates,
         double workBudget) {
        if (workers.size() != bandwidth.size()) {
          throw std::invalid_argument("got " + std::to_string(workers.size()) +
                                      " worker counts but " + std::to_string(bandwidth.size()) +
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
        Plan p;
        {
          py::gil_scoped_release release;
          p = planPartition(g, t, o);
        }
        return planToDict(g, p);
      },
      py::arg("graph"), py::arg("workers"), py::arg("bandwidth"), py::arg("memory") = 0.0,
      py::arg("straight") = false, py::arg("fewer_workers") = false,
      py::arg("cost_model") = "default", py::arg("compression") = 0.0,
      py::arg("two_bw") = false, py::arg("max_antichain_states") = 4096,
      py::arg("work_budget") = 1.5e8,
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

// ---- runtime (csrc/runtime) --------------------------------------------------
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

void bindRuntime(py::module_& m) {
  py::class_<RuntimeStats>(m, "RuntimeStats",
                           "What one rank's runtime did (csrc/core/runtime_stats.h); a read-only "
                           "snapshot. RuntimeStats() is empty.")
      .def(py::init<>())
      .def_property_readonly("compute_s", [](const RuntimeStats& s) { return s.computeSeconds; },
                             "Seconds in F/B/I/W (and recomputation) and U callbacks.")
      .def_property_readonly("wait_s", [](const RuntimeStats& s) { return s.waitSeconds; },
                             "Seconds blocked on peers: receives, sends, all-reduces.")
      .def_property_readonly("busy_s", [](const RuntimeStats& s) { return s.busySeconds; },
                             "Wall seconds inside the executor's run calls.")
      .def_property_readonly("actions", [](const RuntimeStats& s) { return s.actions; })
      .def_property_readonly("steps", [](const RuntimeStats& s) { return s.steps; })
      .def_property_readonly("seconds_by_kind", [](const RuntimeStats& s) { return s.secondsByKind; },
                             "Seconds per action kind ('F', 'B', 'RECV_F' waits, 'SEND_WAIT', ...).")
      .def_property_readonly("bytes_sent", [](const RuntimeStats& s) { return s.bytesSent; })
      .def_property_readonly("bytes_received", [](const RuntimeStats& s) { return s.bytesReceived; })
      .def_property_readonly("sends", [](const RuntimeStats& s) { return s.sends; })
      .def_property_readonly("receives", [](const RuntimeStats& s) { return s.receives; })
      .def_property_readonly("messages_sent", [](const RuntimeStats& s) { return s.messagesSent; },
                             "Messages on the wire, data and side channel.")
      .def_property_readonly("preposted_receives", [](const RuntimeStats& s) { return s.prePostedReceives; },
                             "Receives whose data was posted before their consumer waited.")
      .def_property_readonly("redirected_sends", [](const RuntimeStats& s) { return s.redirectedSends; },
                             "Sends larger than their slot's capacity (payload on the side channel).")
      .def_property_readonly("padding_bytes", [](const RuntimeStats& s) { return s.paddingBytes; })
      .def_property_readonly("host_syncs", [](const RuntimeStats& s) { return s.hostSyncs; },
                             "Device-to-host copies the communication made (Gloo carrying CUDA tensors).")
      .def_property_readonly("peak_activations", [](const RuntimeStats& s) { return s.peakActivations; })
      .def_property_readonly("peak_sends_in_flight", [](const RuntimeStats& s) { return s.peakSendsInFlight; })
      .def_property_readonly("peak_weight_versions", [](const RuntimeStats& s) { return s.peakWeightVersions; },
                             "Per local stage (asynchronous schedules); empty otherwise.")
      .def_property_readonly("weight_bytes_copied", [](const RuntimeStats& s) { return s.weightBytesCopied; })
      .def_property_readonly("bubble_fraction", &RuntimeStats::bubbleFraction,
                             "1 - compute_s / busy_s; 0 when busy_s is 0.")
      .def("merge", &RuntimeStats::merge, py::arg("other"),
           "A new RuntimeStats: sums; peaks and per-stage versions take the maximum; "
           "seconds_by_kind adds per kind.")
      .def("as_dict", &statsToDict, "A dict with exactly the property names as keys.")
      .def("__repr__", [](const RuntimeStats& s) {
        return "RuntimeStats(steps=" + std::to_string(s.steps) + ", actions=" +
               std::to_string(s.actions) + ", busy_s=" + std::to_string(s.busySeconds) +
               ", bytes_sent=" + std::to_string(s.bytesSent) + ")";
      });

  py::class_<SplitBackward>(m, "SplitBackward",
                            "A backward split into I (input gradients) and W (weight gradients)\n"
                            "that does no work twice (csrc/runtime/split_backward.h); the executor's\n"
                            "I and W actions, bound for single-process tests.")
      .def(py::init<>())
      .def(
          "input_pass",
          [](SplitBackward& self, const std::vector<at::Tensor>& roots,
             std::vector<std::optional<at::Tensor>> grads, const std::vector<at::Tensor>& inputs,
             const std::vector<at::Tensor>& weights) {
            TORCH_CHECK(grads.size() == roots.size(), "input_pass: ", grads.size(),
                        " gradients for ", roots.size(), " roots");
            std::vector<at::Tensor> g;
            for (auto& t : grads) g.push_back(t.has_value() ? *t : at::Tensor());
            py::gil_scoped_release noGil;
            return SplitBackward::inputPass(roots, g, inputs, weights, self);
          },
          py::arg("roots"), py::arg("grads"), py::arg("inputs"), py::arg("weights"),
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

  py::class_<NcclRulesBackend, c10d::Backend, c10::intrusive_ptr<NcclRulesBackend>>(
      m, "NcclRulesBackend",
      "A CPU backend with NCCL's point-to-point rules (csrc/runtime/nccl_rules_backend.h); made\n"
      "by pipedream_ext.testing.register_nccl_rules_backend().")
      .def(py::init([](const c10::intrusive_ptr<c10d::Backend>& gloo, int rank, int size,
                       double timeoutSeconds) {
             return c10::make_intrusive<NcclRulesBackend>(
                 gloo, rank, size,
                 std::chrono::milliseconds(static_cast<int64_t>(timeoutSeconds * 1000.0)));
           }),
           py::arg("gloo"), py::arg("rank"), py::arg("size"), py::arg("timeout_seconds"),
           py::call_guard<py::gil_scoped_release>());

  py::class_<PipelineExecutor, std::unique_ptr<PipelineExecutor, ExecutorDeleter>>(m,
                                                                          "PipelineExecutor")
      .def(py::init([](const Schedule& lowered, int rank,
                       const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                       const c10::intrusive_ptr<c10d::ProcessGroup>& side, double timeoutSeconds,
                       py::function forward, std::map<int, std::vector<at::Tensor>> parameters,
                       const std::string& device, py::object update,
                       std::map<int, c10::intrusive_ptr<c10d::ProcessGroup>> replicaGroups,
                       bool recompute, const std::string& protocol) {
             auto engine = std::make_shared<CommEngine>(
                 group, side, std::chrono::milliseconds(static_cast<int64_t>(timeoutSeconds * 1000.0)),
                 at::Device(device), parseProtocol(protocol));
             // The only calls into Python: re-acquire the GIL around them.
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
             return std::unique_ptr<PipelineExecutor, ExecutorDeleter>(new PipelineExecutor(
                 lowered, rank, std::move(engine), std::move(fn), std::move(parameters),
                 std::move(updateFn), std::move(replicaGroups), recompute));
           }),
           py::arg("lowered_schedule"), py::arg("rank"), py::arg("group"), py::arg("side_group"),
           py::arg("timeout_seconds"), py::arg("forward"), py::arg("stage_parameters"),
           py::arg("device") = "cpu", py::arg("update") = py::none(),
           py::arg("replica_groups") = std::map<int, c10::intrusive_ptr<c10d::ProcessGroup>>{},
           py::arg("recompute") = false, py::arg("protocol") = "fused",
           "Executes `lowered_schedule` (in transfer order: order_transfers) for `rank`; stashing, "
           "streaming and replica reduction follow the schedule's traits (schedule_traits(name)). "
           "`side_group`: a Gloo group over the same ranks (csrc/runtime/comm_engine.h); "
           "`protocol`: 'fused' or 'split'. `update(stage, version)` steps the optimizer and is "
           "required when the traits stash weights.")
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
      .def_property("tracing", &PipelineExecutor::tracing, &PipelineExecutor::setTracing)
      .def(
          "take_trace",
          [](PipelineExecutor& e) {
            py::list out;
            for (const auto& t : e.takeTrace()) {
              out.append(py::make_tuple(t.name, t.category, t.startUs, t.durationUs));
            }
            return out;
          },
          "The spans recorded since the last call (then cleared), in execution order, as\n"
          "(name, category, start_us, duration_us) tuples: name is the action's text\n"
          "('1F3', '0RECV_B2') or 'wait for sends'; category is 'compute', 'wait', 'send',\n"
          "'update' or 'allreduce'; start_us is wall-clock microseconds since the Unix\n"
          "epoch; duration_us is microseconds.");
}

}  // namespace
}  // namespace pipedream

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pipedream_ext C++ core: schedules, simulator, planner, runtime";
  pipedream::bindSchedules(m);
  pipedream::bindPlanner(m);
  pipedream::bindRuntime(m);
}
