#include "channels.h"

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <tuple>
#include <unordered_map>

#include "lower.h"
#include "receipt.h"
#include "simulate.h"

namespace pipedream {

namespace {

std::string str(int value) { return std::to_string(value); }

bool isSend(ActionKind kind) {
  return kind == ActionKind::kSendForward || kind == ActionKind::kSendBackward;
}
bool isRecv(ActionKind kind) {
  return kind == ActionKind::kRecvForward || kind == ActionKind::kRecvBackward;
}

// The RECV kind compute action `kind` consumes: RECV_F feeds F, RECV_B feeds
// B or I; none for W.
std::optional<ActionKind> consumedRecv(ActionKind kind) {
  if (kind == ActionKind::kForward) return ActionKind::kRecvForward;
  if (kind == ActionKind::kBackward || kind == ActionKind::kBackwardInput) {
    return ActionKind::kRecvBackward;
  }
  return std::nullopt;
}

struct TransferKeyHash {
  size_t operator()(const TransferKey& key) const {
    return hashInts(key.forward ? 1 : 0, key.boundary, key.microbatch);
  }
};
template <typename Value>
using ByTransfer = std::unordered_map<TransferKey, Value, TransferKeyHash>;

// Every RECV of `list` moved to right before its consumer (the form lower()
// produces), so the simulator's send times do not depend on where a previous
// pass put the receives. RECVs are found by key, not by a scan per consumer.
std::vector<Action> recvsBeforeConsumers(const std::vector<Action>& list) {
  // RECVs by key: the first and last position, chained in list order through
  // `next` (only an invalid list has several per key).
  std::unordered_map<ActionId, std::pair<size_t, size_t>, ActionIdHash> waiting;
  std::vector<size_t> next(list.size(), list.size());
  for (size_t k = 0; k < list.size(); ++k) {
    if (!isRecv(list[k].kind)) continue;
    auto [it, fresh] = waiting.emplace(ActionId::of(list[k]), std::make_pair(k, k));
    if (!fresh) {
      next[it->second.second] = k;
      it->second.second = k;
    }
  }
  std::vector<bool> placed(list.size(), false);
  std::vector<Action> out;
  out.reserve(list.size());
  for (const Action& a : list) {
    if (isRecv(a.kind)) continue;
    const std::optional<ActionKind> recv = isCompute(a.kind) ? consumedRecv(a.kind) : std::nullopt;
    if (recv) {
      const auto it = waiting.find(ActionId{*recv, a.stage, a.microbatch});
      if (it != waiting.end()) {
        for (size_t k = it->second.first; k < list.size(); k = next[k]) {
          out.push_back(list[k]);
          placed[k] = true;
        }
        waiting.erase(it);
      }
    }
    out.push_back(a);
  }
  for (size_t k = 0; k < list.size(); ++k) {
    if (!isRecv(list[k].kind) || placed[k]) continue;
    throw std::invalid_argument("invalid schedule: " + list[k].toString() +
                                " has no consumer (F, B or I of its stage and microbatch) after it");
  }
  return out;
}

// A send in the pair order: when it happens in the unit-cost simulation.
struct TimedSend {
  double time = 0.0;
  TransferKey key;
  int sender = 0;
  bool operator<(const TimedSend& other) const {
    if (time != other.time) return time < other.time;
    if (key.forward != other.key.forward) return key.forward;  // forward first
    if (key.microbatch != other.key.microbatch) return key.microbatch < other.key.microbatch;
    return key.boundary < other.key.boundary;
  }
};

// For every unordered pair (low, high): its transfers in the order their sends
// happen when `normalized` runs with unit costs and no latency.
std::map<std::pair<int, int>, std::vector<TimedSend>> pairOrders(const Schedule& normalized) {
  SimulationResult sim;
  try {
    sim = simulate(normalized, StageCosts::uniform(normalized.numStages(), 1.0, 2.0, -1.0, 0.0, 0.0),
                   Recording::kSendsOnly);
  } catch (const DeadlockError& e) {
    throw std::invalid_argument("cannot order the transfers of schedule '" + normalized.name() +
                                "': it deadlocks (" + e.what() + ")");
  }
  const Layout& layout = normalized.layout();
  std::map<std::pair<int, int>, std::vector<TimedSend>> orders;
  for (const TimedAction& event : sim.timeline) {
    if (!isSend(event.action.kind)) continue;
    const int peer = peerOf(layout, event.action);
    const auto pair = std::minmax(event.rank, peer);
    orders[{pair.first, pair.second}].push_back(
        TimedSend{event.end, TransferKey::of(event.action), event.rank});
  }
  for (auto& [pair, sends] : orders) std::stable_sort(sends.begin(), sends.end());
  return orders;
}

// Asynchronous feeds: the first position of `base` (a list without RECVs) in
// the slice of each step, as AsyncActionFeed::slices() cuts it (a step ends just after its
// last forward and the sends that follow it).
std::vector<size_t> stepBegins(const std::vector<Action>& base, int perStep) {
  int steps = 0;
  for (const Action& a : base) {
    if (a.kind == ActionKind::kForward) steps = std::max(steps, a.microbatch / perStep + 1);
  }
  std::vector<size_t> end(steps, 0);
  std::vector<bool> has(steps, false);
  for (size_t k = 0; k < base.size(); ++k) {
    const Action& a = base[k];
    if (a.kind != ActionKind::kForward) continue;
    size_t e = k + 1;
    while (e < base.size() && base[e].kind == ActionKind::kSendForward &&
           base[e].microbatch == a.microbatch) {
      ++e;
    }
    const int t = a.microbatch / perStep;
    end[t] = std::max(end[t], e);
    has[t] = true;
  }
  std::vector<size_t> begins(steps + 1, 0);
  for (int t = 0; t < steps; ++t) {
    begins[t + 1] = has[t] ? std::max(begins[t], end[t]) : begins[t];
  }
  return begins;
}

// Where a RECV of a rank goes: before base[index].
struct Placement {
  size_t index = 0;
  int peer = 0;
  size_t order = 0;  // position in the pair's order (ties at one index)
  Action recv;
};

// One rank's list without its RECVs, and where each RECV may go.
struct RankPlan {
  std::vector<Action> base;
  ByTransfer<size_t> sendAt;      // this rank's sends: base index
  ByTransfer<size_t> consumerAt;  // this rank's receives: base index of the consumer
  ByTransfer<Action> recvOf;
  std::vector<size_t> begins;                // streams: first base index of each step
  std::vector<Placement> placements;

