// libFuzzer target: the schedule text and CSV parsers
// (Schedule::withActionsFromText / withActionsFromCsv, parseActions,
// Action::parse). The first byte picks the layout and the format; see
// harness.h for that and for what counts as a finding.
#include <cstdio>
#include <cstdlib>

#include "harness.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string finding = pipedream::fuzz::checkSchedule(data, size);
  if (!finding.empty()) {
    std::fprintf(stderr, "FINDING (schedule): %s\n", finding.c_str());
    std::abort();
  }
  return 0;
}
