// The search space of configure.h unrolled into points (mesh, schedule,
// chunks, microbatches) and the one order both the search and the
// enumeration rank configurations by. Internal to csrc/core.
#pragma once

#include <array>
#include <string>
#include <vector>

#include "configure.h"
#include "configure_model.h"

namespace pipedream {

// One (mesh, schedule, chunks, microbatches) of a space; balance and
// recompute are chosen inside it.
struct SpacePoint {
  int meshIndex = 0;
  std::array<int, 3> mesh = {1, 1, 1};
  int scheduleIndex = 0;
  std::string schedule;
  bool multiChunk = false;
  int chunks = 1;
  int microbatches = 1;
  int stages() const { return mesh[0] * chunks; }
};

// Throws std::invalid_argument naming the bad value of `space`.
void checkSpace(const std::vector<LayerCost>& layers, const MachineCosts& machine,
                const SearchSpace& space);

// Every point of `space` whose stage count fits the layers (and a fixed
// balance or recompute list, when given), in the tie order.
std::vector<SpacePoint> spacePoints(const std::vector<LayerCost>& layers, const SearchSpace& space);

PointOptions pointOptions(const SpacePoint& point, const SearchSpace& space);

// A scored configuration and what ranks it.
struct Ranked {
  Configuration config;
  SpacePoint point;
  double peak = 0.0;  // the largest peak bytes of a rank
};

Ranked ranked(const SpacePoint& point, const std::vector<int>& balance,
              const std::vector<int>& recompute, Prediction prediction);

// The order of configure.h: configurations that fit first, then the lower
// step time (the lower peak when neither fits), then fewer stages, the
// order of space.schedules, fewer microbatches, the order of space.meshes,
// fewer chunks, the lexicographically smaller balance and recompute.
bool better(const Ranked& a, const Ranked& b);

// The recompute lists `space` allows at `point`: 0/1 per stage (per rank of
// a multi-chunk schedule under RecomputeChoice::kSearch).
std::vector<std::vector<int>> recomputeChoices(const SpacePoint& point, const PointModel& model,
                                               const SearchSpace& space);

// Per point, the best configuration found, turned into a SearchResult: the
// best one and up to space.candidates runners-up that fit, each with the
// space's ep.
SearchResult resultOf(std::vector<Ranked> pointBests, int candidates, long long evaluated,
                      long long pruned, int ep);

}  // namespace pipedream
