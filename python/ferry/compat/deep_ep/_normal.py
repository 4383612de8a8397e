"""DeepEP's normal (high-throughput) mode over a token-major AllToAll with both options, the
combine's top-k weights on a second one."""

import torch


from ... import _ferry
from .._group import check_tensor, fp8_dtype
from ..._errors import Error, InvalidArgument, ResourceExhausted
from ._events import EventOverlap, NormalHandle, _Handle, _round_up, _token_major


class _Received:
    """What a normal-mode dispatch received beyond its results, on the device: the rows and the
    copies per local expert (read_back [1 + local] int32; num_rows and counts its parts),
    each row's token in its sender and its sender (tokens, senders: [rows] int32, or None), the
    full-size outputs (recv, scales, experts, weights), what the epilogue made from them (kept
    until the dispatch's event fires), the caller's torch stream where the AllToAll's is
    another (None where they are one, or on the CPU: what the epilogue allocates there is
    marked used on it) and, once the rows are counted on the host, the received rows' tokens
    (src_idx: tokens' first rows)."""

    __slots__ = ("read_back", "tokens", "senders", "recv", "scales", "experts", "weights",
                 "made", "caller", "src_idx")

    def __init__(self, read_back, tokens, senders, recv, scales, experts, weights, caller):
        self.read_back, self.tokens, self.senders = read_back, tokens, senders
        self.recv, self.scales, self.experts, self.weights = recv, scales, experts, weights
        self.made, self.caller, self.src_idx = (), caller, None

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

    def _normal_capacity(self, hidden):
        """Tokens per rank a normal-mode dispatch takes: what num_nvl_bytes + num_rdma_bytes
        hold of every rank's rows of this hidden size (at least one)."""
        per_token = self.group_size * (hidden * 2 + hidden // 128 * 4 + 16)
        return max(1, (self.num_nvl_bytes + self.num_rdma_bytes) // per_token)

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=None,
                 previous_event=None, async_finish=False, allocate_on_comm_stream=False):
        """(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
        event); with a handle (a cached dispatch: the routing of that dispatch again), (recv_x,
        None, None, None, None, event). x: [tokens, hidden] bf16, or (x e4m3, scales [tokens,
        hidden / 128] fp32). The layout arguments must be get_dispatch_layout's for topk_idx;
        ferry routes from topk_idx itself."""
        self._check_open("dispatch")
        x, x_scales = self._rows(x)
        tokens, hidden = x.shape
        every_count = None  # without topk_idx: num_tokens_per_expert, the counts' source
        cached = None
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise InvalidArgument("a cached dispatch (handle) takes no topk_idx / "
                                      "topk_weights: the handle's are used")
            cached = self._normal_handle(handle, "dispatch")
            if cached.in_flight:
                raise InvalidArgument("dispatch: the handle's dispatch is not combined yet")
            topk_idx, topk_weights = cached.topk_idx, cached.topk_weights
            num_experts = cached.num_experts
            if tokens != cached.tokens or hidden != cached.hidden:
                raise InvalidArgument(f"x: shape {(tokens, hidden)}, the handle's dispatch had "
                                      f"{(cached.tokens, cached.hidden)}")
        else:
            if num_tokens_per_expert is None:
                raise InvalidArgument("num_tokens_per_expert: required (get_dispatch_layout's)")
            check_tensor("num_tokens_per_expert", num_tokens_per_expert, None, 1)
            num_experts = num_tokens_per_expert.numel()
            if num_experts % self.group_size:
                raise InvalidArgument(f"num_experts {num_experts}: not divisible by "
                                      f"{self.group_size} ranks")
            for name, t, n in (("num_tokens_per_rank", num_tokens_per_rank, self.group_size),
                               ("is_token_in_rank", is_token_in_rank, None)):
                if t is None:
                    raise InvalidArgument(f"{name}: required (get_dispatch_layout's)")
                if n is not None and t.numel() != n:
                    raise InvalidArgument(f"{name}: {t.numel()} entries, expected {n}")
            if topk_idx is None:
                self._check_rank_routing(is_token_in_rank, topk_weights, num_worst_tokens, x)
                # One expert per rank; the ids are made once the AllToAll's stream is ordered.
                every_count, num_experts = num_tokens_per_expert, self.group_size
        out = self._dispatch(x, x_scales, topk_idx, topk_weights, num_experts, expert_alignment,
                             num_worst_tokens, previous_event, async_finish, cached, every_count,
                             is_token_in_rank,
                             sources=self._forwarding == _ferry.Forwarding.PER_RANK)
        if cached is not None:
            return out[:6]
        new, got = out[4], out[6]
        handle = NormalHandle.make(new, got, is_token_in_rank, self.group_size,
                                   self._group.ranks_per_node())
        return out[:4] + (handle, out[5])

    @staticmethod
    def _rows(x):
        """(x, scales or None) from a dispatch's x, checked: bf16 rows, or (e4m3 rows, fp32
        scales per 128 columns)."""
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        fp8 = x_scales is not None
        check_tensor("x", x, (fp8_dtype(), torch.uint8) if fp8 else torch.bfloat16, 2)
        tokens, hidden = x.shape
        if hidden % (128 if fp8 else 16):
            raise InvalidArgument(f"x: hidden {hidden} is not a multiple of "
                                  f"{128 if fp8 else 16} ({'fp8' if fp8 else 'bf16'} rows)")
        if fp8:
            check_tensor("x scales", x_scales, torch.float32, 2, x.get_device())
            if tuple(x_scales.shape) != (tokens, hidden // 128):
                raise InvalidArgument(f"x scales: shape {tuple(x_scales.shape)}, expected "
                                      f"{(tokens, hidden // 128)}")
        return x, x_scales

    def _dispatch(self, x, x_scales, topk_idx, topk_weights, num_experts, expert_alignment,
                  num_worst_tokens, previous_event, async_finish, cached=None, every_count=None,
                  is_token_in_rank=None, epilogue=None, sources=False):
        """dispatch() past its layout arguments, x checked (_rows): what ElasticBuffer calls,
        routing from topk_idx alone. Its six results, then a _Received of what the caller did
        not see (the counts ferry made, and with `sources` each row's sender and token).
        epilogue(received): torch ops on it that must be done when the dispatch is
        (ElasticBuffer's statistics, prefix sums and expanded layout): run on the AllToAll's
        stream after its steps and before the finishing event, so that a caller that waits for
        the event (async_finish) reads them done."""
        fp8 = x_scales is not None
        tokens, hidden = x.shape
        if expert_alignment < 1:
            raise InvalidArgument(f"expert_alignment {expert_alignment}: at least 1")
        if every_count is None:
            check_tensor("topk_idx", topk_idx, (torch.int64, torch.int32), 2, x.get_device())
            if topk_idx.shape[0] != tokens:
                raise InvalidArgument(f"topk_idx: {topk_idx.shape[0]} rows, x has {tokens}")
            if topk_weights is not None:
                check_tensor("topk_weights", topk_weights, torch.float32, 2, x.get_device())
                if topk_weights.shape != topk_idx.shape:
                    raise InvalidArgument(f"topk_weights: shape {tuple(topk_weights.shape)}, "
                                          f"topk_idx {tuple(topk_idx.shape)}")
        capacity = self._normal_capacity(hidden)
        if tokens > capacity:
            raise ResourceExhausted(
                f"dispatch: {tokens} tokens, the Buffer's num_nvl_bytes + num_rdma_bytes hold "
                f"{capacity} per rank at hidden {hidden} ({self.group_size} ranks): make it larger")
        k = self.group_size if every_count is not None else topk_idx.shape[1]
        dtype = _ferry.DispatchDtype.FP8_E4M3 if fp8 else _ferry.DispatchDtype.BF16
        pooled = self._acquire(
            ("normal", x.get_device(), capacity, hidden, num_experts, k, fp8), x,
            lambda: _token_major(num_experts, k, capacity, hidden, dtype, self._forwarding,
                                 self._partial_sums))
        a2a = pooled.a2a
        rows = self.group_size * capacity
        dev = x.device
        try:
            current = self._begin(pooled, x, previous_event, async_finish)
            weights = (topk_weights if topk_weights is not None
                       else self._constant(x, capacity, k, 1.0, a2a, current))
            if every_count is not None:  # rank r's column holds r where the token goes there
                with self._on_comm(a2a, current, dev):
                    topk_idx = torch.where(is_token_in_rank, torch.arange(
                        k, dtype=torch.int32, device=dev), -1).int()
            a2a.dispatch_send(x, topk_idx, weights, x_scales, tokens)
            # The outputs made by the receive (on the caller's stream: DeepEP's
            # allocate_on_comm_stream=False); the received row count and the per-expert counts
            # side by side (read_back), so that one read to the host gives both.
            recv, recv_scales, read_back, experts, weights_out, src_tokens, src_ranks = \
                a2a.dispatch_recv_new(x.dtype, x.get_device(), sources, self._timeout)
        except BaseException:
            pooled.busy = False
            raise
        if num_worst_tokens > 0:
            # No wait for the count: rows past it hold no token (experts -1, weights 0).
            if num_worst_tokens > rows:
                raise InvalidArgument(f"num_worst_tokens {num_worst_tokens}: more than the "
                                      f"{rows} rows ranks can send here")
            with self._on_comm(a2a, current, x.device):
                live = torch.arange(num_worst_tokens, device=dev) < read_back[:1].long()
                experts[:num_worst_tokens].masked_fill_(~live[:, None], -1)
                weights_out[:num_worst_tokens].masked_fill_(~live[:, None], 0.0)
        received = _Received(read_back, src_tokens, src_ranks, recv, recv_scales, experts,
                             weights_out,
                             None if current is None or a2a.stream == current
                             else torch.cuda.current_stream(dev))
        if epilogue is not None:
            with self._on_comm(a2a, current, x.device):
                received.made = epilogue(received) or ()
        event = self._end(a2a, current, async_finish, (x, x_scales, topk_idx, weights),
                          (recv, recv_scales, read_back, experts, weights_out, src_tokens,
                           src_ranks) +
                          tuple(received.made))
        if num_worst_tokens > 0:
            r = num_worst_tokens
            per_expert_list = []
        else:
            event.current_stream_wait()
            read = read_back.tolist()
            r = read[0]
            got = (read[1:] if every_count is None
                   else self._received_per_expert(every_count))
            per_expert_list = (got if expert_alignment == 1 else
                               [_round_up(int(c), expert_alignment) for c in got])
        # The received rows, as views: one C++ call for them all.
        recv_x, rows_scales, rows_experts, rows_weights, received.src_idx = _ferry.first_rows(
            r, recv, recv_scales, experts, weights_out, src_tokens)
        out_x = (recv_x, rows_scales) if fp8 else recv_x
        if cached is not None:
            cached.pooled, cached.rows, cached.in_flight = pooled, r, True
            return out_x, None, None, None, None, event, received
        new = _Handle(pooled, tokens, k, hidden, num_experts, topk_idx, topk_weights=topk_weights,
                      rows=r)
        if every_count is not None:
            return out_x, None, None, per_expert_list, new, event, received
        recv_topk_idx = rows_experts  # int64, as the receive wrote them
        recv_topk_weights = rows_weights if topk_weights is not None else None
        return out_x, recv_topk_idx, recv_topk_weights, per_expert_list, new, event, received

    def _check_rank_routing(self, is_token_in_rank, topk_weights, num_worst_tokens, x):
        """What a dispatch without topk_idx (DeepEP routes by is_token_in_rank alone) takes."""
        if topk_weights is not None:
            raise InvalidArgument("topk_weights: given without topk_idx (the weights follow "
                                  "the ids)")
        if num_worst_tokens > 0:
            raise InvalidArgument(f"num_worst_tokens {num_worst_tokens}: needs topk_idx (the "
                                  "rows past those received are marked by their ids)")
        world = self.group_size
        check_tensor("is_token_in_rank", is_token_in_rank, torch.bool, 2, x.get_device())
        if tuple(is_token_in_rank.shape) != (x.shape[0], world):
            raise InvalidArgument(f"is_token_in_rank: shape {tuple(is_token_in_rank.shape)}, "
                                  f"expected {(x.shape[0], world)}")

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

    def _normal_handle(self, handle, call):
        """ferry's handle in a normal-mode one (V1's NormalHandle, or ElasticBuffer's)."""
        if isinstance(handle, NormalHandle):
            handle = handle._ferry
        if not isinstance(handle, _Handle) or handle.rows is None:
            raise InvalidArgument(f"{call}: handle is not one this Buffer's dispatch returned")
        return handle

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):
        """(combined_x [tokens, hidden] bf16: each token's rows from every rank that got it,
        summed without weights, plus bias; combined_topk_weights [tokens, columns] fp32 or None;
        event). bias: a [tokens, hidden] bf16 tensor or a pair of them, added in fp32 before the
        rows (a pair is first summed in fp32 and rounded to bf16 once: DeepEP keeps that sum in
        fp32). topk_weights: [received rows, columns] fp32, each token's rows summed over the
        ranks that got it as its x rows are (a second, small AllToAll of fp32 rows on the same
        stream; every rank passes it or none, or the ranks wait for each other until the
        deadline)."""
        self._check_open("combine")
        h = self._live_handle(self._normal_handle(handle, "combine"), "combine")
        check_tensor("x", x, torch.bfloat16, 2)
        if tuple(x.shape) != (h.rows, h.hidden):
            raise InvalidArgument(f"x: shape {tuple(x.shape)}, the dispatch received "
                                  f"{(h.rows, h.hidden)}")
        if topk_weights is not None:
            check_tensor("topk_weights", topk_weights, torch.float32, 2, x.get_device())
            if topk_weights.shape[0] != h.rows:
                raise InvalidArgument(f"topk_weights: {topk_weights.shape[0]} rows, the "
                                      f"dispatch received {h.rows}")
        biases = self._biases(bias, h, x)
        a2a = h.pooled.a2a
        out = _ferry.empty(torch.bfloat16, x.get_device(), h.tokens, h.hidden)
        combined_weights, kept = None, ()
        try:
            current = self._begin(h.pooled, x, previous_event, async_finish)
            if biases:  # the sums start from the bias: out, taken with accumulate
                with self._on_comm(a2a, current, x.device):
                    if len(biases) == 1:
                        out.copy_(biases[0])
                    else:
                        out.copy_(biases[0].float() + biases[1].float())
            # Positional: pybind11 matches keywords by name, a microsecond a call.
            a2a.combine_send(x, h.rows)
            a2a.combine_recv(out, bool(biases), self._timeout)
            if topk_weights is not None:
                combined_weights, kept = self._combine_weights(h, x, topk_weights, current)
        finally:
            self._release(h)
        return out, combined_weights, self._end(a2a, current, async_finish,
                                                (x, topk_weights) + biases + kept,
                                                (out, combined_weights))

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
        capacity = self._normal_capacity(h.hidden)
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