  RankPlan(const std::vector<Action>& normalized, int perStep) {
    base.reserve(normalized.size());
    for (const Action& a : normalized) {
      if (isRecv(a.kind)) {
        // normalized: the consumer is the next action that is not a RECV
        consumerAt[TransferKey::of(a)] = base.size();
        recvOf[TransferKey::of(a)] = a;
        continue;
      }
      if (isSend(a.kind)) sendAt[TransferKey::of(a)] = base.size();
      base.push_back(a);
    }
    if (perStep > 0) begins = stepBegins(base, perStep);
  }
  // The earliest index a receive of `key` may take: streams post none before
  // the step that admits its microbatch.
  size_t floorOf(const TransferKey& key, int perStep) const {
    if (perStep <= 0) return 0;
    const size_t step = static_cast<size_t>(key.microbatch / perStep);
    return begins[std::min(step, begins.size() - 1)];
  }
  std::vector<Action> list() {
    std::stable_sort(placements.begin(), placements.end(), [](const Placement& a, const Placement& b) {
      return std::tie(a.index, a.peer, a.order) < std::tie(b.index, b.peer, b.order);
    });
    std::vector<Action> out;
    size_t next = 0;
    for (size_t b = 0; b <= base.size(); ++b) {
      while (next < placements.size() && placements[next].index == b) out.push_back(placements[next++].recv);
      if (b < base.size()) out.push_back(base[b]);
    }
    return out;
  }
};

// Merges the sends of a pair's two ranks into the pair's order and places each
// receive. The order follows the simulated send times where it can; it takes
// the other end's next send first when the earlier one cannot be received in
// time there (a stream's receive may not move into an earlier step).
void orderPair(const std::string& name, int low, int high, const std::vector<TimedSend>& sends,
               std::vector<RankPlan>& plans, int perStep) {
  std::vector<TimedSend> queue[2];  // each end's sends, in its list order
  for (int e = 0; e < 2; ++e) {
    const RankPlan& plan = plans[e == 0 ? low : high];
    std::vector<std::pair<size_t, size_t>> order;  // (base index, position in `sends`)
    for (size_t x = 0; x < sends.size(); ++x) {
      if ((sends[x].sender == low ? 0 : 1) == e) order.push_back({plan.sendAt.at(sends[x].key), x});
    }
    std::sort(order.begin(), order.end());
    for (const auto& [at, x] : order) queue[e].push_back(sends[x]);
  }
  size_t head[2] = {0, 0};
  size_t lower[2] = {0, 0};  // per end: no receive before this base index
  size_t order = 0;
  // Where end `e` would post the receive of the other end's next send (or none).
  auto slot = [&](int e) -> std::optional<size_t> {
    const TimedSend& s = queue[1 - e][head[1 - e]];
    const RankPlan& plan = plans[e == 0 ? low : high];
    auto consumer = plan.consumerAt.find(s.key);
    if (consumer == plan.consumerAt.end()) {
      throw std::invalid_argument("invalid schedule '" + name + "': rank " + str(e == 0 ? low : high) +
                                  " never receives transfer " + s.key.toString() + " from rank " +
                                  str(s.sender));
    }
    const size_t index = std::max(lower[e], plan.floorOf(s.key, perStep));
    size_t latest = consumer->second;
    if (head[e] < queue[e].size()) latest = std::min(latest, plan.sendAt.at(queue[e][head[e]].key));
    if (index > latest) return std::nullopt;
    return index;
  };
  while (head[0] < queue[0].size() || head[1] < queue[1].size()) {
    // The sender whose send comes next: the earlier one, else the only one.
    int first = head[0] < queue[0].size() ? 0 : 1;
    if (head[0] < queue[0].size() && head[1] < queue[1].size() &&
        queue[1][head[1]] < queue[0][head[0]]) {
      first = 1;
    }
    std::optional<size_t> index = slot(1 - first);
    if (!index && head[1 - first] < queue[1 - first].size()) {
      first = 1 - first;
      index = slot(1 - first);
    }
    if (!index) {
      const TimedSend& s = queue[first][head[first]];
      throw std::logic_error("no mirrored transfer order for schedule '" + name + "': rank " +
                             str(first == 0 ? high : low) + " cannot post the receive of " +
                             s.key.toString() + " from rank " + str(s.sender) +
                             " before its consumer or its own next send" +
                             (perStep > 0 ? " (a stream posts no receive before its step)" : ""));
    }
    const int receiver = 1 - first;
    const TimedSend& s = queue[first][head[first]++];
    RankPlan& senderPlan = plans[first == 0 ? low : high];
    RankPlan& receiverPlan = plans[receiver == 0 ? low : high];
    lower[first] = std::max(lower[first], senderPlan.sendAt.at(s.key) + 1);
    lower[receiver] = *index;
    receiverPlan.placements.push_back(
        Placement{*index, first == 0 ? low : high, order++, receiverPlan.recvOf.at(s.key)});
  }
}

}  // namespace

TransferKey TransferKey::of(const Action& comm) {
  switch (comm.kind) {
    case ActionKind::kSendForward: return TransferKey{true, comm.stage, comm.microbatch};
    case ActionKind::kRecvForward: return TransferKey{true, comm.stage - 1, comm.microbatch};
    case ActionKind::kSendBackward: return TransferKey{false, comm.stage - 1, comm.microbatch};
    case ActionKind::kRecvBackward: return TransferKey{false, comm.stage, comm.microbatch};
    default:
      throw std::invalid_argument("TransferKey::of: " + comm.toString() +
                                  " is not a SEND or RECV action");
  }
}

bool TransferKey::operator<(const TransferKey& other) const {
  return std::tie(forward, boundary, microbatch) <
         std::tie(other.forward, other.boundary, other.microbatch);
}

std::string TransferKey::toString() const {
  return std::string(forward ? "F" : "B") + str(boundary) + ":" + str(microbatch);
}

int peerOf(const Layout& layout, const Action& comm) {
  switch (comm.kind) {
    case ActionKind::kSendForward: return layout.rankFor(comm.stage + 1, comm.microbatch);
    case ActionKind::kRecvForward: return layout.rankFor(comm.stage - 1, comm.microbatch);
    case ActionKind::kSendBackward: return layout.rankFor(comm.stage - 1, comm.microbatch);
    case ActionKind::kRecvBackward: return layout.rankFor(comm.stage + 1, comm.microbatch);
    default:
      throw std::invalid_argument("peerOf: " + comm.toString() + " is not a SEND or RECV action");
  }
}

std::vector<ChannelOp> channelOps(const Schedule& schedule, int rank, int peer) {
  std::vector<ChannelOp> ops;
  const auto& list = schedule.actions(rank);
  for (size_t k = 0; k < list.size(); ++k) {
    const Action& a = list[k];
    if (!isComm(a.kind) || peerOf(schedule.layout(), a) != peer) continue;
    ops.push_back(ChannelOp{isSend(a.kind), TransferKey::of(a), static_cast<int>(k)});
  }
  return ops;
}

Schedule orderTransfers(const Schedule& lowered, int microbatchesPerStep) {
  if (!lowered.isLowered()) {
    // Nothing crosses a rank (one rank, or one stage): nothing to order.
    if (!lower(lowered).isLowered()) return lowered;
    throw std::invalid_argument("orderTransfers needs a lowered schedule (lower() first); '" +
                                lowered.name() + "' has no SEND/RECV actions");
  }
  std::vector<std::vector<Action>> normalizedLists;
  for (int r = 0; r < lowered.numRanks(); ++r) {
    normalizedLists.push_back(recvsBeforeConsumers(lowered.actions(r)));
  }
  const Schedule normalized = lowered.withActions(std::move(normalizedLists));
  const auto orders = pairOrders(normalized);
  std::vector<RankPlan> plans;
  for (int r = 0; r < lowered.numRanks(); ++r) plans.emplace_back(normalized.actions(r), microbatchesPerStep);
  for (const auto& [pair, sends] : orders) {
    orderPair(lowered.name(), pair.first, pair.second, sends, plans, microbatchesPerStep);
  }
  std::vector<std::vector<Action>> lists;
  for (auto& plan : plans) lists.push_back(plan.list());
  return lowered.withActions(std::move(lists));
}

namespace {

// The F / SEND_F / RECV_F actions alone: what forward-only evaluation runs.
Schedule forwardProjection(const Schedule& schedule) {
  std::vector<std::vector<Action>> lists(schedule.numRanks());
  for (int r = 0; r < schedule.numRanks(); ++r) {
    for (const Action& a : schedule.actions(r)) {
      if (a.kind == ActionKind::kForward || a.kind == ActionKind::kSendForward ||
          a.kind == ActionKind::kRecvForward) {
        lists[r].push_back(a);
      }
    }
  }
  return schedule.withActions(std::move(lists));
}

// Every rank's operations with each of its peers, in list order: channelOps()
// of every pair at once. A rank's list is read in one pass, at the first
// question about that rank, so an action peerOf() rejects throws where a scan
// pair by pair would first meet it.
class ChannelIndex {
 public:
  explicit ChannelIndex(const Schedule& schedule)
      : schedule_(schedule), byRank_(schedule.numRanks()), built_(schedule.numRanks(), false) {}

