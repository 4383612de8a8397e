"""DeepEP's shrink mode: the mask buffer's calls over the low-latency AllToAlls' rank masks,
and a masked rank's return as a new process (readmission)."""

import json
import os

import torch


from ... import _ferry
from ..._errors import InvalidArgument

# How long a readmission waits for the ranks it meets (the new process may still be starting).
_READMIT_TIMEOUT = 60.0


def rejoin_from_env(rank, world_size):
    """Buffer's default `rejoin`: a rendezvous at FERRY_REJOIN_RENDEZVOUS ('HOST:PORT', rank 0
    listening) as `rank` of `world_size` (None: FERRY_RANK, FERRY_WORLD_SIZE), or None where it
    is not set."""
    address = os.environ.get("FERRY_REJOIN_RENDEZVOUS")
    if not address:
        return None
    return lambda: _ferry.join_rendezvous(address, world_size=world_size, rank=rank,
                                          timeout=_READMIT_TIMEOUT)


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
        dispatch (a CUDA graph's next replay included). mask=False on a masked rank brings it
        back as a new process (a masked rank's old process may still write: it is fenced, not
        trusted): every survivor calls this between calls, the new process constructs its
        Buffer with join=True, and they meet over the Buffer's `rejoin` (a bootstrap of the
        whole world); every low-latency AllToAll is readmitted (ferry.AllToAll.readmit) and the
        next calls are whole again (on CUDA tensors the AllToAlls are made anew: a CUDA graph
        captured before holds their old buffers). Every masked rank comes back at once."""
        self._check_shrink("low_latency_update_mask_buffer")
        if not 0 <= rank_to_mask < self.group_size:
            raise InvalidArgument(f"low_latency_update_mask_buffer: rank {rank_to_mask} of "
                                  f"{self.group_size}")
        if rank_to_mask == self.rank:
            raise InvalidArgument("low_latency_update_mask_buffer: a rank cannot mask itself")
        self._gather_masks()
        if not mask:
            if self._masked[rank_to_mask]:
                self._readmit()
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
        """Every masked rank unmasked: nothing to do while none is; else they come back as new
        processes, as low_latency_update_mask_buffer(rank, False) brings them (a readmission
        brings every masked rank back at once)."""
        self._check_shrink("low_latency_clean_mask_buffer")
        self._gather_masks()
        if any(self._masked):
            self._readmit()

    # ---- readmission --------------------------------------------------------------------------

    def _rejoin_group(self, call):
        if self._rejoin is None:
            raise InvalidArgument(f"{call}: a masked rank comes back as a new process met over "
                                  "a bootstrap of the whole world: give the Buffer rejoin= (a "
                                  "function that returns one) or set FERRY_REJOIN_RENDEZVOUS")
        return self._rejoin()

    def _world_view(self):
        """What a survivor tells the ranks it meets: its low-latency shapes in the order they
        were made, with their instances; the next instance; the world's ranks per node."""
        return json.dumps({
            "shapes": [[list(key), a2a.config.instance]
                       for key, a2a in self._group.keyed("ll")],
            "next_instance": self._group.next_instance(),
            "ranks_per_node": self._group.known_ranks_per_node()}).encode()

    def _meet(self, group, mine):
        """Every rank's view over `group` (a new process's is empty), the survivors' checked
        alike: the one they share."""
        views = group.all_gather(mine, _READMIT_TIMEOUT)
        theirs = [v for v in views if v]
        if not theirs:
            raise InvalidArgument("join: no rank of the world met this one (every rank "
                                  "joining is a new Buffer, not a readmission)")
        for r, v in enumerate(views):
            if v and v != theirs[0]:
                raise InvalidArgument(f"readmission: rank {r}'s low-latency shapes differ from "
                                      "the other survivors' (each must have made the same calls)")
        return json.loads(theirs[0])

    def _readmit(self):
        """Survivors: the masked ranks back as the new processes met over rejoin()."""
        group = self._rejoin_group("low_latency_update_mask_buffer")
        mine = self._world_view()
        view = self._meet(group, mine)
        for _, a2a in self._group.keyed("ll"):
            a2a.readmit(group, _READMIT_TIMEOUT)
        # The normal mode's AllToAlls included the lost rank: their steps fail from then on,
        # and the new process has none. They are remade, collectively, at their next call.
        self._group.drop("ll")
        self._forget_normal()
        self._group.rebase(group, view["ranks_per_node"])
        self._masked = [0] * self.group_size

    def _join_world(self):
        """A new process for a rank the others masked: meets their readmission over rejoin()
        and joins each of their low-latency AllToAlls (ferry.AllToAll.join), made from their
        keys as theirs were."""
        group = self._group.bootstrap
        view = self._meet(group, b"")
        # The survivors' ranks per node first: asked for here it would be a collective they
        # are not in.
        self._group.rebase(group, view["ranks_per_node"])
        for key, instance in view["shapes"]:
            key = tuple(key)
            self._group.join(key, self._config(key, lambda k=key: self._ll_fields(k)), instance,
                             _READMIT_TIMEOUT)
        self._group.set_next_instance(view["next_instance"])
