// Replays the fuzz seed corpora and the saved findings (tests/fuzz/corpus/,
// tests/fuzz/regressions/) through the fuzz harnesses, so that the ordinary
// and the sanitized test runs check them without clang or libFuzzer.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "harness.h"
#include "validate.h"

namespace pipedream {
namespace {

namespace fs = std::filesystem;

std::vector<fs::path> inputs(const std::string& target) {
  std::vector<fs::path> files;
  for (const char* kind : {"corpus", "regressions"}) {
    const fs::path dir = fs::path(PIPEDREAM_SOURCE_DIR) / "tests" / "fuzz" / kind / target;
    if (!fs::is_directory(dir)) continue;
    for (const auto& entry : fs::directory_iterator(dir)) {
      if (entry.is_regular_file()) files.push_back(entry.path());
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::string readFile(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

template <class Check>
void replay(const std::string& target, Check check) {
  const auto files = inputs(target);
  ASSERT_GE(files.size(), 5u) << "seed corpus of " << target << " is missing";
  for (const auto& path : files) {
    const std::string data = readFile(path);
    EXPECT_EQ(check(reinterpret_cast<const uint8_t*>(data.data()), data.size()), "") << path;
  }
}

TEST(FuzzCorpus, ProfileGraphInputsAreAcceptedOrClearlyRejected) {
  replay("profile_graph", fuzz::checkProfile);
}

TEST(FuzzCorpus, ScheduleInputsAreAcceptedOrClearlyRejected) {
  replay("schedule", fuzz::checkSchedule);
}

TEST(FuzzCorpus, EveryScheduleConfigBuildsAndValidates) {
  for (const auto& config : fuzz::scheduleConfigs()) {
    EXPECT_NO_THROW(validate(buildSchedule(config))) << config.name;
  }
}

}  // namespace
}  // namespace pipedream
