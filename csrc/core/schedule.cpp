#include "schedule.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

namespace pipedream {

// ---------------------------------------------------------------- Layout --

Layout Layout::straight(int stages, const std::vector<int>& replicas) {
  if (stages < 1) {
    throw std::invalid_argument("stages must be >= 1 (got " + std::to_string(stages) + ")");
  }
  if (!replicas.empty() && static_cast<int>(replicas.size()) != stages) {
    throw std::invalid_argument(
        "replicas lists " + std::to_string(replicas.size()) + " counts for " +
        std::to_string(stages) + " stages; give one replica count per stage");
  }
  Layout layout;
  int rank = 0;
  for (int j = 0; j < stages; ++j) {
    const int count = replicas.empty() ? 1 : replicas[j];
    if (count < 1) {
      throw std::invalid_argument("replica count of stage " + std::to_string(j) +
                                  " must be >= 1 (got " + std::to_string(count) + ")");
    }
    std::vector<int> ranks;
    for (int c = 0; c < count; ++c) ranks.push_back(rank++);
    layout.stageRanks_.push_back(ranks);
  }
  layout.numRanks_ = rank;
  return layout;
}

const char* chunkPlacementName(ChunkPlacement placement) {
  return placement == ChunkPlacement::kV ? "v" : "round_robin";
}

Layout Layout::interleaved(int ranks, int chunks) {
  return chunked(ranks, chunks, ChunkPlacement::kRoundRobin);
}

Layout Layout::chunked(int ranks, int chunks, ChunkPlacement placement) {
  if (ranks < 1) {
    throw std::invalid_argument("stages must be >= 1 (got " + std::to_string(ranks) + ")");
  }
  if (chunks < 1) {
    throw std::invalid_argument("chunks must be >= 1 (got " + std::to_string(chunks) + ")");
  }
  Layout layout;
  layout.numRanks_ = ranks;
  for (int j = 0; j < ranks * chunks; ++j) {
    const int c = j / ranks;  // chunk
    const bool up = placement == ChunkPlacement::kV && c % 2 == 1;
    layout.stageRanks_.push_back({up ? ranks - 1 - j % ranks : j % ranks});
  }
  return layout;
}

int Layout::replicas(int stage) const {
  return static_cast<int>(stageRanks(stage).size());
}

const std::vector<int>& Layout::stageRanks(int stage) const {
  if (stage < 0 || stage >= numStages()) {
    throw std::out_of_range("stage " + std::to_string(stage) + " is out of range [0, " +
                            std::to_string(numStages()) + ")");
  }
  return stageRanks_[stage];
}

int Layout::rankFor(int stage, int microbatch) const {
  const auto& ranks = stageRanks(stage);
  return ranks[microbatch % static_cast<int>(ranks.size())];
}

std::vector<int> Layout::stagesOfRank(int rank) const {
  std::vector<int> stages;
  for (int j = 0; j < numStages(); ++j) {
    const auto& ranks = stageRanks_[j];
    if (std::find(ranks.begin(), ranks.end(), rank) != ranks.end()) stages.push_back(j);
  }
  return stages;
}

int Layout::replicaIndex(int stage, int rank) const {
  const auto& ranks = stageRanks(stage);
  auto it = std::find(ranks.begin(), ranks.end(), rank);
  return it == ranks.end() ? -1 : static_cast<int>(it - ranks.begin());
}

std::vector<int> Layout::replicaCounts() const {
  std::vector<int> counts;
  for (const auto& ranks : stageRanks_) counts.push_back(static_cast<int>(ranks.size()));
  return counts;
}

// -------------------------------------------------------------- Schedule --

Schedule::Schedule(std::string name, Layout layout, int microbatches,
                   std::vector<std::vector<Action>> rankActions, int batches)
    : name_(std::move(name)),
      layout_(std::move(layout)),
      microbatches_(microbatches),
      batches_(batches),
      rankActions_(std::move(rankActions)) {
  if (static_cast<int>(rankActions_.size()) != layout_.numRanks()) {
    throw std::invalid_argument("schedule has action lists for " +
                                std::to_string(rankActions_.size()) + " ranks but its layout has " +
                                std::to_string(layout_.numRanks()) + " ranks");
  }
}

const std::vector<Action>& Schedule::actions(int rank) const {
  if (rank < 0 || rank >= numRanks()) {
    throw std::out_of_range("rank " + std::to_string(rank) + " is out of range [0, " +
                            std::to_string(numRanks()) + ")");
  }
  return rankActions_[rank];
}

bool Schedule::isLowered() const {
  for (const auto& list : rankActions_) {
    for (const auto& action : list) {
      if (isComm(action.kind)) return true;
    }
  }
  return false;
}

std::string Schedule::toText() const {
  std::string out;
  for (int r = 0; r < numRanks(); ++r) {
    out += "rank " + std::to_string(r) + ": " + actionsToString(rankActions_[r]) + "\n";
  }
  return out;
}

std::string formatGrid(const std::vector<std::vector<Action>>& rankActions, int markRank,
                       int markStep) {
  size_t steps = 0;
  size_t width = 4;
  for (const auto& list : rankActions) {
    steps = std::max(steps, list.size());
    for (const auto& action : list) width = std::max(width, action.toString().size() + 4);
  }
  auto pad = [](std::string text, size_t w) {
    if (text.size() < w) text.append(w - text.size(), ' ');
    return text;
  };
  std::ostringstream out;
  out << pad("step", 8);
  for (size_t k = 0; k < steps; ++k) out << pad(std::to_string(k), width);
  out << "\n";
  for (size_t r = 0; r < rankActions.size(); ++r) {
    out << pad("rank " + std::to_string(r), 8);
    for (size_t k = 0; k < steps; ++k) {
      std::string cell;
      if (k < rankActions[r].size()) {
        cell = rankActions[r][k].toString();
        if (static_cast<int>(r) == markRank && static_cast<int>(k) == markStep) {
          cell = ">>" + cell + "<<";
        }
      }
      out << pad(cell, width);
    }
    out << "\n";
  }
  std::string text = out.str();
  // Trim trailing spaces on every line.
  std::string trimmed;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    line.erase(line.find_last_not_of(' ') + 1);
    trimmed += line + "\n";
  }
  return trimmed;
}

