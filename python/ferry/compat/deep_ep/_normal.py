"""DeepEP's normal (high-throughput) mode over a token-major AllToAll with both options, the
combine's top-k weights on a second one."""

import torch


from ... import _ferry
from .._group import check_tensor
from ..._errors import Error, InvalidArgument
from ._events import _NOT_KEPT, EventOverlap, NormalHandle, _round_up, _token_major


class _Received:
    """What a normal-mode dispatch received beyond its results, on the device: the rows and the
    copies per local expert (read_back [1 + local] int32; num_rows and counts its parts),
    each row's token in its sender and its sender (tokens, senders: [rows] int32, or None), the
    full-size outputs (recv, scales, experts, weights), what the epilogue made from them (kept
    until the dispatch's event fires), the caller's torch stream where the AllToAll's is
    another (None where they are one, or on the CPU: what the epilogue allocates there is
    marked used on it) and, once the rows are counted on the host, the received rows' tokens
    (src_idx: tokens' first rows). The dispatch's C++ makes them, filling every slot
    (python/src/deep_ep_normal.cc, DeepEpNormal::Received)."""

    __slots__ = ("read_back", "tokens", "senders", "recv", "scales", "experts", "weights",
                 "made", "caller", "src_idx")

    @property
    def num_rows(self):
        return self.read_back[:1]

    @property
    def counts(self):
        return self.read_back[1:]

    def rows_per_sender(self, world):
        """Rows received from each of `world` senders ([world] int64 on the device), or None
        where the origins were not asked for. Rows past those received (num_worst_tokens,
        no CPU sync) hold no token: counted nowhere."""
        if self.senders is None:
            return None
        live = torch.arange(self.senders.shape[0], device=self.senders.device) < \
            self.num_rows.long()
        senders = torch.where(live, self.senders.long(), world)
        return torch.bincount(senders, minlength=world + 1)[:world]


