"""DeepEP V2's ElasticBuffer (expert parallelism) over ferry's AllToAll: its non-expanding
dispatch and its combine are the V1 Buffer's normal mode (a token-major AllToAll with both of
ferry's options: each token once per rank holding any of its experts, its experts' outputs
summed at that rank), which computes its own layout; the expanding layout (do_expand) is laid
out from it on the device (_expand); hybrid mode across nodes is node-once forwarding. What
ferry cannot do is refused by name: Engram, pipeline-parallel send/recv and all-gather
reduce-scatter."""

import itertools

import torch

from ... import _ferry
from .. import _group
from ..._errors import InvalidArgument, Unimplemented
from . import _expand
from ._buffer import Buffer
from ._events import EventHandle, EventOverlap, _round_up

# V2 sizes its buffers in multiples of 2 MiB.
_ALIGNMENT = 2 << 20


def _world_size(group):
    """A torch.distributed group's size, or a ferry.Bootstrap's."""
    return group.size() if callable(getattr(group, "size", None)) else group.world_size


def _row_bytes(hidden):
    """What a normal-mode token takes of the V1 Buffer's num_nvl_bytes per rank (its
    _normal_capacity's row)."""
    return hidden * 2 + hidden // 128 * 4 + 16


class EPHandle:
    """What ElasticBuffer.dispatch returns for its combine (and for a cached dispatch of the same
    routing): the dispatch's settings and counts, where its rows came from, and ferry's own
    handle. Its device tensors are valid once the dispatch's event has fired (at return unless
    async_with_compute_stream). psum_num_recv_tokens_per_expert: per local expert, the
    inclusive prefix sum of its rows rounded up to expert_alignment; expanded
    (do_expand), expert i's first row (the rounded sum before it) plus its unrounded count.
    recv_src_metadata [received rows, 2 + num_topk] int32: the row's sender rank times
    num_max_tokens_per_rank plus its token there, the sender rank, then (expanded) the row of
    each of its copies in recv_x, -1 where none is. Under node-once forwarding (hybrid mode)
    ferry's receiver knows no row's sender: the first two columns hold -1 and
    psum_num_recv_tokens_per_scaleup_rank has one entry, the rows received. V2's internal
    routing tables (dst_buffer_slot_idx, token_metadata_at_forward, channel_linked_list) have
    no counterpart in ferry: None. The dispatch's C++ makes them (python/src/deep_ep_elastic.cc
    sets their attributes: _psum the prefix sums, a host list until read, _ferry ferry's handle,
    _slots each copy's row where expanded, _received the dispatch's _Received, _world and
    _scaleup the ranks and scale-up ranks, _metadata and _psum_scaleup None until read)."""

    @property
    def recv_src_metadata(self):
        if self._metadata is None:
            self._metadata = self._source_metadata()
        return self._metadata

    @recv_src_metadata.setter
    def recv_src_metadata(self, value):  # DeepEP's callers trim it to the rows received
        self._metadata = value

    @property
    def psum_num_recv_tokens_per_expert(self):
        if isinstance(self._psum, list):
            self._psum = torch.tensor(self._psum, dtype=torch.int32,
                                      device=self._received.read_back.device)
        return self._psum

    @psum_num_recv_tokens_per_expert.setter
    def psum_num_recv_tokens_per_expert(self, value):
        self._psum = value

    @property
    def psum_num_recv_tokens_per_scaleup_rank(self):
        if self._psum_scaleup is None:
            self._psum_scaleup = self._scaleup_psum()
        return self._psum_scaleup

    def _source_metadata(self):
        """Made at its first reading, from the origins ferry's receive wrote (made at every
        dispatch, it would cost device ops most callers never read)."""
        got = self._received
        rows, k = self.num_recv_tokens, self.topk_idx.shape[1]
        dev = got.counts.device
        meta = torch.full((rows, 2 + k), -1, dtype=torch.int32, device=dev)
        if got.senders is not None:
            tokens, senders = got.tokens[:rows], got.senders[:rows]
            meta[:, 0] = senders * self.num_max_tokens_per_rank + tokens
            meta[:, 1] = senders
        if self._slots is not None:
            meta[:, 2:] = self._slots[:rows]
        return meta

    def _scaleup_psum(self):
        got = self._received
        per_rank = got.rows_per_sender(self._world)
        if per_rank is None:
            return got.num_rows.to(torch.int32).clone()
        # Sender r reaches us through the scale-up peer of its index in its domain.
        per_peer = per_rank.view(-1, self._scaleup).sum(0)
        return torch.cumsum(per_peer, 0).to(torch.int32)


