// Fuzz harnesses for the C++ core's parsers, shared by the libFuzzer targets
// (fuzz_*.cpp, built with -DPIPEDREAM_FUZZ=ON and clang) and by the
// GoogleTest that replays tests/fuzz/corpus and tests/fuzz/regressions in the
// ordinary (and sanitized) test build.
//
// Each check runs one input through a parser and, when it is accepted,
// through what the parsed value feeds (round trip, planning, validation,
// simulation). It returns "" when the input was accepted, or rejected with a
// clear error: a std::invalid_argument (Python's ValueError) whose message is
// not empty. Anything else is a finding, described by the returned text: an
// exception of another type, an empty message, or a broken round trip.
// Crashes, sanitizer reports and hangs show up as themselves.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "generators.h"

namespace pipedream {
namespace fuzz {

// ProfileGraph::parse (PipeDream's graph.txt), then toString() and parse
// again, planning states and a small plan.
std::string checkProfile(const uint8_t* data, size_t size);

// Schedule::withActionsFromText / withActionsFromCsv (and so parseActions /
// Action::parse). The first byte picks the layout (scheduleConfigs()[b % n])
// and the format (text when (b / n) is even, CSV when odd); the rest is the
// schedule. Accepted lists are printed and parsed again, validated, and valid
// ones lowered (or stripped) and simulated.
std::string checkSchedule(const uint8_t* data, size_t size);

// The layouts the schedule target parses against (built with buildSchedule).
const std::vector<ScheduleOptions>& scheduleConfigs();

}  // namespace fuzz
}  // namespace pipedream
