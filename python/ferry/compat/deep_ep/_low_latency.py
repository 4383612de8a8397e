"""DeepEP's low-latency mode over an expert-major AllToAll. Its two calls are the C++ base's
(_ferry.DeepEpBuffer: every argument checked, every form run there); here, what it asks
for (a shape's AllToAll and output sets) and the combine buffer."""

import torch


from ... import _ferry
from .._group import fp8_dtype
from ..._errors import InvalidArgument


class _LowLatency:
    """Buffer's low-latency calls (a mixin: the state is Buffer's)."""

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        """Nothing to clean: ferry's flags carry an epoch, so no buffer needs zeroing between
        the modes."""
        self._check_open("clean_low_latency_buffer")

    def _ll_shape(self, x, m, num_experts, k, use_fp8, use_ue8m0):
        """What the C++ base asks for where no AllToAll of a shape is idle: one (made where
        none is idle), with its two output sets, added to the C++ base and left idle there."""
        key = ("ll", x.get_device(), m, x.shape[1], num_experts, k, use_fp8)
        pooled = self._acquire(key, x, lambda: self._ll_fields(key))
        self._ll_sets(pooled, x, (m, num_experts, k), use_fp8, use_ue8m0)
        pooled.busy = False

    @staticmethod
    def _ll_fields(key):
        """A low-latency pool's configuration keywords, from its key."""
        _, _, m, hidden, num_experts, k, use_fp8 = key
        return dict(num_experts=num_experts, experts_per_token=k, max_tokens_per_rank=m,
                    hidden=hidden, dtype=_ferry.DispatchDtype.FP8_E4M3 if use_fp8
                    else _ferry.DispatchDtype.BF16)

    def _ll_sets(self, pooled, x, shape, use_fp8, use_ue8m0):
        """The two output sets of a low-latency AllToAll in one form, (recv_x, recv_count,
        scales, packed, src_info, layout_range) each, made once (on the CPU torch caches no
        large blocks, and every call would pay for fresh pages) and added to the C++ base,
        which takes them in turn: as DeepEP's buffers are, a result stays valid until the
        second dispatch after it on the same AllToAll. shape: (m, experts, k)."""
        key = (id(pooled), use_fp8, use_ue8m0)
        if key in self._outputs:
            return
        m, experts, k = shape
        hidden, local, rows = x.shape[1], experts // self.group_size, self.group_size * m
        device = x.device
        sets = self._outputs[key] = []
        for _ in range(2):
            recv_x = torch.empty(local, rows, hidden, device=device,
                                 dtype=fp8_dtype() if use_fp8 else torch.bfloat16)
            recv_count = torch.empty(local, dtype=torch.int32, device=device)
            scales = packed = None
            if use_fp8:
                scales = torch.empty(local, rows, hidden // 128, dtype=torch.float32,
                                     device=device)
                # DeepEP's scale layouts: the last two dimensions column-major (the storage is
                # [local, groups, rows]); UE8M0: each scale's exponent byte, four groups per
                # int32.
                if use_ue8m0:
                    packed = torch.empty(local, hidden // 512, rows, dtype=torch.int32,
                                         device=device).transpose(1, 2)
                else:
                    packed = torch.empty(local, hidden // 128, rows, dtype=torch.float32,
                                         device=device).transpose(1, 2)
            # The handle's (DeepEP V1's): each row's token index in its sender, each sender's
            # rows of each expert as (first row << 32) | rows.
            src_info = torch.empty(local, rows, dtype=torch.int32, device=device)
            layout_range = torch.empty(local, self.group_size, dtype=torch.int64, device=device)
            sets.append((recv_x, recv_count, scales, packed, src_info, layout_range))
        self._add_shape(x.get_device(), m, hidden, experts, k, use_fp8, use_ue8m0, pooled, sets,
                        self._constant(x, m, k, 1.0))

    def get_next_low_latency_combine_buffer(self, handle):
        """The tensor a zero-copy low_latency_combine sends from: [num_local_experts,
        num_ranks * num_max_dispatch_tokens_per_rank, hidden] bf16, one per AllToAll (made at
        its first use; a handle's combine is the only one its AllToAll has in flight)."""
        h = self._live_handle(handle, "get_next_low_latency_combine_buffer")
        if h.rows is not None:
            raise InvalidArgument("handle: from a normal-mode dispatch (no zero-copy combine)")
        buffer = self._combine_buffers.get(id(h.pooled))
        if buffer is None:
            local = h.num_experts // self.group_size
            buffer = self._combine_buffers[id(h.pooled)] = torch.empty(
                local, self.group_size * h.max_tokens, h.hidden, dtype=torch.bfloat16,
                device=h.topk_idx.device)
        h.combine_buffer = buffer
        return buffer

    def _live_handle(self, handle, call):
        """ferry's handle in `handle` (a low-latency one, V1's tuple, or a normal-mode one),
        InvalidArgument unless it is one of ours not yet combined."""
        h = self._unwrap(handle)
        if h is None:
            raise InvalidArgument(f"{call}: handle is not one this Buffer's dispatch returned")
        if not h.in_flight:
            raise InvalidArgument(f"{call}: the handle's dispatch was combined already")
        return h

    def _release(self, h):
        """The handle's dispatch combined (or failed): its AllToAll free for the next call."""
        h.pooled.busy = False
        h.in_flight = False
