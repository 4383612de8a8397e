// Engine construction over a given Domain: how tests put a fault-injecting decorator between
// the engine and a real backend.
#pragma once

#include <memory>

#include "fabric/domain.h"
#include "ferry/fabric.h"

namespace ferry::fabric {

StatusOr<std::unique_ptr<TransferEngine>> CreateEngineWithDomain(const EngineOptions& options,
                                                                 std::unique_ptr<Domain> domain);

}  // namespace ferry::fabric
