"""`deep_ep` as an importable package over ferry (ferry.deep_ep).

With ferry.deep_ep.shim_path() on PYTHONPATH, `import deep_ep` / `from deep_ep import Buffer`
finds this package in every process that starts with that environment (an engine's worker
processes too): the engine runs on ferry with nothing in its code changed. What ferry.deep_ep
refuses it refuses here, naming the argument.
"""

from ferry.compat.deep_ep import (Buffer, Config, ElasticBuffer, EPHandle, EventOverlap,
                                   topk_idx_t)
from ferry.compat import deep_ep as _layer

__version__ = _layer.__version__

from . import utils

__all__ = ["Buffer", "Config", "ElasticBuffer", "EPHandle", "EventOverlap", "topk_idx_t", "utils"]
FERRY_SHIM = True
