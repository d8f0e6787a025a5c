#include "receipt.h"

#include <algorithm>
#include <map>
#include <unordered_map>

namespace pipedream {
namespace {

// One rank's list, read once: where each RECV is, the consumer of every RECV,
// and the positions of its sends to one peer.
struct RankIndex {
  std::unordered_map<ActionId, int, ActionIdHash> recvAt;  // a RECV's first position
  std::vector<int> consumer;  // per position: a RECV's consumer (the first F, B or I of its stage
                              // and microbatch after it), -1 for none or another action
  std::vector<int> sendsTo;   // positions of the sends to `peer`, ascending
};

// Where a message a send carries is received: receiving stage and RECV kind.
Action receiveOf(const Action& send) {
  return send.kind == ActionKind::kSendForward
             ? Action::comm(send.stage + 1, ActionKind::kRecvForward, send.microbatch)
             : Action::comm(send.stage - 1, ActionKind::kRecvBackward, send.microbatch);
}

bool isSend(const Action& a) {
  return a.kind == ActionKind::kSendForward || a.kind == ActionKind::kSendBackward;
}

// `list` indexed; sendsTo lists its sends to `peer` (-1: none), `destination`
// naming each send's receiving rank.
template <typename Destination>
RankIndex indexOf(const std::vector<Action>& list, int peer, const Destination& destination) {
  RankIndex index;
  const int n = static_cast<int>(list.size());
  index.consumer.assign(n, -1);
  // RECVs without their consumer yet: the last one per key, chained to the
  // earlier ones with the same key (only an invalid list has several).
  std::unordered_map<ActionId, int, ActionIdHash> waiting;
  std::vector<int> earlier(n, -1);
  auto consume = [&](ActionKind recv, const Action& a, int k) {
    const auto it = waiting.find(ActionId{recv, a.stage, a.microbatch});
    if (it == waiting.end()) return;
    for (int r = it->second; r >= 0; r = earlier[r]) index.consumer[r] = k;
    waiting.erase(it);
  };
  for (int k = 0; k < n; ++k) {
    const Action& a = list[k];
    if (a.kind == ActionKind::kRecvForward || a.kind == ActionKind::kRecvBackward) {
      index.recvAt.emplace(ActionId::of(a), k);
      auto [it, fresh] = waiting.emplace(ActionId::of(a), k);
      if (!fresh) {
        earlier[k] = it->second;
        it->second = k;
      }
    } else if (a.kind == ActionKind::kForward) {
      consume(ActionKind::kRecvForward, a, k);
    } else if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) {
      consume(ActionKind::kRecvBackward, a, k);
    } else if (peer >= 0 && isSend(a) && destination(a) == peer) {
      index.sendsTo.push_back(k);
    }
  }
  return index;
}

}  // namespace

std::vector<std::vector<int>> sendReleasePoints(const Schedule& lowered, int rank) {
  const std::vector<Action>& mine = lowered.actions(rank);
  const Layout& layout = lowered.layout();
  std::vector<std::vector<int>> release(mine.size());
  auto destination = [&layout](const Action& send) {
    return layout.rankFor(receiveOf(send).stage, send.microbatch);
  };
  const RankIndex myIndex = indexOf(mine, -1, destination);
  std::map<int, RankIndex> peerIndex;  // built on first use

  for (int s = 0; s < static_cast<int>(mine.size()); ++s) {
    if (!isSend(mine[s])) continue;
    const int q = destination(mine[s]);
    if (q == rank) continue;
    auto built = peerIndex.find(q);
    if (built == peerIndex.end()) {
      built = peerIndex.emplace(q, indexOf(lowered.actions(q), rank, destination)).first;
    }
    const RankIndex& theirs = built->second;
    const Action recv = receiveOf(mine[s]);
    auto at = theirs.recvAt.find(ActionId::of(recv));
    if (at == theirs.recvAt.end()) continue;
    const int consumed = theirs.consumer[at->second];
    if (consumed < 0) continue;
    // q's first send back to this rank after it consumed ours.
    const auto reply = std::upper_bound(theirs.sendsTo.begin(), theirs.sendsTo.end(), consumed);
    if (reply == theirs.sendsTo.end()) continue;
    const Action back = receiveOf(lowered.actions(q)[*reply]);
    auto mineAt = myIndex.recvAt.find(ActionId::of(back));
    if (mineAt == myIndex.recvAt.end()) continue;
    const int point = myIndex.consumer[mineAt->second];
    if (point > s) release[point].push_back(s);
  }
  for (auto& sends : release) std::sort(sends.begin(), sends.end());
  return release;
}

}  // namespace pipedream
