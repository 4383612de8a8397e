// Numbers from the environment, strictly: a variable that is set must say a whole number in the
// field's range, or the caller gets an error naming it (never a silent 0 from atoi).
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>

#include "ferry/status.h"

namespace ferry {

// The variable `name` as an integer in [lo, hi] into *out (strtoll's `base`: 10, or 0 for 0x
// hex and 0 octal as well); unset or empty leaves *out as it is.
inline Status EnvInt(const char* name, int64_t lo, int64_t hi, int64_t* out, int base = 10) {
  const char* v = std::getenv(name);
  if (!v || !*v) return Status::Ok();
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(v, &end, base);
  if (errno != 0 || *end != '\0' || value < lo || value > hi) {
    return InvalidArgumentError(std::string(name) + "=" + v + ": expected an integer in [" +
                                std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
  *out = value;
  return Status::Ok();
}

// The same into a field of type T, within [lo, hi] (by default all T holds).
template <typename T>
Status EnvNumber(const char* name, T* out, int64_t lo = std::numeric_limits<T>::min(),
                 int64_t hi = std::numeric_limits<T>::max(), int base = 10) {
  static_assert(std::numeric_limits<T>::max() <= std::numeric_limits<int64_t>::max(),
                "the default range must fit int64_t");
  int64_t value = static_cast<int64_t>(*out);
  RETURN_IF_ERROR(EnvInt(name, lo, hi, &value, base));
  *out = static_cast<T>(value);
  return Status::Ok();
}

// EnvNumber over everything T holds, in C's notation as well (0x hex, 0 octal): keys, PSNs.
template <typename T>
Status EnvNumberAnyBase(const char* name, T* out) {
  return EnvNumber(name, out, std::numeric_limits<T>::min(), std::numeric_limits<T>::max(), 0);
}

}  // namespace ferry
