"""`pplx_kernels` as an importable package over ferry (ferry.pplx_kernels).

With ferry.pplx_kernels.shim_path() on PYTHONPATH, `import pplx_kernels` finds this package in
every process that starts with that environment (an engine's worker processes too), where
ferry.pplx_kernels.install() covers only the process that calls it.
"""

from ferry.compat.pplx_kernels import (AllToAll, nvshmem_alloc_empty_unique_id, nvshmem_finalize,
                                nvshmem_get_unique_id, nvshmem_init)

from . import nvshmem

__all__ = ["AllToAll", "nvshmem", "nvshmem_alloc_empty_unique_id", "nvshmem_finalize",
           "nvshmem_get_unique_id", "nvshmem_init"]
FERRY_SHIM = True  # what ferry.pplx_kernels.install() accepts as its own