  // `rank`'s operations with `peer` (empty when none).
  const std::vector<ChannelOp>& ops(int rank, int peer) {
    const auto& byPeer = peersOf(rank);
    const auto it = byPeer.find(peer);
    return it == byPeer.end() ? none_ : it->second;
  }

  // Peer -> `rank`'s operations with it, peers ascending.
  const std::map<int, std::vector<ChannelOp>>& peersOf(int rank) {
    if (built_.at(rank)) return byRank_[rank];
    const auto& list = schedule_.actions(rank);
    auto& byPeer = byRank_[rank];
    for (size_t k = 0; k < list.size(); ++k) {
      const Action& a = list[k];
      if (!isComm(a.kind)) continue;
      const int peer = peerOf(schedule_.layout(), a);
      if (peer == rank) continue;
      byPeer[peer].push_back(ChannelOp{isSend(a.kind), TransferKey::of(a), static_cast<int>(k)});
    }
    built_[rank] = true;
    return byPeer;
  }

 private:
  const Schedule& schedule_;
  std::vector<std::map<int, std::vector<ChannelOp>>> byRank_;
  std::vector<bool> built_;
  const std::vector<ChannelOp> none_;
};

std::string channelsText(const Schedule& ordered, ChannelIndex& index) {
  std::ostringstream out;
  for (int r = 0; r < ordered.numRanks(); ++r) {
    for (int q = 0; q < ordered.numRanks(); ++q) {
      if (q == r) continue;
      const auto& ops = index.ops(r, q);
      if (ops.empty()) continue;
      out << "rank " << r << " -> " << q << ":";
      for (const auto& op : ops) out << " " << ordered.actions(r)[op.position].toString();
      out << "\n";
    }
  }
  return out.str();
}

[[noreturn]] void channelProblem(const Schedule& schedule, const std::string& what) {
  throw std::invalid_argument("transfer order of schedule '" + schedule.name() + "': " + what +
                              "\n" + channelsToText(schedule));
}

void checkMirrors(const Schedule& schedule, ChannelIndex& index) {
  for (int a = 0; a < schedule.numRanks(); ++a) {
    for (int b = a + 1; b < schedule.numRanks(); ++b) {
      const auto& mine = index.ops(a, b);
      const auto& theirs = index.ops(b, a);
      const size_t common = std::min(mine.size(), theirs.size());
      for (size_t k = 0; k < common; ++k) {
        if (mine[k].send != theirs[k].send && mine[k].key == theirs[k].key) continue;
        channelProblem(schedule, "ranks " + str(a) + " and " + str(b) + " do not mirror at operation " +
                                     str(static_cast<int>(k)) + ": rank " + str(a) + " issues " +
                                     schedule.actions(a)[mine[k].position].toString() + ", rank " +
                                     str(b) + " issues " +
                                     schedule.actions(b)[theirs[k].position].toString() +
                                     " (NCCL matches the k-th send with the k-th receive)");
      }
      if (mine.size() != theirs.size()) {
        channelProblem(schedule, "rank " + str(a) + " has " + str(static_cast<int>(mine.size())) +
                                     " operations with rank " + str(b) + " but rank " + str(b) +
                                     " has " + str(static_cast<int>(theirs.size())) + " with rank " +
                                     str(a));
      }
    }
  }
}

// The channel simulator of validateChannels(): every pair one in-order stream.
// Each rank's step is O(log) (its inputs found by key, not by a scan of its
// list), so a run costs O(actions log actions) plus O(ranks) per sweep.
//
// On a mesh (validateMeshChannels) it runs every pipeline side by side on the
// global ranks (pipeline c's rank r is global rank r * copies + c), each pair
// of global ranks one stream, and every compute action a collective of its
// rank's tensor-parallel group (and with FSDP its data-parallel group): it
// runs once every member is at that same action with its inputs ready.
class ChannelSimulation {
 public:
  ChannelSimulation(const std::vector<const Schedule*>& pipelines,
                    const std::vector<ChannelIndex*>& indexes, const MeshShape& mesh)
      : pipelines_(pipelines),
        schedule_(*pipelines.at(0)),
        layout_(schedule_.layout()),
        copies_(static_cast<int>(pipelines.size())),
        mesh_(mesh),
        ranks_(schedule_.numRanks() * copies_),
        next_(ranks_, 0),
        done_(ranks_, false),
        opAt_(ranks_),
        recvsOf_(ranks_),
        sameRecv_(ranks_),
        sends_(ranks_),
        sendsChecked_(ranks_, 0),
        releases_(ranks_) {
    for (int r = 0; r < ranks_; ++r) {
      opAt_[r].assign(listOf(r).size(), OpRef{});
      sameRecv_[r].assign(listOf(r).size(), -1);
      if (ranks_ > 1) indexRank(r, indexes.at(r % copies_)->peersOf(r / copies_));
      releases_[r] = sendReleasePoints(*pipelines_[r % copies_], r / copies_);
      meets_.push_back(meetMembers(r));
    }
  }

