"""DeepEP's shrink mode: the mask buffer's calls over the low-latency AllToAlls' rank masks."""

import torch


from ... import _ferry
from ..._errors import InvalidArgument, Unimplemented


class _Shrink:
    """Buffer's mask-buffer calls (a mixin: the state is Buffer's)."""

    def _low_latency_all_to_alls(self):
        return self._group.all_to_alls("ll")

    def _check_shrink(self, call):
        self._check_open(call)
        if not self.enable_shrink:
            raise InvalidArgument(f"{call}: the Buffer was made without enable_shrink=True "
                                  "(DeepEP's mask buffer exists in shrink mode only)")

    def _gather_masks(self):
        """The ranks any low-latency AllToAll masked (a call that missed its deadline masks the
        ranks it waited for), each then masked on every other one too: one mask per Buffer, as
        DeepEP's mask buffer is. An AllToAll mid-call takes a mask from its next dispatch."""
        a2as = self._low_latency_all_to_alls()
        for a2a in a2as:
            for rank, masked in enumerate(a2a.masked()):
                self._masked[rank] |= masked
        for a2a in a2as:
            for rank, masked in enumerate(self._masked):
                if masked:
                    a2a.set_masked(rank)

    def low_latency_update_mask_buffer(self, rank_to_mask, mask=False):
        """Mask `rank_to_mask` out of the low-latency calls (mask=True: nothing is sent to or
        awaited from it; the copies routed to its experts add nothing) from each AllToAll's next
        dispatch (a CUDA graph's next replay included). Unmasking a masked rank is refused: in
        ferry a masked rank stays masked, since sections it sent late would be read as a later
        call's (a rank that is back joins a new Buffer)."""
        self._check_shrink("low_latency_update_mask_buffer")
        if not 0 <= rank_to_mask < self.group_size:
            raise InvalidArgument(f"low_latency_update_mask_buffer: rank {rank_to_mask} of "
                                  f"{self.group_size}")
        if rank_to_mask == self.rank:
            raise InvalidArgument("low_latency_update_mask_buffer: a rank cannot mask itself")
        self._gather_masks()
        if not mask:
            if self._masked[rank_to_mask]:
                raise Unimplemented(f"low_latency_update_mask_buffer: rank {rank_to_mask} is "
                                    "masked and stays so in this Buffer (unmasking is not "
                                    "supported: its late sections would be read as a later "
                                    "call's)")
            return
        self._masked[rank_to_mask] = 1
        for a2a in self._low_latency_all_to_alls():
            a2a.set_masked(rank_to_mask)
            # On the CUDA device the mask is set on the AllToAll's stream (AllToAll::SetMasked):
            # waited for here, so that a CUDA graph replayed next, on any stream, reads it.
            if a2a.config.device == _ferry.MoeDevice.CUDA:
                a2a.synchronize()

    def low_latency_query_mask_buffer(self, mask_status):
        """mask_status ([num_ranks] int32, any device): 1 where a rank is masked, by
        low_latency_update_mask_buffer or by a call that missed its deadline."""
        self._check_shrink("low_latency_query_mask_buffer")
        if (not isinstance(mask_status, torch.Tensor) or mask_status.dtype != torch.int32
                or tuple(mask_status.shape) != (self.group_size,)):
            raise InvalidArgument(f"mask_status: an int32 tensor of shape ({self.group_size},)")
        self._gather_masks()
        mask_status.copy_(torch.tensor(self._masked, dtype=torch.int32))

    def low_latency_clean_mask_buffer(self):
        """Nothing to clean while no rank is masked; with one masked, refused (a masked rank
        stays masked in ferry: see low_latency_update_mask_buffer)."""
        self._check_shrink("low_latency_clean_mask_buffer")
        self._gather_masks()
        masked = [r for r, m in enumerate(self._masked) if m]
        if masked:
            raise Unimplemented(f"low_latency_clean_mask_buffer: ranks {masked} are masked and "
                                "stay so in this Buffer (unmasking is not supported: their late "
                                "sections would be read as a later call's)")
