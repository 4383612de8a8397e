"""`deep_ep.utils` over ferry: the EventOverlap that ferry.deep_ep's calls return and the
EventHandle callers make for a call's previous_event."""

from ferry.compat.deep_ep import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
FERRY_SHIM = True
