#include "receipt.h"

#include <algorithm>
#include <map>
#include <tuple>

namespace pipedream {
namespace {

// (kind, stage, microbatch) of an action: unique within a lowered list.
using ActionKey = std::tuple<ActionKind, int, int>;

struct RankIndex {
  std::map<ActionKey, int> position;  // every action's position in the list
};

RankIndex indexOf(const std::vector<Action>& list) {
  RankIndex index;
  for (int k = 0; k < static_cast<int>(list.size()); ++k) {
    const Action& a = list[k];
    index.position.emplace(ActionKey{a.kind, a.stage, a.microbatch}, k);
  }
  return index;
}

// Where a message a send carries is received: receiving stage and RECV kind.
Action receiveOf(const Action& send) {
  return send.kind == ActionKind::kSendForward
             ? Action::comm(send.stage + 1, ActionKind::kRecvForward, send.microbatch)
             : Action::comm(send.stage - 1, ActionKind::kRecvBackward, send.microbatch);
}

// The position of the compute action that consumes the RECV at `recv`, or -1.
int consumerOf(const std::vector<Action>& list, int recv) {
  const Action& r = list[recv];
  for (int k = recv + 1; k < static_cast<int>(list.size()); ++k) {
    const Action& a = list[k];
    if (a.stage != r.stage || a.microbatch != r.microbatch) continue;
    if (r.kind == ActionKind::kRecvForward && a.kind == ActionKind::kForward) return k;
    if (r.kind == ActionKind::kRecvBackward &&
        (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput)) {
      return k;
    }
  }
  return -1;
}

}  // namespace

std::vector<std::vector<int>> sendReleasePoints(const Schedule& lowered, int rank) {
  const std::vector<Action>& mine = lowered.actions(rank);
  const Layout& layout = lowered.layout();
  std::vector<std::vector<int>> release(mine.size());
  const RankIndex myIndex = indexOf(mine);
  std::map<int, RankIndex> peerIndex;  // built on first use

  auto isSend = [](const Action& a) {
    return a.kind == ActionKind::kSendForward || a.kind == ActionKind::kSendBackward;
  };
  auto destination = [&layout](const Action& send) {
    return layout.rankFor(receiveOf(send).stage, send.microbatch);
  };

  for (int s = 0; s < static_cast<int>(mine.size()); ++s) {
    if (!isSend(mine[s])) continue;
    const int q = destination(mine[s]);
    if (q == rank) continue;
    const std::vector<Action>& theirs = lowered.actions(q);
    auto built = peerIndex.find(q);
    if (built == peerIndex.end()) built = peerIndex.emplace(q, indexOf(theirs)).first;
    const Action recv = receiveOf(mine[s]);
    auto at = built->second.position.find(ActionKey{recv.kind, recv.stage, recv.microbatch});
    if (at == built->second.position.end()) continue;
    const int consumed = consumerOf(theirs, at->second);
    if (consumed < 0) continue;
    // q's first send back to this rank after it consumed ours.
    int reply = -1;
    for (int k = consumed + 1; k < static_cast<int>(theirs.size()); ++k) {
      if (isSend(theirs[k]) && destination(theirs[k]) == rank) {
        reply = k;
        break;
      }
    }
    if (reply < 0) continue;
    const Action back = receiveOf(theirs[reply]);
    auto mineAt = myIndex.position.find(ActionKey{back.kind, back.stage, back.microbatch});
    if (mineAt == myIndex.position.end()) continue;
    const int point = consumerOf(mine, mineAt->second);
    if (point > s) release[point].push_back(s);
  }
  for (auto& sends : release) std::sort(sends.begin(), sends.end());
  return release;
}

}  // namespace pipedream