  void run() {
    for (bool progress = true; progress;) {
      progress = false;
      ++stats_.sweeps;
      for (int r = 0; r < ranks_; ++r) {
        while (!done_[r] && step(r)) progress = true;
      }
    }
    std::ostringstream blocked;
    for (int r = 0; r < ranks_; ++r) {
      if (!done_[r]) blocked << "\n  " << whyBlocked(r);
    }
    if (!blocked.str().empty()) {
      const std::string mesh =
          copies_ == 1 ? ""
                       : "; " + str(copies_) + " pipelines side by side, global rank = pipeline rank * " +
                             str(copies_) + " + (dp, tp) coordinate, every compute action a "
                             "collective of its tp (and FSDP's dp) group";
      channelProblem(schedule_, "deadlock under NCCL's rules (one in-order stream per pair of "
                                "ranks; a receive issued once its sender sent" + mesh + "):" +
                                    blocked.str());
    }
  }

  ChannelCheckStats stats() const {
    ChannelCheckStats out = stats_;
    for (int r = 0; r < ranks_; ++r) out.actions += static_cast<long>(listOf(r).size());
    return out;
  }

 private:
  struct Pair {
    std::vector<bool> isSend[2];  // per end: whether each operation is a send
    size_t reached[2] = {0, 0};  // operations each end's list has reached (queued)
    size_t issued[2] = {0, 0};   // ... issued to the stream
    size_t completed = 0;
  };
  // An action's place in its pair's stream (peer -1: not a channel operation).
  struct OpRef {
    int peer = -1;
    size_t index = 0;
  };
  static std::pair<int, int> pairKey(int r, int q) { return {std::min(r, q), std::max(r, q)}; }
  Pair& pairOf(int r, int q) { return pairs_.at(pairKey(r, q)); }
  static int side(int r, int q) { return r < q ? 0 : 1; }

