#include "harness.h"

#include <exception>
#include <stdexcept>
#include <typeinfo>

#include "lower.h"
#include "planner.h"
#include "profile_graph.h"
#include "schedule.h"
#include "simulate.h"
#include "validate.h"

namespace pipedream {
namespace fuzz {
namespace {

// Runs `step`. Returns "" when it returned or threw a clear error (then sets
// *rejected); otherwise the finding.
template <class F>
std::string run(const char* step, F&& body, bool* rejected) {
  try {
    body();
    return "";
  } catch (const std::invalid_argument& e) {
    *rejected = true;
    if (std::string(e.what()).empty()) {
      return std::string(step) + ": std::invalid_argument with an empty message";
    }
    return "";
  } catch (const std::exception& e) {
    return std::string(step) + ": unexpected exception " + typeid(e).name() + ": " + e.what();
  } catch (...) {
    return std::string(step) + ": non-standard exception";
  }
}

// For a step that must accept its input (a round trip): any exception is a
// finding.
template <class F>
std::string mustAccept(const char* step, F&& body) {
  try {
    body();
    return "";
  } catch (const std::exception& e) {
    return std::string(step) + ": the printed form of an accepted input fails (" +
           typeid(e).name() + "): " + e.what();
  } catch (...) {
    return std::string(step) + ": non-standard exception";
  }
}

// The first line where `a` and `b` differ, for findings.
std::string firstDifference(const std::string& a, const std::string& b) {
  size_t pos = 0;
  while (pos < a.size() && pos < b.size() && a[pos] == b[pos]) ++pos;
  auto lineAt = [pos](const std::string& s) {
    size_t begin = s.rfind('\n', pos == 0 ? 0 : pos - 1);
    begin = begin == std::string::npos || pos == 0 ? 0 : begin + 1;
    return "'" + s.substr(begin, s.find('\n', pos) - begin) + "'";
  };
  return lineAt(a) + " became " + lineAt(b);
}

#define PIPEDREAM_FUZZ_STEP(expr)           \
  do {                                      \
    std::string finding_ = (expr);          \
    if (!finding_.empty()) return finding_; \
  } while (0)

}  // namespace

std::string checkProfile(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  ProfileGraph graph;
  bool rejected = false;
  PIPEDREAM_FUZZ_STEP(
      run("ProfileGraph::parse", [&] { graph = ProfileGraph::parse(text, "fuzz.txt"); }, &rejected));
  if (rejected) return "";

  // What toString() writes parses back to the same graph (values rounded to
  // %.3f once, so the second print equals the first).
  const std::string printed = graph.toString();
  ProfileGraph again;
  PIPEDREAM_FUZZ_STEP(mustAccept("parse(toString())",
                                 [&] { again = ProfileGraph::parse(printed, "printed.txt"); }));
  if (again.numNodes() != graph.numNodes() || again.edges() != graph.edges()) {
    return "parse(toString()) changed the nodes or edges";
  }
  for (int v = 0; v < graph.numNodes(); ++v) {
    const GraphNode &a = graph.node(v), &b = again.node(v);
    if (a.id != b.id || a.description != b.description || a.stageId != b.stageId ||
        a.activationText != b.activationText) {
      return "parse(toString()) changed node '" + a.id + "': " + firstDifference(printed, again.toString());
    }
  }
  if (again.toString() != printed) {
    return "toString() is not stable under parse(toString()): " +
           firstDifference(printed, again.toString());
  }

  // What a parsed profile feeds: planning states and the planner.
  PIPEDREAM_FUZZ_STEP(run("topologicalCutStates", [&] { topologicalCutStates(graph, 0); }, &rejected));
  PIPEDREAM_FUZZ_STEP(run("topologicalCutStates(4)", [&] { topologicalCutStates(graph, 4); }, &rejected));
  PIPEDREAM_FUZZ_STEP(run("enumerateAntichainStates", [&] {
    PlanningStates states;
    enumerateAntichainStates(graph, 64, &states);
  }, &rejected));
  PlannerOptions options;
  options.costModel = size % 2 ? CostModel::PipeDream : CostModel::Default;
  options.straight = (size / 2) % 2;
  options.twoBw = (size / 4) % 2;
  options.maxAntichainStates = 64;
  options.workBudget = 1e6;
  Topology topology;
  topology.levels = {{2, 1e10}, {2, 1e9}};
  topology.memoryBytes = (size / 8) % 2 ? 0.0 : 1e9;
  PIPEDREAM_FUZZ_STEP(run("planPartition", [&] { planPartition(graph, topology, options); }, &rejected));
  return "";
}

const std::vector<ScheduleOptions>& scheduleConfigs() {
  static const std::vector<ScheduleOptions> configs = [] {
    auto make = [](const char* name, int p, int m, int chunks = 1, std::vector<int> replicas = {},
                   int batches = 1, bool verticalSync = false) {
      ScheduleOptions o;
      o.name = name;
      o.stages = p;
      o.microbatches = m;
      o.chunks = chunks;
      o.replicas = std::move(replicas);
      o.batches = batches;
      o.verticalSync = verticalSync;
      return o;
    };
    return std::vector<ScheduleOptions>{
        make("1f1b", 1, 1),
        make("1f1b", 2, 2),
        make("1f1b", 3, 4),
        make("gpipe", 2, 3),
        make("interleaved-1f1b", 2, 4, 2),
        make("zb-h1", 2, 2),
        make("pipedream", 3, 3),
        make("pipedream-2bw", 2, 4),
        make("1f1b", 2, 4, 1, {2, 1}),
        make("pipedream", 2, 4, 1, {1, 2}),
        make("gpipe", 2, 2, 1, {}, 2),
        make("pipedream", 3, 3, 1, {}, 1, true),
    };
  }();
  return configs;
}

std::string checkSchedule(const uint8_t* data, size_t size) {
  if (size == 0) return "";
  const auto& configs = scheduleConfigs();
  const size_t n = configs.size();
  const ScheduleOptions& config = configs[data[0] % n];
  const bool csv = (data[0] / n) % 2 == 1;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  const Schedule base = buildSchedule(config);

  Schedule parsed;
  bool rejected = false;
  PIPEDREAM_FUZZ_STEP(run(csv ? "withActionsFromCsv" : "withActionsFromText", [&] {
    parsed = csv ? base.withActionsFromCsv(text) : base.withActionsFromText(text);
  }, &rejected));
  if (rejected) return "";

  // Both printed forms parse back to the same action lists.
  Schedule again;
  PIPEDREAM_FUZZ_STEP(mustAccept("withActionsFromText(toText())",
                                 [&] { again = base.withActionsFromText(parsed.toText()); }));
  if (again.allActions() != parsed.allActions()) return "withActionsFromText(toText()) differs";
  PIPEDREAM_FUZZ_STEP(mustAccept("withActionsFromCsv(toCsv())",
                                 [&] { again = base.withActionsFromCsv(parsed.toCsv()); }));
  if (again.allActions() != parsed.allActions()) return "withActionsFromCsv(toCsv()) differs";
  for (const auto& list : parsed.allActions()) {
    for (const Action& a : list) {
      Action b;
      PIPEDREAM_FUZZ_STEP(mustAccept("Action::parse(toString())", [&] { b = Action::parse(a.toString()); }));
      if (a != b) return "Action::parse(toString()) differs for " + a.toString();
    }
  }
  (void)parsed.grid(0, 0);

  // What a parsed schedule feeds (Schedule.with_actions in Python): the
  // validator, then lowering or stripping and the simulator.
  PIPEDREAM_FUZZ_STEP(run("validate", [&] { validate(parsed); }, &rejected));
  if (rejected) return "";
  bool split = false;
  for (const auto& list : parsed.allActions()) {
    for (const Action& a : list) split = split || a.kind == ActionKind::kBackwardWeight;
  }
  const StageCosts costs = StageCosts::uniform(parsed.numStages(), 1.0, 2.0, split ? 1.0 : -1.0, 0.5, 0.25);
  PIPEDREAM_FUZZ_STEP(run("lower/strip and validate", [&] {
    Schedule other = parsed.isLowered() ? stripCommunication(parsed) : lower(parsed);
    validate(other);
  }, &rejected));
  PIPEDREAM_FUZZ_STEP(run("simulate", [&] {
    SimulationResult result = simulate(parsed, costs);
    (void)toChromeTrace(parsed, result);
  }, &rejected));
  return "";
}

}  // namespace fuzz
}  // namespace pipedream
