"""`deep_ep.utils` over ferry: the EventOverlap that ferry.deep_ep's calls return and the
EventHandle callers make for a call's previous_event."""

from ferry.compat.deep_ep.utils import EventHandle, EventOverlap, check_nvlink_connections

__all__ = ["EventHandle", "EventOverlap", "check_nvlink_connections"]
FERRY_SHIM = True