  // Global rank r's list: its pipeline's list of its pipeline rank.
  const std::vector<Action>& listOf(int r) const {
    return pipelines_[r % copies_]->actions(r / copies_);
  }

  // The other global ranks whose compute actions meet r's: its tp group (same
  // pipeline rank and dp coordinate) and, with FSDP, its dp group; one meet of
  // both groups' closure (every dp x tp rank of the pipeline rank), since each
  // member's collective on one group waits for its collective on the other.
  std::vector<int> meetMembers(int r) const {
    std::vector<int> members;
    const int copy = r % copies_, base = r - copy, tp = mesh_.tensorParallel;
    for (int c = 0; c < copies_; ++c) {
      if (c != copy && (mesh_.shardedDataParallel || c / tp == copy / tp)) members.push_back(base + c);
    }
    return members;
  }

  // Whether every member of r's groups is at compute action `a` and can run it.
  bool meetReady(const Action& a, const std::vector<int>& members) {
    for (int q : members) {
      const auto& theirs = listOf(q);
      if (next_[q] >= theirs.size() || theirs[next_[q]] != a || !inputReady(q, a)) return false;
      if (!releases_[q].empty() && !sendsDone(q, releases_[q][next_[q]])) return false;
    }
    return true;
  }

  // Rank r's channel operations: their streams, its receives by key, its sends
  // (peers are pipeline ranks of r's pipeline, made global).
  void indexRank(int r, const std::map<int, std::vector<ChannelOp>>& byPeer) {
    const auto& list = listOf(r);
    for (const auto& [local, ops] : byPeer) {
      const int q = local * copies_ + r % copies_;
      auto& flags = pairs_[pairKey(r, q)].isSend[side(r, q)];
      for (size_t k = 0; k < ops.size(); ++k) {
        const int position = ops[k].position;
        opAt_[r][position] = OpRef{q, k};
        flags.push_back(ops[k].send);
        const Action& a = list[position];
        if (ops[k].send) {
          sends_[r].push_back(position);
        } else {
          auto [it, fresh] = recvsOf_[r].emplace(ActionId::of(a), position);
          if (!fresh) {
            sameRecv_[r][position] = it->second;
            it->second = position;
          }
        }
      }
    }
  }

