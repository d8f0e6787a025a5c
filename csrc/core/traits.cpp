#include "traits.h"

namespace pipedream {

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
