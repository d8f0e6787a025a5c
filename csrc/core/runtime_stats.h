// What one rank's runtime did: the one schema the executor reports, Python
// reads (pipe.stats()) and benchmarks merge. Torch-free so that merging is
// unit-tested with the core.
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace pipedream {

struct RuntimeStats {
  double computeSeconds = 0;  // F/B/I/W (and recomputation), U callbacks
  double waitSeconds = 0;     // blocked on peers: receives, sends, all-reduces
  double busySeconds = 0;     // wall time inside run*() / waitSends()
  int64_t actions = 0;        // actions executed
  int64_t steps = 0;          // run*() calls
  std::map<std::string, double> secondsByKind;  // "F", "B", "RECV_F" (waits), "SEND_WAIT", ...
  int64_t bytesSent = 0;      // tensor bytes (not headers or padding)
  int64_t bytesReceived = 0;
  int64_t sends = 0;          // transfers
  int64_t receives = 0;
  int64_t messagesSent = 0;       // messages on the wire (data and side channel)
  int64_t prePostedReceives = 0;  // receives whose data was posted before their consumer waited
  int64_t redirectedSends = 0;    // sends too large for the slot's capacity (payload on the side)
  int64_t paddingBytes = 0;       // capacity sent beyond what transfers needed
  int64_t hostSyncs = 0;          // device-to-host copies the communication made
  int64_t peakActivations = 0;    // most microbatches stashed at once
  int64_t peakSendsInFlight = 0;  // most sends held at once (their buffers live)
  std::map<int, int64_t> peakWeightVersions;  // per local stage (weight stashing only)
  int64_t weightBytesCopied = 0;  // weight stores' snapshot copies
  int64_t overlapYields = 0;      // turns an F&B pair's halves passed (csrc/runtime/overlap.h)

  // 1 - compute / busy: the share of the runtime's time with no work; 0 when
  // nothing ran.
  double bubbleFraction() const { return busySeconds > 0 ? 1.0 - computeSeconds / busySeconds : 0.0; }

  // Counters and times add; peaks (and each stage's peak versions) take the
  // maximum; secondsByKind adds per kind.
  RuntimeStats merge(const RuntimeStats& other) const;

  // A copy with `seconds` the step waited outside the executor (the tied
  // weights' all-reduce, where the first rank to finish waits for the last):
  // they add to secondsByKind[kind], waitSeconds and busySeconds alike.
  RuntimeStats withWait(const std::string& kind, double seconds) const;
};

}  // namespace pipedream
