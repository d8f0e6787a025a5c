// A pipeline schedule as data: the placement of stages on ranks (Layout) and,
// for every rank, an ordered list of typed actions (Schedule).
//
// Placement:
//   - straight pipeline: stage j lives on rank j;
//   - interleaved (v chunks per rank, p ranks): virtual stage j lives on rank
//     j mod p, so rank r holds stages r, r+p, ..., r+(v-1)p;
//   - V (zero-bubble ZB-V, DualPipeV; 2 chunks per rank, 2p stages): chunk 0
//     goes down the ranks and chunk 1 comes back up, stage j on rank j for
//     j < p and on rank 2p-1-j otherwise, so rank r holds r and 2p-1-r (rank
//     p-1 holds the turn, p-1 and p; rank 0 the first and the last stage).
//     More chunks zigzag the same way (chunk c goes up when c is odd);
//   - replicated stages (replica counts R = r_0, r_1, ...): stage j occupies
//     r_j consecutive ranks, and microbatch i runs on replica i mod r_j of
//     stage j (round robin), forward and backward alike.
#pragma once

#include <string>
#include <vector>

#include "action.h"

namespace pipedream {

// How chunks (virtual stages) are placed on ranks: chunk c of p ranks holds
// stages c*p .. c*p + p-1, on ranks 0..p-1 (round robin) or, for odd c under
// kV, on ranks p-1..0.
enum class ChunkPlacement {
  kRoundRobin,  // stage j on rank j mod p (Megatron-LM's interleaving)
  kV,           // ZB-V / DualPipeV: stage j on rank j mod p for even chunks,
                // p-1 - (j mod p) for odd ones
};

// "round_robin" / "v".
const char* chunkPlacementName(ChunkPlacement placement);

class Layout {
 public:
  // One stage per rank, or replicated stages when `replicas` is non-empty
  // (its size must equal `stages`).
  static Layout straight(int stages, const std::vector<int>& replicas = {});
  // `ranks` ranks, `chunks` virtual stages per rank, stage j on rank j % ranks.
  static Layout interleaved(int ranks, int chunks);
  // `ranks` ranks, `chunks` virtual stages per rank, placed as `placement` says.
  static Layout chunked(int ranks, int chunks, ChunkPlacement placement);

  int numRanks() const { return numRanks_; }
  int numStages() const { return static_cast<int>(stageRanks_.size()); }
  int replicas(int stage) const;
  const std::vector<int>& stageRanks(int stage) const;
  // The rank that runs microbatch i of stage j (round robin over replicas).
  int rankFor(int stage, int microbatch) const;
  // Stages held by a rank, ascending.
  std::vector<int> stagesOfRank(int rank) const;
  // The replica index of `rank` within `stage` (-1 if it does not hold it).
  int replicaIndex(int stage, int rank) const;
  std::vector<int> replicaCounts() const;

  bool operator==(const Layout& other) const {
    return numRanks_ == other.numRanks_ && stageRanks_ == other.stageRanks_;
  }

 private:
  int numRanks_ = 0;
  std::vector<std::vector<int>> stageRanks_;  // stage -> ranks (replica order)
};

// Per-rank action lists plus the metadata that gives them meaning.
class Schedule {
 public:
  Schedule() = default;
  // `microbatches` per batch; microbatch ids run over [0, microbatches *
  // batches).
  Schedule(std::string name, Layout layout, int microbatches,
           std::vector<std::vector<Action>> rankActions, int batches = 1);

  const std::string& name() const { return name_; }
  const Layout& layout() const { return layout_; }
  int numRanks() const { return layout_.numRanks(); }
  int numStages() const { return layout_.numStages(); }
  int microbatches() const { return microbatches_; }
  int batches() const { return batches_; }
  int totalMicrobatches() const { return microbatches_ * batches_; }
  const std::vector<Action>& actions(int rank) const;
  const std::vector<std::vector<Action>>& allActions() const { return rankActions_; }
  // Whether SEND/RECV actions are present (set by lower()).
  bool isLowered() const;

  // One line per rank: "rank 0: 0F0 0F1 0B0 ...".
  std::string toText() const;
  // Rank-by-step grid. `mark` (rank, step) is drawn as ">>ACTION<<"
  // (used by the validator to point at an offending action).
  std::string grid(int markRank = -1, int markStep = -1) const;
  // One row per rank, one cell per action (torch.distributed.pipelining's
  // CSV layout).
  std::string toCsv() const;

  // Replaces the action lists with the ones in `text` (the toText() form or
  // the toCsv() form), keeping name and layout. Throws std::invalid_argument
  // naming the line and the bad token.
  Schedule withActionsFromText(const std::string& text) const;
  Schedule withActionsFromCsv(const std::string& csv) const;
  Schedule withActions(std::vector<std::vector<Action>> rankActions) const;

 private:
  std::string name_;
  Layout layout_;
  int microbatches_ = 0;
  int batches_ = 1;
  std::vector<std::vector<Action>> rankActions_;
};

// Renders a rank-by-step grid of arbitrary per-rank lists.
std::string formatGrid(const std::vector<std::vector<Action>>& rankActions,
                       int markRank = -1, int markStep = -1);

}  // namespace pipedream