std::string Schedule::grid(int markRank, int markStep) const {
  return formatGrid(rankActions_, markRank, markStep);
}

std::string Schedule::toCsv() const {
  std::string out;
  for (const auto& list : rankActions_) {
    for (size_t k = 0; k < list.size(); ++k) {
      if (k > 0) out += ',';
      out += list[k].toString();
    }
    out += "\n";
  }
  return out;
}

Schedule Schedule::withActions(std::vector<std::vector<Action>> rankActions) const {
  return Schedule(name_, layout_, microbatches_, std::move(rankActions), batches_);
}

Schedule Schedule::withActionsFromText(const std::string& text) const {
  std::vector<std::vector<Action>> lists;
  std::istringstream in(text);
  std::string line;
  int lineNo = 0;
  while (std::getline(in, line)) {
    ++lineNo;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string prefix = "rank " + std::to_string(lists.size()) + ":";
    if (line.compare(0, prefix.size(), prefix) != 0) {
      throw std::invalid_argument("schedule text line " + std::to_string(lineNo) +
                                  " must start with '" + prefix + "' (got '" + line + "')");
    }
    try {
      lists.push_back(parseActions(line.substr(prefix.size())));
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument("schedule text line " + std::to_string(lineNo) + ": " +
                                  e.what());
    }
  }
  return withActions(std::move(lists));
}

Schedule Schedule::withActionsFromCsv(const std::string& csv) const {
  std::vector<std::vector<Action>> lists;
  std::istringstream in(csv);
  std::string line;
  int lineNo = 0;
  while (std::getline(in, line)) {
    ++lineNo;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    try {
      lists.push_back(parseActions(line));
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument("schedule CSV line " + std::to_string(lineNo) + ": " +
                                  e.what());
    }
  }
  // A trailing empty line would be an extra (empty) rank; drop empty tail
  // rows beyond the layout's rank count.
  while (static_cast<int>(lists.size()) > numRanks() && lists.back().empty()) lists.pop_back();
  return withActions(std::move(lists));
}

}  // namespace pipedream
