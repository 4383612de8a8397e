"""ferry.deep_ep: DeepEP's `deep_ep` over ferry, by the name it had before the compatibility layers
moved to ferry.compat: this module is ferry.compat.deep_ep itself."""

import sys

from .compat import deep_ep as _layer

sys.modules[__name__] = _layer