  // Issues what each end may issue, then completes what both ends issued.
  void advance(Pair& p) {
    for (bool moved = true; moved;) {
      moved = false;
      for (int s = 0; s < 2; ++s) {
        // A receive (same index on the other end is its send) waits for the send.
        while (p.issued[s] < p.reached[s] &&
               (p.isSend[s][p.issued[s]] || p.reached[1 - s] > p.issued[s])) {
          ++p.issued[s];
          moved = true;
        }
      }
      while (p.completed < std::min(p.issued[0], p.issued[1])) {
        ++p.completed;
        moved = true;
      }
    }
  }

  // Completed: rank r's channel operation at `position`.
  bool completed(int r, int position) {
    ++stats_.lookups;
    const OpRef& op = opAt_[r].at(position);
    return pairOf(r, op.peer).completed > op.index;
  }

  // Whether every receive compute action `a` consumes has completed: RECV_F
  // feeds the F of its stage and microbatch, RECV_B its B or I.
  bool inputReady(int r, const Action& a) {
    const std::optional<ActionKind> recv = consumedRecv(a.kind);
    if (!recv) return true;
    const auto it = recvsOf_[r].find(ActionId{*recv, a.stage, a.microbatch});
    if (it == recvsOf_[r].end()) return true;
    for (int position = it->second; position >= 0; position = sameRecv_[r][position]) {
      if (!completed(r, position)) return false;
    }
    return true;
  }

