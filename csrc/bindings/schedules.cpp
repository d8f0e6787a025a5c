// Schedules (csrc/core): actions, layouts, schedules and their traits, the
// asynchronous action feed, and building, lowering, ordering and validating.
#include <torch/extension.h>

#include "bindings/bindings.h"
#include "core/action.h"
#include "core/action_feed.h"
#include "core/channels.h"
#include "core/generators.h"
#include "core/lower.h"
#include "core/pairs.h"
#include "core/schedule.h"
#include "core/traits.h"
#include "core/validate.h"

namespace py = pybind11;

namespace pipedream {
namespace {

// The dict form of an action (stage, kind, microbatch, version) that Python
// used before Action was typed; reading it warns and names the attribute.
py::object deprecatedField(const Action& a, const std::string& key) {
  const std::string message = "action[\"" + key + "\"] is deprecated: use action." + key +
                              (key == "kind" ? " (an ActionKind; action.kind.name is the old string)" : "");
  if (key != "stage" && key != "kind" && key != "microbatch" && key != "version") {
    throw py::key_error("Action has no field '" + key +
                        "'; its attributes are stage, kind, microbatch and version");
  }
  if (PyErr_WarnEx(PyExc_DeprecationWarning, message.c_str(), 1) != 0) throw py::error_already_set();
  if (key == "stage") return py::int_(a.stage);
  if (key == "kind") return py::cast(a.kind).attr("name");
  return py::int_(key == "microbatch" ? a.microbatch : a.version);
}

// Comparing with the text form ("1F0") keeps code written when actions() returned
// strings working; the hash is the text's, so sets and dicts agree with it.
bool equalsText(const Action& a, const std::string& text) {
  const std::string message = "comparing an Action with a str is deprecated: compare with "
                              "Action.parse('" + text + "'), or compare str(action)";
  if (PyErr_WarnEx(PyExc_DeprecationWarning, message.c_str(), 1) != 0) throw py::error_already_set();
  return a.toString() == text;
}

// What __eq__ answers for another type, so that Python falls back to identity.
py::object notImplemented() { return py::reinterpret_borrow<py::object>(Py_NotImplemented); }

void bindActionKind(py::module_& m) {
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
}

void bindTransferKey(py::module_& m) {
  py::class_<TransferKey>(m, "TransferKey",
                          "The transfer a SEND_*/RECV_* action is one end of; both ends have the same "
                          "key (csrc/core/channels.h). repr: 'F0:3' (forward, boundary 0, microbatch 3).")
      .def_readonly("forward", &TransferKey::forward)
      .def_readonly("boundary", &TransferKey::boundary, "Stage j -> j+1 is boundary j.")
      .def_readonly("microbatch", &TransferKey::microbatch)
      .def("__repr__", &TransferKey::toString)
      .def("__eq__", &TransferKey::operator==)
      .def("__eq__", [](const TransferKey&, const py::object&) { return notImplemented(); })
      .def("__hash__", [](const TransferKey& k) { return hashInts(k.forward, k.boundary, k.microbatch); });
}

void bindAction(py::module_& m) {
  py::class_<Action>(m, "Action",
                     "One action of a rank's list (csrc/core/action.h); str and repr are its compact "
                     "text ('1F0', '1B3v2', '0SEND_F1', '0U1'), Action.parse reads it back.")
      .def_readonly("stage", &Action::stage)
      .def_readonly("kind", &Action::kind)
      .def_readonly("microbatch", &Action::microbatch, "-1 for UPDATE and ALLREDUCE.")
      .def_readonly("version", &Action::version,
                    "F/B/I/W: the weight version read; UPDATE/ALLREDUCE: the version created.")
      .def_property_readonly("is_compute", [](const Action& a) { return isCompute(a.kind); }, "F, B, I, W.")
      .def_property_readonly("is_backward_like", [](const Action& a) { return isBackwardLike(a.kind); },
                             "B, I, W.")
      .def_property_readonly("is_comm", [](const Action& a) { return isComm(a.kind); }, "SEND_*, RECV_*.")
      .def_property_readonly("transfer", &TransferKey::of,
                             "The TransferKey of a SEND_*/RECV_* action; ValueError for other kinds.")
      .def_static("parse", &Action::parse, py::arg("text"),
                  "The action of a compact text such as '1B3v2'; ValueError naming the text.")
      .def("__str__", &Action::toString)
      .def("__repr__", &Action::toString)
      .def("__eq__", &Action::operator==)
      .def("__eq__", &equalsText)
      .def("__eq__", [](const Action&, const py::object&) { return notImplemented(); })
      .def("__hash__", [](const Action& a) { return py::hash(py::str(a.toString())); })
      .def("__getitem__", &deprecatedField, py::arg("key"))
      .def(py::pickle([](const Action& a) { return a.toString(); },
                      [](const std::string& text) { return Action::parse(text); }));
}

void bindActions(py::module_& m) {
  bindActionKind(m);
  bindTransferKey(m);
  bindAction(m);
}

void bindScheduleClasses(py::module_& m) {
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
      .def("to_text", &Schedule::toText)
      .def("to_csv", &Schedule::toCsv)
      .def("grid", [](const Schedule& s) { return s.grid(); })
      .def("with_actions_from_text", &Schedule::withActionsFromText, py::arg("text"))
      .def("with_actions_from_csv", &Schedule::withActionsFromCsv, py::arg("csv"));
}

void bindAsyncActionFeed(py::module_& m) {
  py::class_<AsyncActionFeed>(m, "AsyncActionFeed")
      .def(py::init([](const std::string& name, int stages, int microbatches, std::vector<int> replicas,
                       bool verticalSync) {
             ScheduleOptions o;
             o.name = name;
             o.stages = stages;
             o.microbatches = microbatches;
             o.replicas = std::move(replicas);
             o.verticalSync = verticalSync;
             return AsyncActionFeed(o);
           }),
           py::arg("name"), py::arg("stages"), py::arg("microbatches") = 1,
           py::arg("replicas") = std::vector<int>{}, py::arg("vertical_sync") = false)
      .def("step_actions", &AsyncActionFeed::stepActions, py::arg("rank"), py::arg("step"))
      .def("drain_actions", &AsyncActionFeed::drainActions, py::arg("rank"), py::arg("steps"))
      .def_property_readonly("base", &AsyncActionFeed::base)
      .def_property_readonly("period", &AsyncActionFeed::period);
}

std::string traitsRepr(const ScheduleTraits& t) {
  auto flag = [](bool b) { return b ? "True" : "False"; };
  return "ScheduleTraits(name='" + t.name + "', asynchronous=" + flag(t.asynchronous) +
         ", update_rule='" + updateRuleName(t.updateRule) + "', replica_reduction='" +
         replicaReductionName(t.replicaReduction) + "', multi_chunk=" + flag(t.multiChunk) +
         ", fixed_chunks=" + std::to_string(t.fixedChunks) + ", chunk_placement='" +
         chunkPlacementName(t.chunkPlacement) + "', supports_replicas=" + flag(t.supportsReplicas) +
         ", split_backward=" + flag(t.splitBackward) + ", stash_weights=" + flag(t.stashWeights) +
         ", streaming=" + flag(t.streaming) + ", supports_vertical_sync=" +
         flag(t.supportsVerticalSync) + ", planner_straight=" + flag(t.plannerStraight) +
         ", planner_two_versions=" + flag(t.plannerTwoVersions) + ")";
}

void bindScheduleTraits(py::module_& m) {
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
      .def("__repr__", &traitsRepr);
  // Copies: Python never holds a pointer into the static table.
  m.def("schedule_traits", [](const std::string& name) { return scheduleTraits(name); },
        py::arg("name"), "The traits of schedule `name`; ValueError naming the choices if unknown.");
  m.def("all_schedule_traits", &allScheduleTraits, "Every schedule's traits, in schedule_names() order.");
  m.def("schedule_names", &scheduleNames);
}

Schedule buildScheduleFromArgs(const std::string& name, int stages, int microbatches, int chunks,
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
}

void bindScheduleFunctions(py::module_& m) {
  m.def("build_schedule", &buildScheduleFromArgs, py::arg("name"), py::arg("stages"),
        py::arg("microbatches"), py::arg("chunks") = 1, py::arg("replicas") = std::vector<int>{},
        py::arg("batches") = 1, py::arg("vertical_sync") = false,
        "Builds the compute-only schedule (F/B/I/W, UPDATE, ALLREDUCE).");
  m.def("lower", &lower, py::arg("schedule"), "Inserts SEND/RECV actions.");
  m.def("strip_communication", &stripCommunication, py::arg("schedule"));
  m.def("order_transfers", &orderTransfers, py::arg("lowered"), py::arg("microbatches_per_step") = 0,
        "Moves RECVs to where they are issued so both ends of every pair of ranks issue the pair's "
        "transfers in one mirrored order (csrc/core/channels.h).");
  m.def("pair_forward_backward", &pairForwardBackward, py::arg("ordered"),
        "The ordered schedule with every F followed only by transfers and then a B of another "
        "stage made adjacent (an F&B pair: its transfers after the B, the B's receive before the "
        "F), checked by validate_channels (csrc/core/pairs.h).");
  m.def("pair_starts",
        [](const Schedule& s, int rank) { return pairStarts(s.actions(rank)); }, py::arg("ordered"),
        py::arg("rank"), "Positions of the F of every F&B pair in `rank`'s list.");
  m.def("validate_channels", py::overload_cast<const Schedule&, bool>(&validateChannels),
        py::arg("ordered"), py::arg("forward_only") = false,
        "Raises ValueError unless every pair's sequences mirror each other and the schedule cannot "
        "deadlock under NCCL's rules.");
  m.def("channels_to_text", &channelsToText, py::arg("ordered"),
        "One line per rank and peer: the operations it issues with that peer, in order.");
  m.def("validate", &validate, py::arg("schedule"),
        "Raises ValueError with a marked rank-by-step grid if the schedule is invalid.");
}

}  // namespace

void bindSchedules(py::module_& m) {
  bindActions(m);
  bindScheduleClasses(m);
  bindAsyncActionFeed(m);
  bindScheduleTraits(m);
  bindScheduleFunctions(m);
}

}  // namespace pipedream
