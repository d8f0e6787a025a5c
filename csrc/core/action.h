// Typed pipeline actions and their compact text form.
//
// Index legend used throughout csrc/core:
//   i  microbatch (for asynchronous schedules: minibatch) index
//   j  stage index (a *virtual* stage for interleaved schedules)
//   r  rank (one worker process)
//   k  clock / step position in a rank's action list
//   v  weight version (0 = initial weights; UPDATE number n creates version n)
//
// Text form (follows torch.distributed.pipelining, plus U and versions):
//   "2F0"        stage 2, forward of microbatch 0, reading weight version 0
//   "1B3v2"      stage 1, full backward of microbatch 3, reading version 2
//   "0I2" "0W2"  stage 0, input-gradient / weight-gradient half of a backward
//   "3SEND_F1"   stage 3 sends the forward output of microbatch 1 to stage 4
//   "1RECV_B0"   stage 1 receives the gradient of microbatch 0 from stage 2
//   "0U3"        stage 0 optimizer step that creates weight version 3
//   "0ALLREDUCE3" gradient all-reduce among the replicas of stage 0, feeding
//                the UPDATE that creates version 3
// The "vN" suffix is printed only when the version is non-zero, so flush
// schedules read exactly like torch.distributed.pipelining's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace pipedream {

enum class ActionKind {
  kForward,         // F
  kBackward,        // B (input and weight gradient together)
  kBackwardInput,   // I (input gradient only; zero-bubble)
  kBackwardWeight,  // W (weight gradient only; zero-bubble)
  kSendForward,     // SEND_F
  kRecvForward,     // RECV_F
  kSendBackward,    // SEND_B
  kRecvBackward,    // RECV_B
  kUpdate,          // U
  kAllReduce,       // ALLREDUCE
};

// Short text token of a kind: "F", "B", "I", "W", "SEND_F", ..., "U",
// "ALLREDUCE".
const char* kindToken(ActionKind kind);

bool isCompute(ActionKind kind);        // F, B, I, W
bool isBackwardLike(ActionKind kind);   // B, I, W
bool isComm(ActionKind kind);           // SEND_*, RECV_*
// Kinds that carry a version instead of a microbatch (U, ALLREDUCE).
bool isVersionOnly(ActionKind kind);

struct Action {
  int stage = 0;
  ActionKind kind = ActionKind::kForward;
  // Microbatch for compute and communication actions; -1 for U/ALLREDUCE.
  int microbatch = 0;
  // Compute actions: the weight version read. U/ALLREDUCE: the version the
  // update creates. Communication actions: always 0.
  int version = 0;

  static Action compute(int stage, ActionKind kind, int microbatch,
                        int version = 0);
  static Action comm(int stage, ActionKind kind, int microbatch);
  static Action update(int stage, int newVersion);
  static Action allReduce(int stage, int newVersion);

  // Compact text form, e.g. "1B3v2", "0SEND_F4", "2U1".
  std::string toString() const;
  // Inverse of toString(). Throws std::invalid_argument naming the text.
  static Action parse(const std::string& text);

  bool operator==(const Action& other) const {
    return stage == other.stage && kind == other.kind &&
           microbatch == other.microbatch && version == other.version;
  }
  bool operator!=(const Action& other) const { return !(*this == other); }
};

// An action without its version: (kind, stage, microbatch), unique within a
// valid lowered list. Hashable (ActionIdHash), so the passes over whole
// schedules find an action's counterpart by key in O(1) instead of by a scan.
struct ActionId {
  ActionKind kind = ActionKind::kForward;
  int stage = 0;
  int microbatch = 0;

  static ActionId of(const Action& a) { return ActionId{a.kind, a.stage, a.microbatch}; }
  bool operator==(const ActionId& other) const {
    return kind == other.kind && stage == other.stage && microbatch == other.microbatch;
  }
};

// A 64-bit mix of three ints (splitmix64's finalizer), for hash maps.
inline size_t hashInts(int a, int b, int c) {
  uint64_t x = (static_cast<uint64_t>(static_cast<uint32_t>(b)) << 32) | static_cast<uint32_t>(c);
  x ^= static_cast<uint64_t>(static_cast<uint32_t>(a)) * 0x9E3779B97F4A7C15ULL;
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  x ^= x >> 31;
  return static_cast<size_t>(x);
}

struct ActionIdHash {
  size_t operator()(const ActionId& id) const {
    return hashInts(static_cast<int>(id.kind), id.stage, id.microbatch);
  }
};

// Joins actions with single spaces ("0F0 0F1 0B0").
std::string actionsToString(const std::vector<Action>& actions);
// Splits on whitespace and commas and parses every token.
std::vector<Action> parseActions(const std::string& text);

}  // namespace pipedream
