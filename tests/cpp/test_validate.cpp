// Validity of every generator over a parameter grid, text/CSV round trips,
// and hand-broken schedules that the validator must reject with the grid.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>

#include "lower.h"
#include "simulate.h"
#include "test_helpers.h"
#include "validate.h"

namespace pipedream {
namespace {

using testing_helpers::Case;
using testing_helpers::describe;
using testing_helpers::expectedToFail;
using testing_helpers::gridCases;
using testing_helpers::make;

TEST(ValidityGrid, EveryGeneratorIsValidOrRejectedAsDocumented) {
  int built = 0;
  for (const auto& c : gridCases()) {
    SCOPED_TRACE(describe(c));
    // "pipedream-vs": pipedream with vertical sync.
    const bool vs = c.name == "pipedream-vs";
    const std::string name = vs ? "pipedream" : c.name;
    if (expectedToFail(c)) {
      EXPECT_THROW(make(name, c.p, c.m, c.v, c.replicas, c.batches, vs), std::invalid_argument);
      continue;
    }
    const Schedule s = make(name, c.p, c.m, c.v, c.replicas, c.batches, vs);
    ASSERT_NO_THROW(validate(s));
    const Schedule lowered = lower(s);
    ASSERT_NO_THROW(validate(lowered));
    // Stripping the communication gives back the compute-only lists.
    EXPECT_EQ(stripCommunication(lowered).toText(), s.toText());
    // Every schedule finishes under arbitrary costs too.
    const auto result = simulate(lowered, StageCosts::uniform(s.numStages(), 1.0, 2.0, 0.5, 0.25,
                                                              0.125));
    EXPECT_GT(result.makespan, 0.0);
    ++built;
  }
  EXPECT_GT(built, 4000);
}

TEST(RoundTrip, TextAndCsvOfEveryGenerator) {
  for (const auto& c : std::vector<Case>{{"gpipe", 3, 5, 1, {}, 2},
                                         {"1f1b", 4, 8, 1, {}, 1},
                                         {"interleaved-1f1b", 2, 4, 3, {}, 2},
                                         {"zb-h1", 4, 6, 1, {}, 1},
                                         {"zbv", 3, 5, 2, {}, 2},
                                         {"dualpipev", 2, 4, 2, {}, 1},
                                         {"interleaved-zb", 2, 4, 3, {}, 1},
                                         {"pipedream", 3, 8, 1, {2, 1, 1}, 1},
                                         {"pipedream-2bw", 3, 4, 1, {1, 2, 1}, 3}}) {
    SCOPED_TRACE(describe(c));
    const Schedule s = make(c.name, c.p, c.m, c.v, c.replicas, c.batches);
    for (const Schedule& form : {s, lower(s)}) {
      const Schedule fromText = form.withActionsFromText(form.toText());
      const Schedule fromCsv = form.withActionsFromCsv(form.toCsv());
      for (int r = 0; r < form.numRanks(); ++r) {
        EXPECT_EQ(fromText.actions(r), form.actions(r));
        EXPECT_EQ(fromCsv.actions(r), form.actions(r));
      }
    }
  }
}

TEST(RoundTrip, ParseErrorsNameTheLine) {
  const Schedule s = make("1f1b", 2, 2);
  try {
    s.withActionsFromText("rank 0: 0F0 0F1 0B0 0B1 0U1\nrank 1: 1F0 1Q0\n");
    FAIL() << "accepted a bad token";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("line 2"), std::string::npos) << what;
    EXPECT_NE(what.find("'1Q0'"), std::string::npos) << what;
  }
  EXPECT_THROW(s.withActionsFromText("rank 1: 1F0\n"), std::invalid_argument);
  EXPECT_THROW(s.withActionsFromCsv("0F0\n"), std::invalid_argument);  // one rank missing
}

// Replaces rank `rank`'s list of a 1f1b schedule and expects rejection with
// `needle` in the message and `marked` drawn as >>marked<< in the grid.
void expectRejected(const Schedule& base, const std::string& text, const std::string& needle,
                    const std::string& marked) {
  const Schedule broken = base.withActionsFromText(text);
  try {
    validate(broken);
    ADD_FAILURE() << "accepted:\n" << text;
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(needle), std::string::npos) << what;
    if (!marked.empty()) EXPECT_NE(what.find(">>" + marked + "<<"), std::string::npos) << what;
    EXPECT_NE(what.find("rank 1"), std::string::npos) << "grid missing:\n" << what;
  }
}

