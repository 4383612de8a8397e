"""`pplx_kernels.nvshmem` over ferry: no NVSHMEM is set up (ferry.pplx_kernels says why)."""

from ferry.compat.pplx_kernels import (nvshmem_alloc_empty_unique_id, nvshmem_finalize,
                                nvshmem_get_unique_id, nvshmem_init)

__all__ = ["nvshmem_alloc_empty_unique_id", "nvshmem_finalize", "nvshmem_get_unique_id",
           "nvshmem_init"]
FERRY_SHIM = True
