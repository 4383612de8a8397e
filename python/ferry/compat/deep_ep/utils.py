"""DeepEP's `deep_ep.utils`: the EventOverlap its calls return, the EventHandle callers make for
a call's previous_event, and check_nvlink_connections."""

import torch

from ..._errors import InvalidArgument
from ._events import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap", "check_nvlink_connections"]


def check_nvlink_connections(group):
    """DeepEP's check that the GPUs of a group's ranks on this host reach each other directly:
    InvalidArgument naming the first pair of this host's GPUs that cannot map each other's
    memory (ferry's node path writes into peers' memory, over NVLink or the PCIe switch). Ranks
    on other hosts, and CPU-only processes, have nothing to check."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return
    visible = range(torch.cuda.device_count())
    for i in visible:
        for j in visible:
            if i != j and not torch.cuda.can_device_access_peer(i, j):
                raise InvalidArgument(f"check_nvlink_connections: GPU {i} cannot reach GPU {j}'s "
                                      "memory directly")
