#include "runtime/rng_state.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>

#include <mutex>

namespace pipedream {

at::Tensor RngState::get(at::Generator& generator) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void RngState::set(at::Generator& generator, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

RngState RngState::capture(const at::Device& device) {
  RngState out;
  at::Generator cpu = at::detail::getDefaultCPUGenerator();
  out.cpu_ = get(cpu);
  if (!device.is_cpu()) {
    out.device_ = at::globalContext().defaultGenerator(device);
    out.deviceState_ = get(*out.device_);
  }
  return out;
}

RngState RngState::swapIn() const {
  RngState previous;
  at::Generator cpu = at::detail::getDefaultCPUGenerator();
  previous.cpu_ = get(cpu);
  set(cpu, cpu_);
  if (device_.has_value()) {
    at::Generator device = *device_;
    previous.device_ = device;
    previous.deviceState_ = get(device);
    set(device, deviceState_);
  }
  return previous;
}

}  // namespace pipedream
