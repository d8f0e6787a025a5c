#include "traits.h"

#include <stdexcept>

namespace pipedream {

namespace {

std::vector<ScheduleTraits> makeTable() {
  std::vector<ScheduleTraits> table;

  ScheduleTraits gpipe;
  gpipe.name = "gpipe";
  gpipe.supportsReplicas = true;
  table.push_back(gpipe);

  ScheduleTraits oneFOneB = gpipe;
  oneFOneB.name = "1f1b";
  table.push_back(oneFOneB);

  ScheduleTraits interleaved;
  interleaved.name = "interleaved-1f1b";
  interleaved.multiChunk = true;
  interleaved.plannerStraight = true;
  table.push_back(interleaved);

  ScheduleTraits zb;
  zb.name = "zb-h1";
  zb.splitBackward = true;
  zb.supportsReplicas = true;  // one lane per replica (generators.cpp zbH1Batch)
  zb.plannerStraight = true;
  table.push_back(zb);

  // Zero-bubble schedules with several chunks per rank (I/W split): ZB-V and
  // DualPipeV place exactly 2 chunks per rank in a V, interleaved-zb round robin.
  ScheduleTraits zbv = zb;
  zbv.name = "zbv";
  zbv.multiChunk = true;
  zbv.fixedChunks = 2;
  zbv.chunkPlacement = ChunkPlacement::kV;
  zbv.supportsReplicas = false;
  table.push_back(zbv);

  ScheduleTraits dualPipeV = zbv;
  dualPipeV.name = "dualpipev";
  table.push_back(dualPipeV);

  ScheduleTraits interleavedZb = zb;
  interleavedZb.name = "interleaved-zb";
  interleavedZb.multiChunk = true;
  interleavedZb.supportsReplicas = false;
  table.push_back(interleavedZb);

  ScheduleTraits pipedream;
  pipedream.name = "pipedream";
  pipedream.asynchronous = true;
  pipedream.updateRule = UpdateRule::kPerMinibatch;
  pipedream.replicaReduction = ReplicaReduction::kMean;
  pipedream.supportsReplicas = true;
  pipedream.stashWeights = true;
  pipedream.streaming = true;
  pipedream.supportsVerticalSync = true;
  table.push_back(pipedream);

  ScheduleTraits twoBw;
  twoBw.name = "pipedream-2bw";
  twoBw.asynchronous = true;
  twoBw.updateRule = UpdateRule::kPerBatch;
  twoBw.supportsReplicas = true;
  twoBw.stashWeights = true;
  twoBw.streaming = true;
  twoBw.plannerTwoVersions = true;
  table.push_back(twoBw);

  return table;
}

}  // namespace

const std::vector<ScheduleTraits>& allScheduleTraits() {
  static const std::vector<ScheduleTraits> table = makeTable();
  return table;
}

const ScheduleTraits& scheduleTraits(const std::string& name) {
  for (const auto& traits : allScheduleTraits()) {
    if (traits.name == name) return traits;
  }
  std::string list;
  for (const auto& traits : allScheduleTraits()) list += (list.empty() ? "" : ", ") + traits.name;
  throw std::invalid_argument("unknown schedule '" + name + "'; choose one of: " + list);
}

const char* updateRuleName(UpdateRule rule) {
  switch (rule) {
    case UpdateRule::kCallerPerBatch:
      return "caller_per_batch";
    case UpdateRule::kPerMinibatch:
      return "per_minibatch";
    case UpdateRule::kPerBatch:
      return "per_batch";
  }
  return "?";
}

const char* replicaReductionName(ReplicaReduction reduction) {
  return reduction == ReplicaReduction::kMean ? "mean" : "sum";
}

}  // namespace pipedream
