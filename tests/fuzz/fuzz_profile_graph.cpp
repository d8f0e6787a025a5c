// libFuzzer target: the profile parser (ProfileGraph::parse, PipeDream's
// graph.txt). See harness.h for what counts as a finding.
#include <cstdio>
#include <cstdlib>

#include "harness.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string finding = pipedream::fuzz::checkProfile(data, size);
  if (!finding.empty()) {
    std::fprintf(stderr, "FINDING (profile_graph): %s\n", finding.c_str());
    std::abort();
  }
  return 0;
}