  bool sendsDone(int r, const std::vector<int>& positions) {
    for (int position : positions) {
      if (!completed(r, position)) return false;
    }
    return true;
  }

  // Completion is monotone: a cursor passes each completed send once.
  bool allSendsDone(int r) {
    size_t& checked = sendsChecked_[r];
    while (checked < sends_[r].size() && completed(r, sends_[r][checked])) ++checked;
    return checked == sends_[r].size();
  }

  // Runs rank r's next action if it can; false when blocked or finished.
  bool step(int r) {
    ++stats_.steps;
    const auto& list = listOf(r);
    if (next_[r] >= list.size()) {
      if (!allSendsDone(r)) return false;
      done_[r] = true;
      return true;
    }
    const Action& a = list[next_[r]];
    if (isComm(a.kind)) {
      const OpRef& op = opAt_[r][next_[r]];
      if (op.peer < 0) {
        throw std::out_of_range("rank " + str(r) + " step " + str(static_cast<int>(next_[r])) + " (" +
                                a.toString() + "): a transfer with no other rank");
      }
      Pair& p = pairOf(r, op.peer);
      ++p.reached[side(r, op.peer)];
      advance(p);
    } else if (a.kind == ActionKind::kAllReduce) {
      const int copy = r % copies_;
      for (int local : layout_.stageRanks(a.stage)) {
        const int q = local * copies_ + copy;
        const auto& theirs = listOf(q);
        if (next_[q] >= theirs.size() || theirs[next_[q]] != a) return false;
      }
      for (int local : layout_.stageRanks(a.stage)) {
        if (local * copies_ + copy != r) ++next_[local * copies_ + copy];
      }
    } else if (isCompute(a.kind)) {
      if (!inputReady(r, a)) return false;
      if (!releases_[r].empty() && !sendsDone(r, releases_[r][next_[r]])) return false;
      if (!meets_[r].empty()) {
        if (!meetReady(a, meets_[r])) return false;
        for (int q : meets_[r]) ++next_[q];
      }
    }
    ++next_[r];
    return true;
  }

  // Every pair of r in the order (low, high), pairs without operations included.
  std::string whyBlocked(int r) {
    const auto& list = listOf(r);
    std::ostringstream out;
    out << "rank " << r << " at step " << next_[r];
    if (next_[r] >= list.size()) {
      out << " (end): waits for its sends";
    } else {
      const Action& a = list[next_[r]];
      out << " (" << a.toString() << ")";
      if (a.kind == ActionKind::kAllReduce) out << ": waits for the other replicas";
      else if (isCompute(a.kind)) out << ": waits for its input or for a send to be received";
      if (isCompute(a.kind) && !meets_[r].empty()) {
        out << ", or for its tp/dp group's collective (";
        for (size_t k = 0; k < meets_[r].size(); ++k) {
          const int q = meets_[r][k];
          out << (k ? ", " : "") << "rank " << q << " at "
              << (next_[q] < listOf(q).size() ? listOf(q)[next_[q]].toString() : "the end");
        }
        out << ")";
      }
    }
    const Pair none;
    for (int q = 0; q < ranks_; ++q) {
      if (q == r) continue;
      const auto key = pairKey(r, q);
      const auto it = pairs_.find(key);
      const Pair& p = it == pairs_.end() ? none : it->second;
      out << "; pair " << key.first << "-" << key.second << ": rank " << key.first << " issued "
          << p.issued[0] << "/" << p.reached[0] << ", rank " << key.second << " issued "
          << p.issued[1] << "/" << p.reached[1] << ", completed " << p.completed;
    }
    return out.str();
  }