class _Normal:
    """Buffer's normal-mode calls (a mixin: the state is Buffer's)."""

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        """(num_tokens_per_rank [ranks] int32, num_tokens_per_rdma_rank [nodes] int32 or None
        within one node, num_tokens_per_expert [experts] int32, is_token_in_rank [tokens, ranks]
        bool, event), computed with torch on topk_idx's device."""
        self._check_open("get_dispatch_layout")
        check_tensor("topk_idx", topk_idx, (torch.int64, torch.int32), 2)
        world = self.group_size
        if num_experts % world:
            raise InvalidArgument(f"num_experts {num_experts}: not divisible by {world} ranks")
        if previous_event is not None:
            previous_event.current_stream_wait()
        ids = topk_idx.long()
        valid = ids >= 0
        per_expert = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
        per_expert.scatter_add_(0, torch.where(valid, ids, num_experts).flatten(),
                                torch.ones(ids.numel(), dtype=torch.int64, device=ids.device))
        num_tokens_per_expert = per_expert[:num_experts].int()
        rank_of = torch.where(valid, ids // (num_experts // world), world)
        in_rank = torch.zeros(ids.shape[0], world + 1, dtype=torch.bool, device=ids.device)
        in_rank.scatter_(1, rank_of, True)
        is_token_in_rank = in_rank[:, :world].contiguous()
        num_tokens_per_rank = is_token_in_rank.sum(0).int()
        nodes = world // self._group.ranks_per_node() if ids.device.type == "cuda" else 1
        per_rdma = None
        if nodes > 1:
            per_rdma = is_token_in_rank.view(-1, nodes, world // nodes).any(2).sum(0).int()
        return (num_tokens_per_rank, per_rdma, num_tokens_per_expert, is_token_in_rank,
                EventOverlap(None))

    # ---- what the C++ calls ask for by name (python/src/deep_ep_normal.cc) ------------------

    def _normal_settings(self):
        """What the normal-mode calls read of the Buffer, asked at the first call (and again
        after its AllToAlls were dropped): (num_nvl_bytes + num_rdma_bytes, whether each row's
        sender and token are known (per-rank forwarding), ranks per node, _Received,
        NormalHandle, the NotKept entries)."""
        return (self.num_nvl_bytes + self.num_rdma_bytes,
                self._forwarding == _ferry.Forwarding.PER_RANK, self._group.ranks_per_node(),
                _Received, NormalHandle, _NOT_KEPT)

    def _normal_pool(self, x, capacity, hidden, num_experts, k, fp8):
        """An idle normal-mode AllToAll of the shape, taken (made, collectively, where none
        is)."""
        dtype = _ferry.DispatchDtype.FP8_E4M3 if fp8 else _ferry.DispatchDtype.BF16
        return self._acquire(
            ("normal", x.get_device(), capacity, hidden, num_experts, k, fp8), x,
            lambda: _token_major(num_experts, k, capacity, hidden, dtype, self._forwarding,
                                 self._partial_sums))

    def _wait_previous(self, previous_event, a2a, current, device):
        """The AllToAll's stream (the caller's where it has none yet) waits for
        previous_event."""
        (self._stream_of(a2a, current, device) or
         torch.cuda.current_stream(device)).wait_event(previous_event.event)

    def _rank_ids(self, is_token_in_rank, k, a2a, current, device):
        """A dispatch routed by is_token_in_rank: rank r's column holds r where the token goes
        there, else -1 (int32, made on the AllToAll's stream)."""
        with self._on_comm(a2a, current, device):
            return torch.where(is_token_in_rank, torch.arange(
                k, dtype=torch.int32, device=device), -1).int()

    def _mask_worst(self, experts, weights, read_back, worst, a2a, current, device):
        """num_worst_tokens: the rows past those received hold no token (experts -1, weights
        0), marked on the AllToAll's stream without a wait for the count."""
        with self._on_comm(a2a, current, device):
            live = torch.arange(worst, device=device) < read_back[:1].long()
            experts[:worst].masked_fill_(~live[:, None], -1)
            weights[:worst].masked_fill_(~live[:, None], 0.0)

    @staticmethod
    def _caller_stream(device):
        """torch's object for the caller's current stream on `device` (a dispatch's _Received
        holds it where the AllToAll's stream is another)."""
        return torch.cuda.current_stream(device)

    def _run_epilogue(self, epilogue, received, a2a, current, device):
        """epilogue(received) on the AllToAll's stream; what it made (kept until the
        dispatch's event fires)."""
        with self._on_comm(a2a, current, device):
            received.made = tuple(epilogue(received) or ())
        return received.made

    def _rank_prefix_sums(self, received, rows):
        """V1's internode handle's recv_gbl_rank_prefix_sum and recv_rdma_rank_prefix_sum
        (inclusive prefix sums of the rows from the senders up to each rank, and each node, int32),
        or None where the rows' senders are not known. rows: those received, None where the
        dispatch did not wait to count them (num_worst_tokens)."""
        senders = received.senders
        if senders is None:
            return None
        world, per_node = self.group_size, self._group.ranks_per_node()
        if rows is None:
            gbl = torch.cumsum(received.rows_per_sender(world), 0).to(torch.int32)
        else:
            # The senders' rows lie in rank order: the rows up to rank r end where the first
            # row of a later rank begins (one search, not a count per rank and a sum).
            ranks = self._ranks.get(senders.device)
            if ranks is None:
                ranks = self._ranks[senders.device] = torch.arange(
                    world, dtype=torch.int32, device=senders.device)
            gbl = torch.searchsorted(senders[:rows], ranks, right=True, out_int32=True)
        return gbl, gbl.view(-1, per_node)[:, -1].contiguous()

    def _start_from_bias(self, out, biases, a2a, current, device):
        """A combine with bias: out starts as it (a pair summed in fp32, rounded once), on the
        AllToAll's stream, for the receive to add to."""
        with self._on_comm(a2a, current, device):
            if len(biases) == 1:
                out.copy_(biases[0])
            else:
                out.copy_(biases[0].float() + biases[1].float())

    def _received_per_expert(self, num_tokens_per_expert):
        """Tokens this rank's experts receive, from every rank's num_tokens_per_expert (a host
        all-gather: the ids that would count them stayed with their senders)."""
        experts = num_tokens_per_expert.numel()
        mine = num_tokens_per_expert.to(torch.int64).cpu().numpy().tobytes()
        every = self._group.bootstrap.all_gather(mine, self._timeout)
        if any(len(data) != len(mine) for data in every):
            raise InvalidArgument(f"num_tokens_per_expert: {experts} experts here, another "
                                  "rank's differs")
        counts = torch.frombuffer(bytearray(b"".join(every)), dtype=torch.int64)
        local = experts // self.group_size
        mine_first = self.rank * local
        return counts.view(self.group_size, experts)[:, mine_first:mine_first + local].sum(
            0).tolist()

    def _combine_weights(self, h, x, topk_weights, current):
        """combine's top-k weights, (the sums [tokens, columns], the padded tensors the
        caller's event keeps alive): an AllToAll of fp32 rows (the columns padded to 16) routed
        as the handle's dispatch was, whose dispatch moves only the routing (the rows arrive in
        the main dispatch's order: senders in rank order, each sender's tokens in order) and
        whose combine sums the weights rows. Every step, the padding copies too, goes after the
        main combine on its stream (taken as this AllToAll's own at its first call, else
        ordered by events both ways), so what orders that combine (the caller's stream or
        previous_event) orders these, and the caller's wait for the main combine covers
        both."""
        dev = x.device
        columns = topk_weights.shape[1]
        width = _round_up(max(columns, 1), 16)
        capacity = h.pooled.a2a.config.max_tokens_per_rank  # the main dispatch's
        rows = self.group_size * capacity
        local = h.num_experts // self.group_size
        key = ("normal-weights", x.get_device(), capacity, width, h.num_experts, h.k)
        # Forwarded as the main dispatch was: its rows arrive in the same order.
        pooled = self._acquire(key, x, lambda: _token_major(
            h.num_experts, h.k, capacity, width, _ferry.DispatchDtype.FP32, self._forwarding,
            self._partial_sums))
        wa2a = pooled.a2a
        main = h.pooled.a2a.stream  # None on the CPU
        try:
            if main is not None:
                wa2a.adopt_stream(main)
                if wa2a.stream != main:
                    wa2a.order_after(main)
            # Its dispatch's outputs, read by nothing: one set per key, as the AllToAll is
            # taken and given back within this call and its steps follow each other on one
            # stream.
            scratch = self._weights_scratch.get(key)
            if scratch is None:
                scratch = self._weights_scratch[key] = (
                    torch.empty(rows, width, dtype=torch.float32, device=dev),
                    torch.empty(local, dtype=torch.int32, device=dev), None,
                    torch.empty(1, dtype=torch.int32, device=dev),
                    torch.empty(rows, h.k, dtype=torch.int32, device=dev),
                    torch.empty(rows, h.k, dtype=torch.float32, device=dev))
            at = x.get_device()
            padded = _ferry.empty(torch.float32, at, h.rows, width)
            wide = _ferry.empty(torch.float32, at, h.tokens, width)
            sums = wide if width == columns else _ferry.empty(torch.float32, at, h.tokens,
                                                              columns)
            with self._on_comm(wa2a, current, dev):
                padded[:, columns:].zero_()
                padded[:, :columns].copy_(topk_weights)
            wa2a.dispatch_send(self._constant(x, capacity, width, 0.0, wa2a, current)[:h.tokens],
                               h.topk_idx, self._constant(x, capacity, h.k, 1.0, wa2a, current),
                               num_tokens=h.tokens)
            wa2a.dispatch_recv(*scratch, timeout=self._timeout)
            wa2a.combine_send(padded, h.rows)
            wa2a.combine_recv(wide, False, self._timeout)
            if sums is not wide:
                with self._on_comm(wa2a, current, dev):
                    sums.copy_(wide[:, :columns])
            if main is not None and wa2a.stream != main:
                wa2a.order_before(main)
        except Error as e:  # the usual cause: a peer that passed no topk_weights
            raise type(e)(f"combine's topk_weights (their AllToAll, which every rank's combine "
                          f"must take alike): {e}") from e
        finally:
            pooled.busy = False
        return sums, (padded, wide)

    @staticmethod
    def _biases(bias, h, x):
        """combine's bias as a tuple of the tensors given (none, one or two), each checked."""
        if bias is None:
            return ()
        given = bias if isinstance(bias, tuple) else (bias,)
        if not 1 <= len(given) <= 2:
            raise InvalidArgument(f"bias: a tensor or a pair of tensors, got {len(given)}")
        given = tuple(b for b in given if b is not None)
        for b in given:
            check_tensor("bias", b, torch.bfloat16, 2, x.get_device())
            if tuple(b.shape) != (h.tokens, h.hidden):
                raise InvalidArgument(f"bias: shape {tuple(b.shape)}, the combine gives "
                                      f"{(h.tokens, h.hidden)}")
        return given
