"""ferry: GPU-to-GPU transfers for large-model inference, over RDMA.

The parts of the C++ library (include/ferry): the TransferEngine (one-sided writes and two-sided
messages over libfabric or verbs), AllToAll (MoE dispatch and combine), the KV messenger
(KvPrefill, KvDecoder and the reshard planner) and the bootstrap that ranks use to find each
other. Errors are ferry.Error subclasses, one per status code. ferry.compat holds DeepEP's,
pplx-garden's and pplx-kernels' Python APIs over AllToAll (ferry.compat.deep_ep, .pplx,
.pplx_kernels, imported on their own: they need torch; ferry.deep_ep, ferry.pplx and
ferry.pplx_kernels are the same modules).
"""

from ._arrays import as_array
from ._async import transfer_future
from ._errors import (AlreadyExists, Cancelled, DataLoss, DeadlineExceeded, Error,
                      FailedPrecondition, Internal, InvalidArgument, NotFound, OutOfRange,
                      ResourceExhausted, Unavailable, Unimplemented)
from ._ferry import (CUDA_UNKNOWN_DEVICE, HOST_MEMORY, AllToAll, AllToAllConfig, Array,
                     Bootstrap, CallbackBootstrap, CudaTuning, DispatchDtype, DispatchLayout,
                     EngineOptions, FabricInfo, Forwarding, Fp8Scaling, GpuLayerCounter, GpuWords,
                     KvCudaShards, KvDecoder, KvModel, KvOrder, KvPlan, KvPrefill, KvSide,
                     KvWrite, LayerCounter, MoeDevice, PartialSums, RankExit, RdmaBuffers,
                     Region,
                     RemoteRegion, Streaming, Transfer, TransferEngine, VerbsOptions,
                     join_rendezvous,
                     plan_kv_transfer, run_local_ranks)
from ._torch import torch_bootstrap

__all__ = [
    "AllToAll", "AllToAllConfig", "AlreadyExists", "Array", "Bootstrap", "CallbackBootstrap",
    "CUDA_UNKNOWN_DEVICE", "Cancelled", "CudaTuning", "DataLoss", "DeadlineExceeded",
    "DispatchDtype",
    "DispatchLayout", "EngineOptions", "Error", "FabricInfo", "FailedPrecondition", "Forwarding",
    "Fp8Scaling", "GpuLayerCounter", "GpuWords", "HOST_MEMORY", "Internal", "InvalidArgument",
    "KvCudaShards", "KvDecoder", "KvModel", "KvOrder", "KvPlan", "KvPrefill", "KvSide", "KvWrite",
    "LayerCounter", "MoeDevice", "NotFound", "OutOfRange", "PartialSums", "RankExit",
    "RdmaBuffers", "Region",
    "RemoteRegion", "ResourceExhausted", "Streaming", "Transfer", "TransferEngine",
    "Unavailable",
    "Unimplemented", "VerbsOptions", "as_array", "join_rendezvous", "plan_kv_transfer",
    "run_local_ranks",
    "torch_bootstrap", "transfer_future",
]
