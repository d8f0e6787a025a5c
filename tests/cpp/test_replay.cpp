// MakespanReplay: simulate()'s makespan replayed for other costs, bit for bit.
#include <gtest/gtest.h>

#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "generators.h"
#include "lower.h"
#include "replay.h"
#include "simulate.h"
#include "test_helpers.h"

namespace pipedream {
namespace {

using testing_helpers::make;

StageCosts randomCosts(int stages, bool split, std::mt19937& rng) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  // Some zero costs: ties between a rank's free time and its dependencies.
  const auto draw = [&]() { return rng() % 5 == 0 ? 0.0 : u(rng); };
  StageCosts c;
  for (int j = 0; j < stages; ++j) {
    c.forward.push_back(draw());
    c.backward.push_back(draw());
    if (split) c.weight.push_back(draw());
    c.allReduce.push_back(0.0);
  }
  for (int j = 0; j + 1 < stages; ++j) c.comm.push_back(draw());
  return c;
}

TEST(MakespanReplay, EqualsTheSimulatorForEveryScheduleAndCosts) {
  std::mt19937 rng(7);
  int compared = 0;
  for (const std::string& name : scheduleNames()) {
    for (int p : {2, 4}) {
      for (int m : {4, 8}) {
        for (int v : {1, 2}) {
          Schedule built;
          try {
            built = make(name, p, m, v);
          } catch (const std::invalid_argument&) {
            continue;  // the schedule refuses (p, m, v)
          }
          for (const Schedule& s : {built, lower(built)}) {
            for (bool split : {false, true}) {
              const int stages = s.numStages();
              const MakespanReplay replay(s, randomCosts(stages, split, rng));
              ASSERT_TRUE(replay.compiled()) << name;
              for (int draw = 0; draw < 10; ++draw) {
                const StageCosts costs = randomCosts(stages, split, rng);
                EXPECT_EQ(replay.makespan(costs), simulate(s, costs).makespan)
                    << name << " p=" << p << " m=" << m << " v=" << v << " lowered="
                    << s.isLowered() << " split=" << split;
                ++compared;
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GE(compared, 500);
}

TEST(MakespanReplay, RefusesCollectivesAndCostsOfAnotherShape) {
  std::mt19937 rng(3);
  const Schedule replicated = lower(make("pipedream", 2, 4, 1, {2, 1}));
  const MakespanReplay collective(replicated, randomCosts(2, false, rng));
  EXPECT_FALSE(collective.compiled());
  EXPECT_THROW(collective.makespan(randomCosts(2, false, rng)), std::invalid_argument);
  const MakespanReplay plain(lower(make("1f1b", 3, 4)), randomCosts(3, false, rng));
  EXPECT_THROW(plain.makespan(randomCosts(4, false, rng)), std::invalid_argument);
  EXPECT_THROW(plain.makespan(randomCosts(3, true, rng)), std::invalid_argument);
}

}  // namespace
}  // namespace pipedream
