#include "runtime_stats.h"

#include <algorithm>

namespace pipedream {

RuntimeStats RuntimeStats::merge(const RuntimeStats& other) const {
  RuntimeStats out = *this;
  out.computeSeconds += other.computeSeconds;
  out.waitSeconds += other.waitSeconds;
  out.busySeconds += other.busySeconds;
  out.actions += other.actions;
  out.steps += other.steps;
  for (const auto& [kind, seconds] : other.secondsByKind) out.secondsByKind[kind] += seconds;
  out.bytesSent += other.bytesSent;
  out.bytesReceived += other.bytesReceived;
  out.sends += other.sends;
  out.receives += other.receives;
  out.messagesSent += other.messagesSent;
  out.prePostedReceives += other.prePostedReceives;
  out.redirectedSends += other.redirectedSends;
  out.paddingBytes += other.paddingBytes;
  out.hostSyncs += other.hostSyncs;
  out.peakActivations = std::max(out.peakActivations, other.peakActivations);
  out.peakSendsInFlight = std::max(out.peakSendsInFlight, other.peakSendsInFlight);
  for (const auto& [stage, versions] : other.peakWeightVersions) {
    auto& mine = out.peakWeightVersions[stage];
    mine = std::max(mine, versions);
  }
  out.weightBytesCopied += other.weightBytesCopied;
  out.overlapYields += other.overlapYields;
  return out;
}

RuntimeStats RuntimeStats::withWait(const std::string& kind, double seconds) const {
  RuntimeStats out = *this;
  out.secondsByKind[kind] += seconds;
  out.waitSeconds += seconds;
  out.busySeconds += seconds;
  return out;
}

}  // namespace pipedream
