// FERRY_API marks what libferry exports: the types and functions of include/ferry. The library
// is built with hidden visibility (CMakeLists.txt), so everything else in it -- the engine's
// internals, the moe and kv machinery, the CUDA kernels' host side -- stays out of its dynamic
// symbol table and cannot clash with, or be interposed by, another library in the process.
#pragma once

#define FERRY_API [[gnu::visibility("default")]]
