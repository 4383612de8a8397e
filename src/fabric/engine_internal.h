// Engine construction over a given Domain: how tests put a fault-injecting decorator between
// the engine and a real backend.
#pragma once

#include <memory>
#include <vector>

#include "common/mutex.h"
#include "fabric/domain.h"
#include "ferry/fabric.h"

namespace ferry {

// Ties memory regions to their engine (fabric.h): a region releases its registration through
// it while the engine lives, and only forgets its handle once the engine is gone.
struct RegistrationOwner {
  Mutex mu;
  TransferEngine* engine GUARDED_BY(mu) = nullptr;  // null once the engine is gone
};

}  // namespace ferry

namespace ferry::fabric {

StatusOr<std::unique_ptr<TransferEngine>> CreateEngineWithDomain(const EngineOptions& options,
                                                                 std::unique_ptr<Domain> domain);
// A domain group: one Domain per NIC (1 to kMaxNics), all of one provider.
StatusOr<std::unique_ptr<TransferEngine>> CreateEngineWithDomains(
    const EngineOptions& options, std::vector<std::unique_ptr<Domain>> domains);
// The libfabric domains options ask for (options.nics, or num_nics of the provider's).
StatusOr<std::vector<std::unique_ptr<Domain>>> OpenDomains(const EngineOptions& options);

}  // namespace ferry::fabric
