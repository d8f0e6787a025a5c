// Writes the seed corpora of the C++ fuzz targets:
//   make_seeds SOURCE_DIR OUT_DIR  ->  OUT_DIR/profile_graph/*, OUT_DIR/schedule/*
// Valid inputs (pieces of the shipped profiles, every schedule config in text
// and CSV, compute-only and lowered) and near-valid ones (one thing broken).
// The committed corpora in tests/fuzz/corpus were written by it
// (tests/fuzz/run_fuzzers.sh --seeds rewrites them).
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "harness.h"
#include "lower.h"
#include "profile_graph.h"

namespace fs = std::filesystem;
using namespace pipedream;

namespace {

std::string readFile(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void write(const fs::path& dir, const std::string& name, const std::string& data) {
  fs::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary) << data;
}

// The first `count` nodes of `graph` in file order and the edges among them.
std::string prefix(const ProfileGraph& graph, int count) {
  ProfileGraph out;
  for (int v = 0; v < count && v < graph.numNodes(); ++v) out.addNode(graph.node(v));
  for (const auto& e : graph.edges()) {
    if (e.first < out.numNodes() && e.second < out.numNodes()) out.addEdge(e.first, e.second);
  }
  return out.toString();
}

std::string replaceFirst(std::string text, const std::string& from, const std::string& to) {
  size_t pos = text.find(from);
  if (pos != std::string::npos) text.replace(pos, from.size(), to);
  return text;
}

void profileSeeds(const fs::path& source, const fs::path& dir) {
  const fs::path profiles = source / "tests" / "data" / "profiles";
  write(dir, "alexnet-full", readFile(profiles / "alexnet.txt"));
  for (const char* name : {"alexnet", "gnmt", "resnet18"}) {
    const ProfileGraph g = ProfileGraph::load((profiles / (std::string(name) + ".txt")).string());
    for (int count : {1, 3, 8}) {
      write(dir, std::string(name) + "-first" + std::to_string(count), prefix(g, count));
    }
  }
  const std::string line1 =
      "node1 -- Input0 -- forward_compute_time=0.000, backward_compute_time=0.000, "
      "activation_size=602112.000, parameter_size=0.000";
  const std::string line2 =
      "node2 -- Conv2d(3, 64, kernel_size=(11, 11), stride=(4, 4)) -- forward_compute_time=1.250, "
      "backward_compute_time=2.500, activation_size=[6291456.0; 131072.0], parameter_size=23296.000";
  const std::string line3 =
      "node3 -- ReLU(inplace) -- forward_compute_time=0.539, backward_compute_time=0.188, "
      "activation_size=44302336.000, parameter_size=0.000";
  const std::string line4 =
      "node4 -- __getitem__(0) -- forward_compute_time=0.010, backward_compute_time=0.000, "
      "activation_size=4.000, parameter_size=0.000";
  const std::string chain = line1 + "\n" + line2 + "\n" + line3 + "\n\tnode1 -- node2\n\tnode2 -- node3";
  write(dir, "chain", chain);
  write(dir, "diamond", line1 + "\n" + line2 + "\n" + line3 + "\n" + line4 +
                            "\n\tnode1 -- node2\n\tnode1 -- node3\n\tnode2 -- node4\n\tnode3 -- node4");
  write(dir, "stage-ids", replaceFirst(replaceFirst(chain, "parameter_size=0.000",
                                                    "parameter_size=0.000 -- stage_id=0"),
                                       "parameter_size=23296.000", "parameter_size=23296.000 -- stage_id=1"));
  write(dir, "crlf", line1 + "\r\n" + line2 + "\r\n\tnode1 -- node2\r\n");
  write(dir, "input-only", line1);
  write(dir, "two-sources", line2 + "\n" + line3);
  // Near-valid: one thing wrong each.
  write(dir, "bad-cycle", chain + "\n\tnode3 -- node2");
  write(dir, "bad-unknown-edge", chain + "\n\tnode3 -- node9");
  write(dir, "bad-self-edge", chain + "\n\tnode3 -- node3");
  write(dir, "bad-negative", replaceFirst(chain, "forward_compute_time=1.250", "forward_compute_time=-1"));
  write(dir, "bad-number", replaceFirst(chain, "forward_compute_time=1.250", "forward_compute_time=1.2.5"));
  write(dir, "bad-list", replaceFirst(chain, "131072.0]", "131072.0"));
  write(dir, "bad-missing-field", replaceFirst(chain, ", parameter_size=0.000", ""));
  write(dir, "bad-duplicate", chain + "\n" + line3);
  write(dir, "bad-edge-form", chain + "\n\tnode1 -> node3");
  write(dir, "bad-stage-id", replaceFirst(chain, "parameter_size=0.000", "parameter_size=0.000 -- stage_id=x"));
}

void scheduleSeeds(const fs::path& dir) {
  const auto& configs = fuzz::scheduleConfigs();
  const int n = static_cast<int>(configs.size());
  for (int c = 0; c < n; ++c) {
    const Schedule compute = buildSchedule(configs[c]);
    const Schedule lowered = lower(compute);
    const std::string tag = std::to_string(c) + "-" + configs[c].name;
    for (int csv = 0; csv < 2; ++csv) {
      const std::string first(1, static_cast<char>(c + (csv ? n : 0)));
      const std::string kind = csv ? "-csv" : "-text";
      auto form = [&](const Schedule& s) { return csv ? s.toCsv() : s.toText(); };
      write(dir, tag + kind, first + form(compute));
      write(dir, tag + kind + "-lowered", first + form(lowered));
      // Near-valid: the last action of the last rank dropped, the first two
      // actions of rank 0 swapped.
      auto lists = compute.allActions();
      if (!lists.back().empty()) lists.back().pop_back();
      write(dir, tag + kind + "-bad-dropped", first + form(compute.withActions(lists)));
      lists = compute.allActions();
      if (lists[0].size() >= 2) std::swap(lists[0][0], lists[0][1]);
      write(dir, tag + kind + "-bad-swapped", first + form(compute.withActions(lists)));
    }
  }
  // Broken tokens and lines.
  const std::string text1f1b(1, '\1');
  write(dir, "bad-token", text1f1b + "rank 0: 0F0 1F1 0X0\nrank 1: 1F0\n");
  write(dir, "bad-prefix", text1f1b + "rank 1: 0F0\n");
  write(dir, "bad-version-on-send", text1f1b + "rank 0: 0F0 0SEND_F0v1\nrank 1: 1RECV_F0\n");
  write(dir, "bad-huge-number", text1f1b + "rank 0: 0F99999999999\nrank 1:\n");
  write(dir, "bad-ranks", std::string(1, static_cast<char>(1 + n)) + "0F0,0B0\n1F0,1B0\n2F0\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s SOURCE_DIR OUT_DIR\n", argv[0]);
    return 2;
  }
  const fs::path out = argv[2];
  profileSeeds(argv[1], out / "profile_graph");
  scheduleSeeds(out / "schedule");
  return 0;
}
