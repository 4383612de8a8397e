"""ferry.pplx_kernels: pplx-kernels' AllToAll over ferry, by the name it had before the compatibility layers
moved to ferry.compat: this module is ferry.compat.pplx_kernels itself."""

import sys

from .compat import pplx_kernels as _layer

sys.modules[__name__] = _layer
