// Converts libfabric return codes to Status, once, at the call site that got them.
#pragma once

#include <string_view>

#include "ferry/status.h"

namespace ferry::fabric {

// `ret` is a negative libfabric error (-FI_E*). "fi_domain: Function not implemented (-38)".
Status FiError(std::string_view call, long ret);

}  // namespace ferry::fabric