TEST(Validator, RejectsHandBrokenSchedules) {
  const Schedule s = make("1f1b", 2, 2);
  const std::string rank1 = "rank 1: 1F0 1B0 1F1 1B1 1U1\n";
  expectRejected(s, "rank 0: 0F0 0B0 0F1 0B1 0U1\nrank 1: 1F1 1B1 1F0 1B0 1U1\n", "deadlock", "0B0");
  expectRejected(s, "rank 0: 0B0 0F0 0F1 0B1 0U1\n" + rank1, "backward before its forward", "0B0");
  expectRejected(s, "rank 0: 0F0 0F1 0B0 0B1\n" + rank1, "never applied", "0B1");
  expectRejected(s, "rank 0: 0F0 0F1v1 0B0 0B1v1 0U1\n" + rank1, "reads version 1 but only 0 updates",
                 "0F1v1");
  expectRejected(s, "rank 0: 0F0 0F1 0B0 0B1v1 0U1\n" + rank1, "weight stashing", "0B1v1");
  expectRejected(s, "rank 0: 0F0 0F1 0B0 0B1 0U2\n" + rank1, "creates version 2", "0U2");
  expectRejected(s, "rank 0: 0F0 0F1 0B0 0B1 0U1 0U2\n" + rank1, "no gradient", "0U2");
  expectRejected(s, "rank 0: 0F0 0F1 0B0 0B1 0U1 1F0\n" + rank1, "belongs on rank 1", "1F0");
  expectRejected(s, "rank 0: 0F0 0F1 0B0 0U1\n" + rank1, "needs one B", "");
  expectRejected(s, "rank 0: 0F0 0F1 0B0 0B1 0B1 0U1\n" + rank1, "second backward", "0B1");
  expectRejected(s, "rank 0: 0F0 0F1 0B0 0W1 0B1 0U1\n" + rank1, "W before its I", "0W1");
  expectRejected(s, "rank 0: 0F0 0F1 0B0 0B1 0ALLREDUCE1 0U1\n" + rank1, "nothing to all-reduce",
                 "0ALLREDUCE1");
  // Lowered: a RECV that comes after its consumer, a missing SEND.
  const Schedule low = lower(s);
  expectRejected(low,
                 "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0U1\n"
                 "rank 1: 1F0 1RECV_F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1U1\n",
                 "forward before its RECV_F", "1F0");
  expectRejected(low,
                 "rank 0: 0F0 0SEND_F0 0F1 0RECV_B0 0B0 0RECV_B1 0B1 0U1\n"
                 "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1U1\n",
                 "needs one SEND_F", "");
}

TEST(Validator, ReplicatedStagesNeedAllReduce) {
  const Schedule s = make("pipedream", 2, 2, 1, {2, 1});
  expectRejected(s,
                 "rank 0: 0F0 0B0 0U1\nrank 1: 0F1 0B1 0ALLREDUCE1 0U1\n"
                 "rank 2: 1F0 1B0 1U1 1F1v1 1B1v1 1U2\n",
                 "no ALLREDUCE precedes this update", "0U1");
  // The generated schedule itself is valid.
  EXPECT_NO_THROW(validate(s.withActionsFromText(
      "rank 0: 0F0 0B0 0ALLREDUCE1 0U1\nrank 1: 0F1 0B1 0ALLREDUCE1 0U1\n"
      "rank 2: 1F0 1B0 1U1 1F1v1 1B1v1 1U2\n")));
}

}  // namespace
}  // namespace pipedream
