// A CPU list as text (the topology's sysfs lists and the worker CPUs a user sets: ParseCpuList)
// either parses to CPUs at or above 0 or is refused with InvalidArgument.
#include <cstdint>
#include <string_view>

#include "ferry/topology.h"
#include "fuzz.h"

using namespace ferry;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto cpus = ParseCpuList(text);
  if (!cpus.ok()) {
    FUZZ_REQUIRE(cpus.status().code() == StatusCode::kInvalidArgument, "cpu list");
    return 0;
  }
  for (int cpu : *cpus) FUZZ_REQUIRE(cpu >= 0, "a negative CPU");
  return 0;
}
