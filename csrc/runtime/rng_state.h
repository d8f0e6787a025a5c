// The random state a forward ran with, so that a recomputed forward draws the
// same dropout masks: the CPU generator's state and, when the stage runs on a
// CUDA device, that device's default generator's state too (a CUDA dropout
// draws from the device generator, not the CPU one).
//
// Threading: a value type; the generators it reads and sets are process-wide
// and guarded by their own mutexes, taken here around each get/set.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/Generator.h>

#include <optional>

namespace pipedream {

class RngState {
 public:
  RngState() = default;

  // The current state of the CPU generator and of `device`'s generator when
  // `device` is not the CPU.
  static RngState capture(const at::Device& device);

  // Sets the generators to this state and returns the state they had.
  RngState swapIn() const;

  bool defined() const { return cpu_.defined(); }

 private:
  static at::Tensor get(at::Generator& generator);
  static void set(at::Generator& generator, const at::Tensor& state);

  at::Tensor cpu_;
  std::optional<at::Generator> device_;  // the device's default generator
  at::Tensor deviceState_;
};

}  // namespace pipedream