  std::vector<const Schedule*> pipelines_;
  const Schedule& schedule_;
  const Layout& layout_;
  int copies_;
  MeshShape mesh_;
  int ranks_;
  std::vector<std::vector<int>> meets_;                       // per rank: meetMembers()
  std::vector<size_t> next_;
  std::vector<bool> done_;
  std::vector<std::vector<OpRef>> opAt_;                      // per rank and position
  // Per rank: a RECV's position by key, chained to the others of its key
  // through sameRecv_ (only an invalid list has several).
  std::vector<std::unordered_map<ActionId, int, ActionIdHash>> recvsOf_;
  std::vector<std::vector<int>> sameRecv_;
  std::vector<std::vector<int>> sends_;                       // per rank: SEND positions
  std::vector<size_t> sendsChecked_;                          // per rank: sends_ known completed
  std::vector<std::vector<std::vector<int>>> releases_;       // receipt points per rank
  std::map<std::pair<int, int>, Pair> pairs_;                 // pairs with operations
  ChannelCheckStats stats_;
};

}  // namespace

void validateChannels(const Schedule& ordered, bool forwardOnly) {
  validateChannels(ordered, forwardOnly, nullptr);
}

void validateChannels(const Schedule& ordered, bool forwardOnly, ChannelCheckStats* stats) {
  if (forwardOnly) {
    validateChannels(forwardProjection(ordered), false, stats);
    return;
  }
  ChannelIndex index(ordered);
  checkMirrors(ordered, index);
  ChannelSimulation simulation({&ordered}, {&index}, MeshShape{});
  simulation.run();
  if (stats != nullptr) *stats = simulation.stats();
}

void validateMeshChannels(const std::vector<Schedule>& pipelines, const MeshShape& mesh,
                          bool forwardOnly) {
  const int copies = mesh.dataParallel * mesh.tensorParallel;
  if (mesh.dataParallel < 1 || mesh.tensorParallel < 1 ||
      static_cast<int>(pipelines.size()) != copies) {
    throw std::invalid_argument("a (pp, dp=" + str(mesh.dataParallel) + ", tp=" +
                                str(mesh.tensorParallel) + ") mesh runs " + str(copies) +
                                " pipelines (one per (dp, tp) coordinate), got " +
                                str(static_cast<int>(pipelines.size())));
  }
  std::vector<Schedule> projected;
  for (const Schedule& p : pipelines) {
    if (!(p.layout() == pipelines[0].layout())) {
      throw std::invalid_argument("the mesh's pipelines place their stages differently ('" +
                                  p.name() + "' and '" + pipelines[0].name() + "')");
    }
    projected.push_back(forwardOnly ? forwardProjection(p) : p);
  }
  std::vector<std::unique_ptr<ChannelIndex>> indexes;
  std::vector<const Schedule*> lists;
  std::vector<ChannelIndex*> byCopy;
  for (int c = 0; c < copies; ++c) {
    indexes.push_back(std::make_unique<ChannelIndex>(projected[c]));
    try {
      checkMirrors(projected[c], *indexes.back());
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument("the pipeline of mesh coordinate (dp " + str(c / mesh.tensorParallel) +
                                  ", tp " + str(c % mesh.tensorParallel) + "): " + e.what());
    }
    lists.push_back(&projected[c]);
    byCopy.push_back(indexes.back().get());
  }
  ChannelSimulation simulation(lists, byCopy, mesh);
  simulation.run();
}

std::string channelsToText(const Schedule& ordered) {
  ChannelIndex index(ordered);
  return channelsText(ordered, index);
}

}  // namespace pipedream
