// What GpuWords::Create does where GDRCopy opens, over GdrFlags the caller opened: so that a
// test drives the GPU-memory placement over a fake libgdrapi (tests/gdr_flags_test.cc), where
// no /dev/gdrdrv is. CUDA builds only.
#pragma once

#include <cstddef>
#include <memory>

#include "common/gdr_flags.h"
#include "ferry/gpu_words.h"

namespace ferry {

// `count` words (at most what `gdr` holds) for kernels on `cuda_device`, in kGpuMemory.
std::unique_ptr<GpuWords> GpuWordsOver(std::unique_ptr<GdrFlags> gdr, int cuda_device,
                                       size_t count);

}  // namespace ferry
