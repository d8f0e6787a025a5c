// A cluster as levels of workers, innermost first (for example 4 GPUs per
// server at 16e9 B/s, then 4 servers at 1.25e9 B/s), plus memory per worker.
#pragma once

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

namespace pipedream {

struct TopologyLevel {
  int workers = 1;         // units of the level below grouped at this level
  double bandwidth = 0.0;  // bytes/s between those units
};

struct Topology {
  std::vector<TopologyLevel> levels;  // innermost first
  double memoryBytes = 0.0;           // per worker; 0 = unlimited

  int totalWorkers() const {
    int total = 1;
    for (const TopologyLevel& l : levels) total *= l.workers;
    return total;
  }

  // Throws std::invalid_argument naming the bad value and the fix.
  void validate() const {
    if (levels.empty()) {
      throw std::invalid_argument(
          "topology has no levels; give at least one worker count and bandwidth, e.g. "
          "workers=[4], bandwidth=[16e9]");
    }
    for (size_t i = 0; i < levels.size(); ++i) {
      if (levels[i].workers < 1 || levels[i].workers > 4096) {
        throw std::invalid_argument("topology level " + std::to_string(i) + " has " +
                                    std::to_string(levels[i].workers) +
                                    " workers; use a count between 1 and 4096");
      }
      if (!(levels[i].bandwidth > 0) || !std::isfinite(levels[i].bandwidth)) {
        throw std::invalid_argument("topology level " + std::to_string(i) + " has bandwidth " +
                                    std::to_string(levels[i].bandwidth) +
                                    " bytes/s; use a positive number such as 1.25e9");
      }
    }
    if (!(memoryBytes >= 0) || !std::isfinite(memoryBytes)) {
      throw std::invalid_argument("memory per worker is " + std::to_string(memoryBytes) +
                                  " bytes; use a positive byte count, or 0 for no limit");
    }
    if (totalWorkers() > 65536) {
      throw std::invalid_argument("topology has " + std::to_string(totalWorkers()) +
                                  " workers in all; at most 65536 are supported");
    }
  }
};

}  // namespace pipedream
