"""ferry: GPU-to-GPU transfers for large-model inference, over RDMA.

Three parts, as in the C++ library (include/ferry): the TransferEngine (one-sided writes and
two-sided messages over libfabric or verbs), AllToAll (MoE dispatch and combine) and the bootstrap
that ranks use to find each other. Errors are ferry.Error subclasses, one per status code.
"""

from ._arrays import as_array
from ._errors import (AlreadyExists, Cancelled, DataLoss, DeadlineExceeded, Error,
                      FailedPrecondition, Internal, InvalidArgument, NotFound, OutOfRange,
                      ResourceExhausted, Unavailable, Unimplemented)
from ._ferry import (CUDA_UNKNOWN_DEVICE, HOST_MEMORY, AllToAll, AllToAllConfig, Array,
                     Bootstrap, CallbackBootstrap, DispatchDtype, DispatchLayout, EngineOptions,
                     FabricInfo, MoeDevice, RankExit, RdmaBuffers, Region, RemoteRegion,
                     Transfer, TransferEngine, run_local_ranks)
from ._torch import torch_bootstrap

__all__ = [
    "AllToAll", "AllToAllConfig", "AlreadyExists", "Array", "Bootstrap", "CallbackBootstrap",
    "CUDA_UNKNOWN_DEVICE", "Cancelled", "DataLoss", "DeadlineExceeded", "DispatchDtype",
    "DispatchLayout", "EngineOptions", "Error", "FabricInfo", "FailedPrecondition", "HOST_MEMORY",
    "Internal", "InvalidArgument", "MoeDevice", "NotFound", "OutOfRange", "RankExit",
    "RdmaBuffers", "Region", "RemoteRegion", "ResourceExhausted", "Transfer", "TransferEngine",
    "Unavailable", "Unimplemented", "as_array", "run_local_ranks", "torch_bootstrap",
]
