// Action text form: exact round trips and clear parse errors.
#include <gtest/gtest.h>

#include "action.h"

namespace pipedream {
namespace {

TEST(ActionText, RoundTripsEveryKind) {
  const std::vector<std::string> texts = {"2F0",      "1B3v2",     "0I2",      "0W2",
                                          "3SEND_F1", "1RECV_B0",  "4RECV_F7", "2SEND_B5",
                                          "0U3",      "0ALLREDUCE3", "12F345v67"};
  for (const auto& text : texts) {
    EXPECT_EQ(Action::parse(text).toString(), text);
  }
}

TEST(ActionText, ParsesFields) {
  const Action a = Action::parse("1B3v2");
  EXPECT_EQ(a.stage, 1);
  EXPECT_EQ(a.kind, ActionKind::kBackward);
  EXPECT_EQ(a.microbatch, 3);
  EXPECT_EQ(a.version, 2);
  const Action u = Action::parse("0U3");
  EXPECT_EQ(u.kind, ActionKind::kUpdate);
  EXPECT_EQ(u.microbatch, -1);
  EXPECT_EQ(u.version, 3);
  EXPECT_EQ(Action::parse("2F0"), Action::compute(2, ActionKind::kForward, 0, 0));
  EXPECT_EQ(Action::parse("0ALLREDUCE4"), Action::allReduce(0, 4));
}

TEST(ActionText, VersionZeroIsImplicit) {
  EXPECT_EQ(Action::compute(0, ActionKind::kForward, 1, 0).toString(), "0F1");
  EXPECT_EQ(Action::parse("0F1v0"), Action::parse("0F1"));
}

TEST(ActionText, RejectsMalformedText) {
  for (const std::string bad : {"", "F0", "0X1", "0F", "0Fa", "0F1x", "0SEND_F1v2", "0U", "-1F0",
                                "0F1v", "0 F1"}) {
    try {
      Action::parse(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("'" + bad + "'"), std::string::npos) << e.what();
    }
  }
}

TEST(ActionText, ListsSplitOnSpacesAndCommas) {
  const auto actions = parseActions(" 0F0, 0F1  0B0\n0U1 ");
  ASSERT_EQ(actions.size(), 4u);
  EXPECT_EQ(actionsToString(actions), "0F0 0F1 0B0 0U1");
}

}  // namespace
}  // namespace pipedream
