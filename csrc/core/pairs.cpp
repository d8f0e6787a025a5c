#include "pairs.h"

#include <stdexcept>

#include "channels.h"

namespace pipedream {

namespace {

bool isPairable(const Action& f, const Action& b) {
  return f.kind == ActionKind::kForward && b.kind == ActionKind::kBackward && f.stage != b.stage;
}

// The receive the backward `b` waits for.
bool isOwnReceive(const Action& comm, const Action& b) {
  return comm.kind == ActionKind::kRecvBackward && comm.stage == b.stage &&
         comm.microbatch == b.microbatch;
}

std::vector<Action> pairList(const std::vector<Action>& list) {
  std::vector<Action> out;
  out.reserve(list.size());
  size_t k = 0;
  while (k < list.size()) {
    const Action& f = list[k];
    size_t next = k + 1;
    while (next < list.size() && isComm(list[next].kind)) ++next;
    if (f.kind != ActionKind::kForward || next >= list.size() || !isPairable(f, list[next])) {
      out.push_back(f);
      ++k;
      continue;
    }
    const Action& b = list[next];
    std::vector<Action> after;
    for (size_t m = k + 1; m < next; ++m) {
      if (isOwnReceive(list[m], b)) {
        out.push_back(list[m]);  // posted before the pair: the B waits for it first
      } else {
        after.push_back(list[m]);
      }
    }
    out.push_back(f);
    out.push_back(b);
    out.insert(out.end(), after.begin(), after.end());
    k = next + 1;
  }
  return out;
}

}  // namespace

bool startsPair(const std::vector<Action>& list, size_t k) {
  return k + 1 < list.size() && isPairable(list[k], list[k + 1]);
}

std::vector<size_t> pairStarts(const std::vector<Action>& list) {
  std::vector<size_t> out;
  for (size_t k = 0; k + 1 < list.size(); ++k) {
    if (startsPair(list, k)) out.push_back(k);
  }
  return out;
}

Schedule pairForwardBackward(const Schedule& ordered) {
  if (!ordered.isLowered() && ordered.numRanks() > 1) {  // one rank: nothing to send
    throw std::invalid_argument("pairForwardBackward: schedule '" + ordered.name() +
                                "' is not lowered; pair its lowered, ordered form");
  }
  std::vector<std::vector<Action>> lists;
  for (int r = 0; r < ordered.numRanks(); ++r) lists.push_back(pairList(ordered.actions(r)));
  Schedule paired = ordered.withActions(std::move(lists));
  try {
    validateChannels(paired);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument("schedule '" + ordered.name() +
                                "': running its F&B pairs together is not safe: " + e.what());
  }
  return paired;
}

}  // namespace pipedream
