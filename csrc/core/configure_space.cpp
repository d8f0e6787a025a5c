#include "configure_space.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <tuple>

#include "configure_model.h"
#include "generators.h"
#include "traits.h"

namespace pipedream {

namespace {

std::string str(int value) { return std::to_string(value); }

using configure_detail::fail;
using configure_detail::joined;

void checkMeshes(const SearchSpace& space) {
  for (const auto& mesh : space.meshes) {
    if (mesh[0] < 1 || mesh[1] < 1 || mesh[2] < 1 ||
        static_cast<long long>(mesh[0]) * mesh[1] * mesh[2] != space.worldSize) {
      fail("mesh (" + str(mesh[0]) + ", " + str(mesh[1]) + ", " + str(mesh[2]) +
           ") must be >= 1 each with pp * dp * tp = world_size " + str(space.worldSize));
    }
  }
}

void checkFixedLists(const std::vector<LayerCost>& layers, const SearchSpace& space) {
  const int layerCount = static_cast<int>(layers.size());
  if (!space.balance.empty() &&
      (std::accumulate(space.balance.begin(), space.balance.end(), 0) != layerCount ||
       *std::min_element(space.balance.begin(), space.balance.end()) < 1)) {
    fail("balance " + joined(space.balance) + " must be >= 1 per stage and sum to the " +
         str(layerCount) + " layers");
  }
  for (int v : space.recomputeStages) {
    if (v != 0 && v != 1) {
      fail("recompute_stages " + joined(space.recomputeStages) + " must be 0 or 1 per stage");
    }
  }
}

}  // namespace

void checkSpace(const std::vector<LayerCost>& layers, const MachineCosts& machine,
                const SearchSpace& space) {
  checkLayers(layers);
  checkMachine(machine);
  checkMemoryArguments(space.memoryBytes, space.optimizerStateFactor);
  if (space.worldSize < 1) fail("world_size must be >= 1 (got " + str(space.worldSize) + ")");
  if (space.batchSize < 1) fail("batch_size must be >= 1 (got " + str(space.batchSize) + ")");
  if (space.schedules.empty()) fail("schedules is empty; name at least one schedule");
  for (const auto& name : space.schedules) scheduleTraits(name);
  if (space.microbatches.empty()) fail("microbatches is empty; give at least one count");
  for (int m : space.microbatches) {
    if (m < 1 || m > space.batchSize) {
      fail("microbatches " + joined(space.microbatches) + " must be in 1.." +
           str(space.batchSize) + " (every microbatch needs a sample of the batch; got " + str(m) +
           ")");
    }
  }
  for (int v : space.interleavedChunks) {
    if (v < 2) fail("interleaved_chunks " + joined(space.interleavedChunks) + " must be >= 2 each");
  }
  checkMeshes(space);
  for (const auto& mesh : space.meshes) checkExpertParallel(space.ep, mesh[1], mesh[2]);
  if (space.meshes.empty()) checkExpertParallel(space.ep, 1, 1);
  checkFixedLists(layers, space);
  if (space.candidates < 0) fail("candidates must be >= 0 (got " + str(space.candidates) + ")");
}

std::vector<SpacePoint> spacePoints(const std::vector<LayerCost>& layers, const SearchSpace& space) {
  std::vector<std::array<int, 3>> meshes = space.meshes;
  if (meshes.empty()) meshes.push_back({space.worldSize, 1, 1});
  std::vector<SpacePoint> points;
  for (size_t x = 0; x < meshes.size(); ++x) {
    for (size_t s = 0; s < space.schedules.size(); ++s) {
      const ScheduleTraits& traits = scheduleTraits(space.schedules[s]);
      std::vector<int> chunkCounts = {1};
      if (traits.fixedChunks > 0) {
        chunkCounts = {traits.fixedChunks};
      } else if (traits.multiChunk) {
        chunkCounts = space.interleavedChunks;
      }
      for (int v : chunkCounts) {
        for (int m : space.microbatches) {
          SpacePoint p;
          p.meshIndex = static_cast<int>(x);
          p.mesh = meshes[x];
          p.scheduleIndex = static_cast<int>(s);
          p.schedule = space.schedules[s];
          p.multiChunk = traits.multiChunk;
          p.chunks = v;
          p.microbatches = m;
          const int stages = p.stages();
          if (stages > static_cast<int>(layers.size())) continue;
          if (!space.balance.empty() && static_cast<int>(space.balance.size()) != stages) continue;
          if (!space.recomputeStages.empty() &&
              static_cast<int>(space.recomputeStages.size()) != stages) {
            continue;
          }
          points.push_back(p);
        }
      }
    }
  }
  return points;
}

PointOptions pointOptions(const SpacePoint& point, const SearchSpace& space) {
  PointOptions o;
  o.schedule = point.schedule;
  o.chunks = point.chunks;
  o.microbatches = point.microbatches;
  o.pp = point.mesh[0];
  o.dp = point.mesh[1];
  o.tp = point.mesh[2];
  o.ep = space.ep;
  o.memoryBytes = space.memoryBytes;
  o.optimizerStateFactor = space.optimizerStateFactor;
  o.fsdp = space.fsdp;
  return o;
}

Ranked ranked(const SpacePoint& point, const std::vector<int>& balance,
              const std::vector<int>& recompute, Prediction prediction) {
  Ranked r;
  r.point = point;
  r.config.schedule = point.schedule;
  r.config.chunks = point.chunks;
  r.config.microbatches = point.microbatches;
  r.config.pp = point.mesh[0];
  r.config.dp = point.mesh[1];
  r.config.tp = point.mesh[2];
  r.config.balance = balance;
  r.config.recompute = recompute.empty() ? std::vector<int>(balance.size(), 0) : recompute;
  for (double bytes : prediction.peakBytes) r.peak = std::max(r.peak, bytes);
  r.config.prediction = std::move(prediction);
  return r;
}

bool better(const Ranked& a, const Ranked& b) {
  const Prediction& pa = a.config.prediction;
  const Prediction& pb = b.config.prediction;
  if (pa.fits != pb.fits) return pa.fits;
  if (!pa.fits && a.peak != b.peak) return a.peak < b.peak;
  if (pa.stepSeconds != pb.stepSeconds) return pa.stepSeconds < pb.stepSeconds;
  const auto key = [](const Ranked& r) {
    return std::make_tuple(r.point.stages(), r.point.scheduleIndex, r.point.microbatches,
                           r.point.meshIndex, r.point.chunks);
  };
  if (key(a) != key(b)) return key(a) < key(b);
  if (a.config.balance != b.config.balance) return a.config.balance < b.config.balance;
  return a.config.recompute < b.config.recompute;
}

std::vector<std::vector<int>> recomputeChoices(const SpacePoint& point, const PointModel& model,
                                               const SearchSpace& space) {
  const int stages = model.stages();
  if (!space.recomputeStages.empty()) return {space.recomputeStages};
  if (space.recompute == RecomputeChoice::kNever) return {std::vector<int>(stages, 0)};
  if (space.recompute == RecomputeChoice::kAlways) return {std::vector<int>(stages, 1)};
  // kSearch: one bit per stage, or per rank when a rank holds several stages.
  const int units = point.multiChunk ? model.ranks() : stages;
  if (units > 20) fail("recompute='search' over " + str(units) + " stages is too many to enumerate");
  std::vector<std::vector<int>> out;
  for (long long mask = 0; mask < (1LL << units); ++mask) {
    std::vector<int> choice(stages);
    for (int j = 0; j < stages; ++j) {
      const int unit = point.multiChunk ? model.rankOf(j) : j;
      choice[j] = static_cast<int>((mask >> unit) & 1);
    }
    out.push_back(std::move(choice));
  }
  return out;
}

SearchResult resultOf(std::vector<Ranked> pointBests, int candidates, long long evaluated,
                      long long pruned, int ep) {
  for (Ranked& r : pointBests) r.config.ep = ep;
  SearchResult result;
  result.evaluated = evaluated;
  result.pruned = pruned;
  std::sort(pointBests.begin(), pointBests.end(), better);
  result.best = pointBests.front().config;
  result.feasible = result.best.prediction.fits;
  if (!result.feasible) return result;
  for (size_t k = 1; k < pointBests.size() && static_cast<int>(k) <= candidates; ++k) {
    if (!pointBests[k].config.prediction.fits) break;
    result.candidates.push_back(pointBests[k].config);
  }
  return result;
}

// --- enumerateConfigurations ---------------------------------------------------

namespace {

// Calls visit(balance) for every composition of `layers` into `stages` parts.
template <typename Visit>
void compositions(int layers, int stages, std::vector<int>& prefix, Visit& visit) {
  if (stages == 1) {
    prefix.push_back(layers);
    visit(prefix);
    prefix.pop_back();
    return;
  }
  for (int first = 1; first <= layers - (stages - 1); ++first) {
    prefix.push_back(first);
    compositions(layers - first, stages - 1, prefix, visit);
    prefix.pop_back();
  }
}

}  // namespace

SearchResult enumerateConfigurations(const std::vector<LayerCost>& layers,
                                     const MachineCosts& machine, const SearchSpace& space) {
  checkSpace(layers, machine, space);
  std::vector<Ranked> pointBests;
  long long evaluated = 0;
  std::string refusal;
  for (const SpacePoint& point : spacePoints(layers, space)) {
    std::unique_ptr<PointModel> model;
    try {
      model = std::make_unique<PointModel>(layers, space.batchSize, machine,
                                           pointOptions(point, space));
    } catch (const std::invalid_argument& e) {
      if (refusal.empty()) refusal = e.what();
      continue;
    }
    const auto choices = recomputeChoices(point, *model, space);
    bool any = false;
    Ranked best;
    auto visit = [&](const std::vector<int>& balance) {
      for (const auto& recompute : choices) {
        Ranked r = ranked(point, balance, recompute, model->predict(balance, recompute));
        ++evaluated;
        if (!any || better(r, best)) best = std::move(r);
        any = true;
      }
    };
    std::vector<int> prefix;
    if (space.balance.empty()) {
      compositions(static_cast<int>(layers.size()), point.stages(), prefix, visit);
    } else {
      visit(space.balance);
    }
    if (any) pointBests.push_back(std::move(best));
  }
  if (pointBests.empty()) {
    fail("no configuration of the space can run: every (mesh, schedule, chunks, microbatches) "
         "needs more stages than the " + str(static_cast<int>(layers.size())) +
         " layers, does not match the fixed balance or recompute list, or the schedule refuses it" +
         (refusal.empty() ? std::string() : " (" + refusal + ")"));
  }
  return resultOf(std::move(pointBests), space.candidates, evaluated, 0, space.ep);
}

}  // namespace pipedream
