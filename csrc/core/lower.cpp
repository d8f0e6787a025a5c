#include "lower.h"

#include <stdexcept>

namespace pipedream {

Schedule lower(const Schedule& schedule) {
  if (schedule.isLowered()) {
    throw std::invalid_argument("schedule '" + schedule.name() +
                                "' is already lowered (it has SEND/RECV actions)");
  }
  const Layout& layout = schedule.layout();
  const int last = schedule.numStages() - 1;
  std::vector<std::vector<Action>> lists(schedule.numRanks());
  for (int r = 0; r < schedule.numRanks(); ++r) {
    auto& out = lists[r];
    // True when (stage, microbatch) runs on another rank than r.
    auto remote = [&](int stage, int microbatch) {
      return layout.rankFor(stage, microbatch) != r;
    };
    for (const Action& a : schedule.actions(r)) {
      const int j = a.stage;
      const int i = a.microbatch;
      switch (a.kind) {
        case ActionKind::kForward:
          if (j > 0 && remote(j - 1, i)) out.push_back(Action::comm(j, ActionKind::kRecvForward, i));
          out.push_back(a);
          if (j < last && remote(j + 1, i)) out.push_back(Action::comm(j, ActionKind::kSendForward, i));
          break;
        case ActionKind::kBackward:
        case ActionKind::kBackwardInput:
          if (j < last && remote(j + 1, i)) out.push_back(Action::comm(j, ActionKind::kRecvBackward, i));
          out.push_back(a);
          if (j > 0 && remote(j - 1, i)) out.push_back(Action::comm(j, ActionKind::kSendBackward, i));
          break;
        default:
          out.push_back(a);
      }
    }
  }
  return schedule.withActions(std::move(lists));
}

Schedule stripCommunication(const Schedule& schedule) {
  std::vector<std::vector<Action>> lists(schedule.numRanks());
  for (int r = 0; r < schedule.numRanks(); ++r) {
    for (const Action& a : schedule.actions(r)) {
      if (!isComm(a.kind)) lists[r].push_back(a);
    }
  }
  return schedule.withActions(std::move(lists));
}

}  // namespace pipedream
