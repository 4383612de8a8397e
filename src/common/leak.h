// LeakOnPurpose: what ferry leaks by design -- memory a wedged provider call or a transfer that
// never ended may still touch -- said in the code, and told to LeakSanitizer so that `make
// sanitize` reports only leaks nobody meant.
#pragma once

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

namespace ferry {

// Never freed, from here on: p (a heap object, and what it reaches) is not a leak to report.
template <typename T>
T* LeakOnPurpose(T* p) {
#if defined(__SANITIZE_ADDRESS__)
  __lsan_ignore_object(p);
#endif
  return p;
}

}  // namespace ferry
