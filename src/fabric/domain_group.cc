// The domain group an engine drives: one Domain per NIC, opened from EngineOptions (the named
// NICs, or the provider's first num_nics), each from the named backend or the first that opens
// of EFA, verbs and shm.
#include <string>
#include <vector>

#include "fabric/domain.h"
#include "fabric/engine_internal.h"
#include "ferry/fabric.h"
#ifdef FERRY_HAVE_VERBS
#include "fabric/verbs/verbs_domain.h"
#endif

namespace ferry::fabric {

namespace {

StatusOr<std::unique_ptr<Domain>> OpenVerbs(const EngineOptions& options, const std::string& nic) {
#ifdef FERRY_HAVE_VERBS
  return verbs::OpenVerbsDomain(options, nic, verbs::NewRealVerbsApi(),
                                verbs::VerbsConfig(options.verbs));
#else
  (void)options;
  (void)nic;
  return UnimplementedError("verbs: ferry was built without rdma-core (libibverbs-dev)");
#endif
}

std::vector<std::string> ListNics(const std::string& provider) {
#ifdef FERRY_HAVE_VERBS
  if (provider == "verbs") return verbs::NewRealVerbsApi()->DeviceNames();
#endif
  return ListLibfabricDomains(provider);
}

// The backend for one NIC: the named provider ("verbs" is libibverbs, others libfabric's), or
// when none is named the first that opens of EFA, verbs, shm.
StatusOr<std::unique_ptr<Domain>> OpenDomain(const EngineOptions& options, const std::string& nic) {
  if (options.port != 0 && options.provider.find("tcp") != 0 &&
      options.provider.find("sockets") != 0) {
    return InvalidArgumentError(
        "EngineOptions.port (FERRY_PORT) is " + std::to_string(options.port) + ", but provider '" +
        options.provider + "' has no ports: it applies to libfabric's socket providers (tcp, "
        "tcp;ofi_rxm, sockets); shm endpoints are named by `node` (FERRY_NODE)");
  }
  if (options.provider == "verbs") return OpenVerbs(options, nic);
  if (!options.provider.empty()) return OpenLibfabricDomain(options, nic);
  EngineOptions efa = options;
  efa.provider = "efa";
  auto d = OpenLibfabricDomain(efa, nic);
  if (d.ok()) return d;
  Status why = d.status();
  d = OpenVerbs(options, nic);
  if (d.ok()) return d;
  EngineOptions shm = options;
  shm.provider = "shm";
  d = OpenLibfabricDomain(shm, nic);
  if (d.ok()) return d;
  return d.status().WithContext("no backend opened (efa: " + std::string(why.message()) + ")");
}

}  // namespace

StatusOr<std::vector<std::unique_ptr<Domain>>> OpenDomains(const EngineOptions& options) {
  std::vector<std::string> names = options.nics;
  if (names.empty()) {
    if (options.num_nics == 0 || options.num_nics > kMaxNics) {
      return InvalidArgumentError("EngineOptions.num_nics is " +
                                  std::to_string(options.num_nics) + "; 1 to " +
                                  std::to_string(kMaxNics) + " allowed");
    }
    // The provider's first distinct NICs; a provider with fewer (software ones have one), or a
    // bound node address (which names one interface), gives each entry its own endpoint on one.
    std::vector<std::string> offered;
    if (options.num_nics > 1 && !options.provider.empty() && options.node.empty()) {
      offered = ListNics(options.provider);
    }
    for (uint32_t k = 0; k < options.num_nics; ++k) {
      names.push_back(offered.size() >= options.num_nics ? offered[k] : std::string());
    }
  }
  if (names.size() > kMaxNics) {
    return InvalidArgumentError(std::to_string(names.size()) + " NICs named; an engine drives " +
                                "at most " + std::to_string(kMaxNics));
  }
  if (options.port != 0 && options.port + names.size() - 1 > 65535) {
    return InvalidArgumentError("EngineOptions.port " + std::to_string(options.port) + " with " +
                                std::to_string(names.size()) + " NICs runs past port 65535");
  }
  std::vector<std::unique_ptr<Domain>> domains;
  for (size_t k = 0; k < names.size(); ++k) {
    const std::string& name = names[k];
    EngineOptions mine = options;  // the k-th NIC's endpoint listens on port + k
    if (options.port != 0) mine.port = static_cast<uint16_t>(options.port + k);
    auto d = OpenDomain(mine, name);
    if (!d.ok()) {
      return names.size() > 1 ? d.status().WithContext("NIC '" + name + "'") : d.status();
    }
    domains.push_back(std::move(d).value());
  }
  return domains;
}

}  // namespace ferry::fabric
