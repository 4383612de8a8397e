"""DeepEP's Python API (deep_ep.Buffer, its V1 interface; deep_ep.ElasticBuffer, V2's, for
expert parallelism: see _elastic.py for what of it is built) over ferry's AllToAll.

A DeepEP user changes `import deep_ep` to `from ferry.compat import deep_ep` (`ferry.deep_ep`
is the same module), or changes no code and puts shim_path() on PYTHONPATH (a `deep_ep` package
of this module's names, found by every process started with it). The calls take and return what
DeepEP's do, in its shapes, dtypes and strides:

- low-latency mode: `low_latency_dispatch` hands back `[num_local_experts, num_ranks *
  num_max_dispatch_tokens_per_rank, hidden]` (bf16, or e4m3 with fp32 scales whose last two
  dimensions are column-major, or UE8M0 exponents packed four to an int32), the per-expert
  counts and a handle; `low_latency_combine` takes that layout back with the top-k weights and
  returns each token's weighted sum. Both map onto an expert-major AllToAll whose combine
  weights are given at the combine.
- normal mode: `get_dispatch_layout`, `dispatch` (each token once per rank that holds any of its
  experts, with `recv_topk_idx` local to the rank, -1 elsewhere) and `combine` (an unweighted
  sum over the ranks) map onto a token-major AllToAll with both of ferry's options (a token once
  per rank; its experts' outputs summed at the expert rank).

Tensors on the CPU run on ferry's host device; CUDA tensors on its CUDA device. An AllToAll (of
either mode) whose first call asks for async_finish goes on a stream of the Buffer's own that
waits for the caller's current stream (or `previous_event`), as DeepEP's communication stream
does; one whose first call waits for its result goes on the caller's stream, as DeepEP launches
a hook's send half, with no event between the caller's kernels and ferry's. An argument ferry
cannot honour raises Unimplemented naming it (ferry.Error); a bad tensor raises
InvalidArgument. Tuning knobs that change no result
(`Config`, `num_sms`, `num_qps_per_rank`, `allocate_on_comm_stream`) are taken and kept.
"""

import torch

from .._group import shim_path as _shim_path
from . import utils
from ._buffer import Buffer
from ._elastic import ElasticBuffer, EPHandle
from ._events import Config, EventHandle, EventOverlap

# The dtype DeepEP's callers convert topk_idx to (DeepEP's default build: 64-bit ids). ferry's
# calls take int64 and int32 ids alike.
topk_idx_t = torch.int64

# The DeepEP API version this layer implements (V1, `deep_ep` 1.2.1's names and signatures).
__version__ = "1.2.1"

__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t", "EventHandle", "ElasticBuffer",
           "EPHandle", "shim_path", "utils"]


def shim_path():
    """The folder to put on PYTHONPATH for `import deep_ep` to find ferry's."""
    return _shim_path("deep_ep")
