// TransferLedger: the three send-release policies.
#include <gtest/gtest.h>

#include <optional>
#include <vector>

#include "transfer_ledger.h"

namespace pipedream {
namespace {

using Ids = std::vector<TransferLedger::Id>;

TEST(TransferLedger, SizesFollowTheRankCount) {
  EXPECT_EQ(TransferLedger::forFlush({}).maxSendsInFlight(), 0u);       // unbounded
  EXPECT_EQ(TransferLedger::forStreaming(3).maxSendsInFlight(), 28u);      // 4p + 16
}

TEST(TransferLedger, ReceiptPointsReleaseOnlySendsInFlightOnce) {
  // Position 5 releases the sends at 1 and 3; position 7 the one at 4.
  std::vector<std::vector<int>> points(8);
  points[5] = {1, 3};
  points[7] = {4};
  auto ledger = TransferLedger::forFlush(points);
  EXPECT_TRUE(ledger.isReceiptPoint(5));
  EXPECT_FALSE(ledger.isReceiptPoint(4));
  EXPECT_FALSE(ledger.isReceiptPoint(99));
  ledger.sendIssued(1);
  ledger.sendIssued(3);
  EXPECT_EQ(ledger.sendsInFlight(), 2u);
  EXPECT_EQ(ledger.releaseAtReceiptPoint(5), (Ids{1, 3}));
  EXPECT_EQ(ledger.sendsInFlight(), 0u);
  EXPECT_EQ(ledger.releaseAtReceiptPoint(5), Ids{});  // idempotent
  EXPECT_EQ(ledger.releaseAtReceiptPoint(7), Ids{});  // 4 was never sent (forward-only)
  EXPECT_EQ(ledger.releaseAtReceiptPoint(99), Ids{});
}

TEST(TransferLedger, GradientReleasesItsForwardSend) {
  auto ledger = TransferLedger::forFlush({});
  ledger.sendIssued(0, std::make_pair(0, 7));
  ledger.sendIssued(2);  // a SEND_B: no gradient releases it
  EXPECT_EQ(ledger.releaseByGradient(0, 6), std::nullopt);
  EXPECT_EQ(ledger.releaseByGradient(0, 7), std::optional<TransferLedger::Id>(0));
  EXPECT_EQ(ledger.releaseByGradient(0, 7), std::nullopt);  // idempotent
  EXPECT_EQ(ledger.sendsInFlight(), 1u);
  EXPECT_EQ(ledger.releaseAll(), Ids{2});
}

TEST(TransferLedger, ReceiptPointForgetsTheForwardSend) {
  std::vector<std::vector<int>> points(4);
  points[3] = {0};
  auto ledger = TransferLedger::forFlush(points);
  ledger.sendIssued(0, std::make_pair(1, 2));
  EXPECT_EQ(ledger.releaseAtReceiptPoint(3), Ids{0});
  EXPECT_EQ(ledger.releaseByGradient(1, 2), std::nullopt);
}

TEST(TransferLedger, BoundReleasesTheOldest) {
  auto ledger = TransferLedger::forStreaming(1);  // at most 20
  for (TransferLedger::Id id = 100; id < 125; ++id) ledger.sendIssued(id, std::make_pair(0, int(id)));
  EXPECT_EQ(ledger.releaseBeyondBound(), (Ids{100, 101, 102, 103, 104}));
  EXPECT_EQ(ledger.sendsInFlight(), 20u);
  EXPECT_EQ(ledger.releaseBeyondBound(), Ids{});  // idempotent
  EXPECT_EQ(ledger.releaseByGradient(0, 100), std::nullopt);  // already released
  EXPECT_EQ(ledger.releaseByGradient(0, 110), std::optional<TransferLedger::Id>(110));
  EXPECT_EQ(ledger.sendsInFlight(), 19u);
}

TEST(TransferLedger, FlushHasNoBound) {
  auto ledger = TransferLedger::forFlush({});
  for (TransferLedger::Id id = 0; id < 50; ++id) ledger.sendIssued(id);
  EXPECT_EQ(ledger.releaseBeyondBound(), Ids{});
  EXPECT_EQ(ledger.sendsInFlight(), 50u);
}

TEST(TransferLedger, ReleaseAllAndClear) {
  auto ledger = TransferLedger::forFlush({});
  ledger.sendIssued(5);
  ledger.sendIssued(2, std::make_pair(0, 0));
  EXPECT_EQ(ledger.releaseAll(), (Ids{2, 5}));
  EXPECT_EQ(ledger.releaseAll(), Ids{});
  EXPECT_EQ(ledger.releaseByGradient(0, 0), std::nullopt);
  ledger.sendIssued(1);
  ledger.clear();
  EXPECT_EQ(ledger.sendsInFlight(), 0u);
}

}  // namespace
}  // namespace pipedream
