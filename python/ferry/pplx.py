"""ferry.pplx: pplx-garden's AllToAllKernel over ferry, by the name it had before the compatibility layers
moved to ferry.compat: this module is ferry.compat.pplx itself."""

import sys

from .compat import pplx as _layer

sys.modules[__name__] = _layer
