// What the libFuzzer harnesses share: a property that must hold, or the run stops there (and
// libFuzzer keeps the input that broke it).
#pragma once

#include <cstdio>
#include <cstdlib>

#define FUZZ_REQUIRE(cond, what)                                                           \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      std::fprintf(stderr, "%s:%d: %s does not hold: %s\n", __FILE__, __LINE__, #cond, what); \
      std::abort();                                                                        \
    }                                                                                      \
  } while (0)