class ElasticBuffer(_ferry.DeepEpElastic):
    """DeepEP V2's ElasticBuffer for expert parallelism among the ranks of `group` (a
    torch.distributed ProcessGroup or a ferry.Bootstrap). Sized from num_bytes, or from the MoE
    settings (num_max_tokens_per_rank, hidden). allow_hybrid_mode on several nodes of several
    ranks: node-once forwarding, its partial sums fp32 without allow_multiple_reduction (see
    __init__). Settings that change
    no result here -- prefer_overlap_with_compute, sl_idx, num_allocated_qps, deterministic
    (ferry's receive order is deterministic: per rank, senders in rank order and each sender's
    tokens in order; node-once, by forwarder, then the sender's node, then token) -- are kept.
    engine / ranks_per_node: as ferry.deep_ep.Buffer's."""

    def __init__(self, group, num_bytes=None, num_cpu_bytes=0, num_max_tokens_per_rank=0,
                 hidden=0, num_topk=0, use_fp8_dispatch=False, deterministic=False,
                 allow_hybrid_mode=True, allow_multiple_reduction=True,
                 prefer_overlap_with_compute=True, sl_idx=3, num_allocated_qps=0,
                 num_cpu_timeout_secs=300, num_gpu_timeout_secs=100, explicitly_destroy=False,
                 *, engine=None, ranks_per_node=None):
        super().__init__()  # the C++ base, which reads _elastic_settings at the first call
        _group.refuse("num_cpu_bytes", num_cpu_bytes, 0,
                      "CPU buffers (Engram storage) are not supported")
        if num_bytes is None:
            if num_max_tokens_per_rank <= 0 or hidden <= 0:
                raise InvalidArgument("ElasticBuffer: num_bytes, or num_max_tokens_per_rank and "
                                      "hidden (the MoE settings it is sized from)")
            num_bytes = self.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden,
                                                  num_topk, use_fp8_dispatch)
        if num_bytes <= 0 or num_bytes % _ALIGNMENT:
            raise InvalidArgument(f"num_bytes {num_bytes}: a positive multiple of 2 MiB")
        self._buffer = Buffer(group, num_nvl_bytes=num_bytes, explicitly_destroy=True,
                              engine=engine, ranks_per_node=ranks_per_node,
                              timeout=float(num_gpu_timeout_secs))
        self.group = group
        self.rank_idx, self.num_ranks = self._buffer.rank, self._buffer.group_size
        self._sms = {}  # CUDA ordinal -> its SM count (get_theoretical_num_sms)
        self.num_bytes = num_bytes
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.deterministic = deterministic
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.num_allocated_qps = num_allocated_qps or 1
        self.explicitly_destroy = explicitly_destroy
        self.num_scaleout_ranks, self.num_scaleup_ranks = self.get_logical_domain_size()
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        self.num_rdma_ranks, self.num_nvlink_ranks = self.get_physical_domain_size()
        # Hybrid mode (RDMA between nodes, NVLink inside them) is ferry's node-once forwarding:
        # a token crosses to each other node once, on its rail, and is forwarded inside it; its
        # rows are summed in the node before one crosses back. allow_multiple_reduction rounds
        # that sum to bf16 at the forwarder (a second rounding); without it the node's sum
        # crosses as fp32 and the combine rounds once, as per rank.
        if allow_hybrid_mode and self.num_rdma_ranks > 1 and self.num_nvlink_ranks > 1:
            self._buffer._forwarding = self._buffer._check_forwarding(
                _ferry.Forwarding.NODE_ONCE)
            if not allow_multiple_reduction:
                self._buffer._partial_sums = _ferry.PartialSums.FP32

    # ---- sizes and domains ------------------------------------------------------------------

    @staticmethod
    def get_buffer_size_hint(group, num_max_tokens_per_rank, hidden, num_topk=0,
                             use_fp8_dispatch=False, allow_hybrid_mode=True,
                             allow_multiple_reduction=True):
        """Bytes (a multiple of 2 MiB) that hold every rank's num_max_tokens_per_rank tokens of
        `hidden` columns: what ferry's dispatch then takes per rank."""
        if num_max_tokens_per_rank <= 0 or hidden <= 0:
            raise InvalidArgument("get_buffer_size_hint: num_max_tokens_per_rank and hidden, at "
                                  "least 1")
        raw = _world_size(group) * num_max_tokens_per_rank * _row_bytes(hidden)
        return _round_up(raw, _ALIGNMENT)

    def get_physical_domain_size(self):
        """(ranks on other hosts' NICs: the number of nodes, ranks of one NVLink domain)."""
        per_node = self._buffer._group.ranks_per_node()
        return self.num_ranks // per_node, per_node

    def get_logical_domain_size(self):
        return self.get_physical_domain_size()

    def get_theoretical_num_sms(self, num_experts, num_topk, num_scaleout_topk=0, rdma_gbs=0,
                                nvlink_gbs=0, sm_read_gbs=200, sm_write_gbs=50):
        """ferry's answer: its kernels size their own grids (a dispatch's send kernel takes
        what is resident at once), so the SMs a step may use are the device's; num_sms given to
        dispatch and combine is kept, not used. 1 on the CPU."""
        return self._device_sms(torch.cuda.current_device() if torch.cuda.is_available()
                                else -1)

    def _device_sms(self, device):
        """get_theoretical_num_sms of `device` (Tensor.get_device()'s ordinal), asked once: a
        dispatch whose caller gives no num_sms asks at every call."""
        sms = self._sms.get(device)
        if sms is None:
            sms = self._sms[device] = (1 if device < 0 else torch.cuda.get_device_properties(
                device).multi_processor_count)
        return sms

    def get_theoretical_num_qps(self, num_sms):
        """ferry's answer: each peer is reached through the engine's one connection per NIC,
        whatever the SM count, so 1."""
        return 1

    # ---- events, streams, barrier, end ------------------------------------------------------

    @staticmethod
    def capture():
        """An EventHandle recorded on the current CUDA stream (none without CUDA)."""
        return EventHandle()

    def get_comm_stream(self):
        return self._buffer.get_comm_stream()

    def barrier(self, use_comm_stream=True, with_cpu_sync=False, sequential=True):
        """Every rank reaches it before any leaves (through the group's bootstrap); with
        with_cpu_sync the device is synchronised before and after."""
        if with_cpu_sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        self._buffer._group.bootstrap.barrier(float(self._buffer._timeout))
        if with_cpu_sync and torch.cuda.is_available():
            torch.cuda.synchronize()

    def destroy(self):
        if not self.explicitly_destroy:
            raise InvalidArgument("destroy: the ElasticBuffer was made with "
                                  "explicitly_destroy=False")
        self._buffer.destroy()

    def __del__(self):
        try:
            if not self.explicitly_destroy and not self._buffer._destroyed:
                self._buffer.destroy()
        except Exception:  # noqa: BLE001 -- interpreter shutdown
            pass

    # ---- expert parallelism -----------------------------------------------------------------

    # dispatch and combine are the C++ base's (_ferry.DeepEpElastic, written once there: every
    # argument checked, the Buffer's normal-mode dispatch and combine run in the same call).
    # What it asks for by name:

    def _elastic_settings(self):
        """(the Buffer, num_max_tokens_per_rank, ranks, scale-up ranks, EPHandle,
        EventOverlap), read at the first call."""
        return (self._buffer, self.num_max_tokens_per_rank, self.num_ranks,
                self.num_scaleup_ranks, EPHandle, EventOverlap)

    def _epilogue(self, stats, do_cpu_sync, expert_alignment, do_expand, worst, local, k,
                  zero, cached):
        """(epilogue, made) of a dispatch with cumulative_local_expert_recv_stats or without
        the CPU sync: the torch work on the AllToAll's stream after its steps and before its
        event (the counters, the prefix sums, the expanded layout of the most rows the routing
        could fill), so that a caller that waits for the event reads them done; `made` the dict
        it fills."""
        made = {}
        if do_expand and not do_cpu_sync:
            made["total"] = (cached.num_expanded_tokens if cached is not None else
                             _expand.expanded_rows(worst, k, local, expert_alignment))

        def epilogue(got):
            if stats is not None:
                stats.add_(got.counts)
            if do_cpu_sync:
                return ()
            aligned = (got.counts if expert_alignment == 1 else
                       (got.counts + expert_alignment - 1) // expert_alignment *
                       expert_alignment)
            made["psum"] = torch.cumsum(aligned, 0, dtype=torch.int32)
            if do_expand:
                made.update(self._expanded(
                    got.recv[:worst], None if got.scales is None else got.scales[:worst],
                    got.experts[:worst], got.weights[:worst], local, expert_alignment,
                    made["total"], zero, cached._slots if cached is not None else None))
            kept = tuple(t for t in made.values() if isinstance(t, torch.Tensor))
            # Made on the AllToAll's stream where that is not the caller's: marked used on the
            # caller's, so that freeing them waits for its reads (the allocator reuses a block
            # on the stream it was made on).
            for t in kept if got.caller is not None else ():
                t.record_stream(got.caller)
            return kept

        return epilogue, made

    def _expand_outputs(self, recv_x, recv_idx, recv_weights, per_expert, event, got, made,
                        do_cpu_sync, do_expand, async_finish, local, expert_alignment, zero,
                        weighted, tma, cached):
        """What a dispatch returns past its received rows, where it asked for more: the
        expanded layout (do_expand), fp8 scales TMA-aligned, the prefix sums made on the device
        (no CPU sync). (recv_x, recv_idx, recv_weights, event, psum, num_expanded_tokens,
        num_unaligned_recv_tokens_per_expert, slots)."""
        fp8 = isinstance(recv_x, tuple)
        rows = (recv_x[0] if fp8 else recv_x).shape[0]
        psum, total = made.get("psum"), made.get("total", 0)
        if do_cpu_sync:
            psum = list(itertools.accumulate(per_expert))
            if do_expand:
                # The rows are here (the caller's stream waited for them): expanded on it.
                total = sum(per_expert)
                made.update(self._expanded(
                    got.recv[:rows], None if got.scales is None else got.scales[:rows],
                    got.experts[:rows], got.weights[:rows], local, expert_alignment, total,
                    zero, None))
                if async_finish:  # the event follows the expansion
                    event = EventOverlap(EventHandle(), (event.extra_tensors or ()) +
                                         tuple(made.values()))
        unaligned = None
        if do_expand:
            if cached is None:  # psum[i]: expert i's first row plus its count (V2's expanded)
                psum = (made["starts"] + made["counts"]).to(torch.int32)
                unaligned = made["counts"].to(torch.int32)
            recv_x = (made["x"], made["scales"]) if fp8 else made["x"]
            recv_idx, recv_weights = None, made["weights"] if weighted else None
        if fp8 and tma:
            recv_x = (recv_x[0], _expand.tma_aligned_scales(recv_x[1]))
        return (recv_x, recv_idx, recv_weights, event, psum, total, unaligned,
                made.get("slots"))

    @staticmethod
    def _expanded(recv, scales, experts, weights, local, alignment, total, zero, slots):
        """The expanded layout of a dispatch's rows (ferry's token-major outputs): a dict of
        x, scales (or None), weights, slots, counts and starts. `slots` given (a cached
        dispatch: the same routing) are taken as they are."""
        counts = starts = None
        if slots is None:
            slots, counts, starts = _expand.expert_slots(experts, local, alignment)
        return {"x": _expand.expand(recv, slots, total, zero),
                "scales": None if scales is None else _expand.expand(scales, slots, total, zero),
                "weights": _expand.expand_weights(weights, slots, total),
                "slots": slots, "counts": counts, "starts": starts}

    def _fold(self, x, topk_weights, handle, previous):
        """An expanded combine's rows and weights, one row per received token."""
        total = handle.num_expanded_tokens
        _group.check_tensor("x", x, torch.bfloat16, 2)
        if tuple(x.shape) != (total, handle._ferry.hidden):
            raise InvalidArgument(f"x: shape {tuple(x.shape)}, the expanded dispatch gave "
                                  f"{(total, handle._ferry.hidden)}")
        if topk_weights is not None:
            _group.check_tensor("topk_weights", topk_weights, torch.float32, 1, x.get_device())
            if topk_weights.shape[0] != total:
                raise InvalidArgument(f"topk_weights: {topk_weights.shape[0]} entries, the "
                                      f"expanded dispatch gave {total} rows")
        if previous is not None:
            previous.current_stream_wait()
        slots = handle._slots[:handle._ferry.rows]
        folded = _expand.fold(x, slots)
        weights = None if topk_weights is None else _expand.fold_weights(topk_weights, slots)
        return folded, weights

    # ---- what ferry does not do -------------------------------------------------------------

    def _refuse(name, what):
        def refused(*args, **kwargs):
            raise Unimplemented(f"ElasticBuffer.{name}: {what} is not supported")
        refused.__name__ = name
        return refused

    engram_write = _refuse("engram_write", "Engram")
    engram_fetch = _refuse("engram_fetch", "Engram")
    get_engram_storage_size_hint = staticmethod(_refuse("get_engram_storage_size_hint", "Engram"))
    pp_set_config = _refuse("pp_set_config", "pipeline-parallel send/recv")
    pp_send = _refuse("pp_send", "pipeline-parallel send/recv")
    pp_recv = _refuse("pp_recv", "pipeline-parallel send/recv")
    get_pp_buffer_size_hint = staticmethod(_refuse("get_pp_buffer_size_hint",
                                                   "pipeline-parallel send/recv"))
    create_agrs_session = _refuse("create_agrs_session", "all-gather reduce-scatter")
    destroy_agrs_session = _refuse("destroy_agrs_session", "all-gather reduce-scatter")
    agrs_new_session = _refuse("agrs_new_session", "all-gather reduce-scatter")
    agrs_set_config = _refuse("agrs_set_config", "all-gather reduce-scatter")
    agrs_get_inplace_tensor = _refuse("agrs_get_inplace_tensor", "all-gather reduce-scatter")
    all_gather = _refuse("all_gather", "all-gather reduce-scatter")
    get_agrs_num_max_session_bytes = staticmethod(_refuse("get_agrs_num_max_session_bytes",
                                                          "all-gather reduce-scatter"))
    get_agrs_buffer_size_hint = staticmethod(_refuse("get_agrs_buffer_size_hint",
                                                     "all-gather reduce-scatter"))
    del _refuse
