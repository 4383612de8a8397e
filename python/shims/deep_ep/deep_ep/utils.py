"""`deep_ep.utils` over ferry: the EventOverlap that ferry.deep_ep's calls return."""

from ferry.deep_ep import EventOverlap

__all__ = ["EventOverlap"]
FERRY_SHIM = True
