#include "action.h"

#include <cctype>
#include <sstream>
#include <stdexcept>

namespace pipedream {

namespace {

struct KindToken {
  ActionKind kind;
  const char* token;
};

// Longest tokens first so that parsing is greedy ("ALLREDUCE" before "F"...).
constexpr KindToken kTokens[] = {
    {ActionKind::kAllReduce, "ALLREDUCE"},
    {ActionKind::kSendForward, "SEND_F"},
    {ActionKind::kRecvForward, "RECV_F"},
    {ActionKind::kSendBackward, "SEND_B"},
    {ActionKind::kRecvBackward, "RECV_B"},
    {ActionKind::kForward, "F"},
    {ActionKind::kBackward, "B"},
    {ActionKind::kBackwardInput, "I"},
    {ActionKind::kBackwardWeight, "W"},
    {ActionKind::kUpdate, "U"},
};

[[noreturn]] void parseError(const std::string& text, const std::string& why) {
  throw std::invalid_argument(
      "cannot parse action '" + text + "': " + why +
      " (expected e.g. '2F0', '1B3v2', '0I2', '3SEND_F1', '1RECV_B0', '0U1', "
      "'0ALLREDUCE1')");
}

// Reads a non-negative decimal integer at text[pos...]; advances pos.
int readNumber(const std::string& text, size_t& pos, const char* what) {
  size_t start = pos;
  long value = 0;
  while (pos < text.size() && std::isdigit(static_cast<unsigned char>(text[pos]))) {
    value = value * 10 + (text[pos] - '0');
    if (value > 1000000000L) parseError(text, std::string(what) + " is too large");
    ++pos;
  }
  if (pos == start) parseError(text, std::string("missing ") + what);
  return static_cast<int>(value);
}

}  // namespace

const char* kindToken(ActionKind kind) {
  for (const auto& entry : kTokens) {
    if (entry.kind == kind) return entry.token;
  }
  return "?";
}

bool isCompute(ActionKind kind) {
  return kind == ActionKind::kForward || isBackwardLike(kind);
}

bool isBackwardLike(ActionKind kind) {
  return kind == ActionKind::kBackward || kind == ActionKind::kBackwardInput ||
         kind == ActionKind::kBackwardWeight;
}

bool isComm(ActionKind kind) {
  return kind == ActionKind::kSendForward || kind == ActionKind::kRecvForward ||
         kind == ActionKind::kSendBackward || kind == ActionKind::kRecvBackward;
}

bool isVersionOnly(ActionKind kind) {
  return kind == ActionKind::kUpdate || kind == ActionKind::kAllReduce;
}

Action Action::compute(int stage, ActionKind kind, int microbatch, int version) {
  return Action{stage, kind, microbatch, version};
}

Action Action::comm(int stage, ActionKind kind, int microbatch) {
  return Action{stage, kind, microbatch, 0};
}

Action Action::update(int stage, int newVersion) {
  return Action{stage, ActionKind::kUpdate, -1, newVersion};
}

Action Action::allReduce(int stage, int newVersion) {
  return Action{stage, ActionKind::kAllReduce, -1, newVersion};
}

std::string Action::toString() const {
  std::string out = std::to_string(stage) + kindToken(kind);
  if (isVersionOnly(kind)) {
    out += std::to_string(version);
  } else {
    out += std::to_string(microbatch);
    if (isCompute(kind) && version != 0) out += "v" + std::to_string(version);
  }
  return out;
}

Action Action::parse(const std::string& text) {
  size_t pos = 0;
  const int stage = readNumber(text, pos, "stage number");
  const KindToken* found = nullptr;
  for (const auto& entry : kTokens) {
    if (text.compare(pos, std::string(entry.token).size(), entry.token) == 0) {
      found = &entry;
      break;
    }
  }
  if (found == nullptr) parseError(text, "unknown action kind after the stage number");
  pos += std::string(found->token).size();
  Action action;
  action.stage = stage;
  action.kind = found->kind;
  if (isVersionOnly(found->kind)) {
    action.microbatch = -1;
    action.version = readNumber(text, pos, "version number");
  } else {
    action.microbatch = readNumber(text, pos, "microbatch number");
    if (pos < text.size() && text[pos] == 'v') {
      if (!isCompute(found->kind)) parseError(text, "only F/B/I/W carry a version");
      ++pos;
      action.version = readNumber(text, pos, "version number");
    }
  }
  if (pos != text.size()) parseError(text, "unexpected trailing characters");
  return action;
}

std::string actionsToString(const std::vector<Action>& actions) {
  std::string out;
  for (size_t k = 0; k < actions.size(); ++k) {
    if (k > 0) out += ' ';
    out += actions[k].toString();
  }
  return out;
}

std::vector<Action> parseActions(const std::string& text) {
  std::vector<Action> actions;
  std::string token;
  auto flush = [&]() {
    if (!token.empty()) actions.push_back(Action::parse(token));
    token.clear();
  };
  for (char c : text) {
    if (std::isspace(static_cast<unsigned char>(c)) || c == ',') {
      flush();
    } else {
      token += c;
    }
  }
  flush();
  return actions;
}

}  // namespace pipedream
