"""pplx-garden's AllToAllKernel protocol (its P2PAllToAll) over ferry's AllToAll.

A pplx user constructs `ferry.pplx.AllToAll(...)` with P2PAllToAll's keyword arguments where
they constructed P2PAllToAll; `dispatch` and `combine` take the same tensors:

- dispatch(out_expert_num_tokens [local experts] int32, out_expert_x [rows, hidden],
  out_expert_x_scale, dp_x [tokens, hidden], dp_x_scale, indices [tokens, k], weights [tokens,
  k] fp32, bound_m, do_send, do_recv): each local expert's tokens land contiguously in
  out_expert_x, expert e's block starting where the blocks before it end, each block's rows
  rounded up to expert_padding (the layout grouped GEMMs take); out_expert_num_tokens holds the
  unpadded counts.
- combine(out_tokens [tokens, hidden] (out_dtype), indices, weights, expert_y (out_expert_x's
  layout), bound_m, do_send, do_recv, accumulate): each token's weighted sum of its experts'
  rows.
- in_dtype bf16, float16, float32, e4m3 or int8 (1-byte rows with hidden_dim_scale float32
  scales per token, moved with their rows as they are: one per 128 columns, per token, or any
  groups; 2-byte rows, bf16 or float16 alike, moved as they are); out_dtype bf16, float16 or
  float32 (float32 only, with float32 input): with float32, expert_y and out_tokens in it and
  the sums fp32; else each combine takes expert_y bf16 or float16 and returns its sums in
  out_tokens of the same dtype (fp32 sums, rounded once).
- With max_tokens_per_expert = b (pplx's batched layout): out_expert_x is [local experts, b,
  hidden] (or those rows flat), expert e's tokens from row e * b, expert_padding unused. b below
  the most one expert can receive (every rank's max_num_tokens) bounds the routing: an expert
  sent more than b copies fails the dispatch with ResourceExhausted and leaves the AllToAll
  unusable (pplx's kernels would write past the block).
- dispatch_async / combine_async: the send half now, the returned handle's recv() the
  receive half, as pplx-garden's (for two micro-batches overlapped).

do_send / do_recv split each call into its send and receive halves (ferry's four steps, in
order). CPU tensors run on ferry's host device, CUDA tensors on its CUDA device, ordered with
the current torch stream (any: the legacy default one too; graph capture works).
Arguments ferry cannot honour raise Unimplemented naming them; bad tensors InvalidArgument.

A dp_group of d > 1 ranks (as pplx's: the ranks of a tensor-parallel group, which hold the same
tokens) sends each token once per group: the group's rank i sends the tokens t with t % d == i
(the others' ids read as -1), and the combine's receive half shares each token's sum with the
rest of the group -- every rank's rows but its own zeroed, then summed over the group as int32
words (exact: one rank's bits plus zeros), through dp_group (all_reduce; a ferry.Bootstrap
all-gathers through the host).
"""

import torch

from .. import _ferry
from .._errors import InvalidArgument, Unimplemented
from ._group import Group, env_timeout, fp8_dtype

__all__ = ["AllToAll", "DispatchHandle", "CombineHandle"]


class AllToAll(_ferry.PplxSteps):
    """Expert-parallel dispatch and combine among global_group's ranks (a torch.distributed
    group, or a ferry.Bootstrap), one shape fixed at construction as P2PAllToAll's is."""

    def __init__(self, *, max_num_tokens, num_experts, expert_padding, hidden_dim,
                 hidden_dim_scale, in_dtype, out_dtype, scale_dtype, num_experts_per_token,
                 nets_per_gpu=1, max_private_tokens=None, device=None, dp_group=None,
                 node_group=None, global_group=None, imm_base=0x80000000, transfer_engine=None,
                 worker_cpu=None, max_tokens_per_expert=None, timeout=None):
        device = torch.device(device if device is not None else "cpu")
        if device.type == "cuda" and device.index is None:  # as tensors name it: cuda:N
            device = torch.device("cuda", torch.cuda.current_device())
        # 1-byte rows travel as they are with their scales, whatever the byte means: e4m3, or
        # int8 (vLLM's int8 w8a8 path), or the bits as uint8.
        fp8 = in_dtype in (fp8_dtype(), torch.int8, torch.uint8)
        fp32 = in_dtype == torch.float32
        # 2-byte rows (bf16 or float16) move as they are.
        if in_dtype not in (torch.bfloat16, torch.float16) and not fp8 and not fp32:
            raise InvalidArgument(f"in_dtype {in_dtype}: bfloat16, float16, float32, "
                                  "float8_e4m3fn or int8")
        # ferry's combine sums bf16, fp16 or fp32 rows (2-byte ones as each call's expert_y
        # is: CombineInput::fp16; fp32: AllToAllConfig::fp32_combine); fp32 rows combine in
        # fp32.
        if (out_dtype not in (torch.float32, torch.bfloat16, torch.float16)
                or (fp32 and out_dtype != torch.float32)):
            raise Unimplemented(
                f"out_dtype {out_dtype} with in_dtype {in_dtype}: ferry's combine returns "
                f"{'float32' if fp32 else 'bfloat16, float16 or float32'} for this input")
        if fp8 and scale_dtype != torch.float32:
            raise Unimplemented(f"scale_dtype {scale_dtype}: ferry moves float32 scales")
        if fp8 and not (isinstance(hidden_dim_scale, int) and 1 <= hidden_dim_scale <= hidden_dim):
            raise InvalidArgument(f"hidden_dim_scale {hidden_dim_scale}: fp8 input needs scales, "
                                  f"1 to hidden_dim ({hidden_dim}) per token")
        if not fp8 and (scale_dtype is not None or hidden_dim_scale is not None):
            raise Unimplemented(f"scale_dtype / hidden_dim_scale with {in_dtype} input: ferry "
                                "moves scales with fp8 rows only")
        if expert_padding < 1:
            raise InvalidArgument(f"expert_padding {expert_padding}: at least 1")
        if max_tokens_per_expert is not None and max_tokens_per_expert < 1:
            raise InvalidArgument(f"max_tokens_per_expert {max_tokens_per_expert}: at least 1")
        self._group = Group(global_group, transfer_engine,
                            _size(node_group) if node_group is not None else None)
        self.world_size, self.rank = self._group.world_size, self._group.rank
        if num_experts % self.world_size:
            raise InvalidArgument(f"num_experts {num_experts}: not divisible by "
                                  f"{self.world_size} ranks")
        self.num_local_experts = num_experts // self.world_size
        if dp_group is not None and _size(dp_group) > 1:
            self._dp, self._dp_size, self._dp_rank = dp_group, _size(dp_group), _rank(dp_group)
            if self.world_size % self._dp_size:
                raise InvalidArgument(f"dp_group of {self._dp_size} ranks: the "
                                      f"{self.world_size} ranks do not split into such groups")
            if hidden_dim % 2:
                raise InvalidArgument(f"hidden_dim {hidden_dim}: even with a dp_group (rows "
                                      "are shared as int32 words)")
            self._theirs = {}  # (tokens, device) -> bool [tokens, 1]: the others' share
            # Instance attributes: the calls of a group of one stay PplxSteps' own.
            self.dispatch, self.combine = self._dp_dispatch, self._dp_combine
        cuda = device.type == "cuda"
        device_id = device.index if cuda else -1  # as Tensor.get_device() says
        timeout = self._timeout = env_timeout() if timeout is None else float(timeout)
        fields = dict(num_experts=num_experts, experts_per_token=num_experts_per_token,
                      max_tokens_per_rank=max_num_tokens, hidden=hidden_dim,
                      dtype=(_ferry.DispatchDtype.FP8_E4M3 if fp8 else
                             _ferry.DispatchDtype.FP32 if fp32 else _ferry.DispatchDtype.BF16))
        if max_private_tokens is not None:
            fields["max_private_tokens"] = max_private_tokens
        if out_dtype == torch.float32 and not fp32:
            fields["fp32_combine"] = True
        if fp8 and (hidden_dim % 128 or hidden_dim_scale != hidden_dim // 128):
            # Scales other than one per 128 columns (per token, other groups) travel with their
            # rows as they are.
            fields["fp8_scales"] = hidden_dim_scale

        def make():
            c = _ferry.AllToAllConfig(**fields)
            c.device = _ferry.MoeDevice.CUDA if cuda else _ferry.MoeDevice.HOST
            if cuda:
                c.cuda_device = device.index or 0
                c.ranks_per_node = self._group.ranks_per_node()
            # pplx's layer crosses nodes per rank: its calls over node-once forwarding are
            # not tested yet.
            c.forwarding = _ferry.Forwarding.PER_RANK
            return c

        self._a2a = self._group.acquire(("pplx",), make).a2a
        # The rows out_expert_x needs: every copy of every rank's tokens that can land here
        # (each token at most min(k, local experts) times) and every block's padding; batched,
        # a block of max_tokens_per_expert per local expert.
        block = max_tokens_per_expert or 0
        self.max_recv_tokens = (self.num_local_experts * block if block
                                else self._a2a.config.padded_rows(expert_padding))
        # PplxSteps takes float16 rows where it is told bfloat16 (2-byte rows either way).
        row_dtype = torch.bfloat16 if in_dtype == torch.float16 else in_dtype
        _ferry.PplxSteps.__init__(self, self._a2a, row_dtype, max_num_tokens, hidden_dim,
                                  num_experts_per_token, self.num_local_experts,
                                  self.max_recv_tokens, 0 if block else expert_padding,
                                  device_id, timeout, block)

    def destroy(self):
        self._group.close()

    def dispatch_async(self, *, out_expert_num_tokens, out_expert_x, out_expert_x_scale, dp_x,
                       dp_x_scale, indices, weights, bound_m=None):
        """dispatch's send half now; the handle's recv() runs its receive half."""
        self.dispatch(out_expert_num_tokens, out_expert_x, out_expert_x_scale, dp_x, dp_x_scale,
                      indices, weights, bound_m, True, False)
        return DispatchHandle(self, out_expert_num_tokens, out_expert_x, out_expert_x_scale,
                              dp_x, dp_x_scale, indices, weights, bound_m)

    def combine_async(self, *, out_tokens, dispatch_handle, expert_y, bound_m=None,
                      accumulate=False):
        """combine's send half now (the ids and weights dispatch_handle's); the handle's
        recv() runs its receive half."""
        self.combine(out_tokens, dispatch_handle.indices, dispatch_handle.weights, expert_y,
                     bound_m, True, False, accumulate)
        return CombineHandle(self, dispatch_handle, out_tokens, expert_y, bound_m, accumulate)

    def get_perf_stats(self):
        raise Unimplemented("get_perf_stats: ferry keeps no per-peer byte counters")

    def _their_rows(self, tokens, device):
        """The rows of the tokens the group's other ranks send, as a [tokens, 1] mask."""
        key = (tokens, device)
        theirs = self._theirs.get(key)
        if theirs is None:
            theirs = self._theirs[key] = (
                torch.arange(tokens, device=device) % self._dp_size != self._dp_rank)[:, None]
        return theirs

    def _dp_dispatch(self, out_expert_num_tokens, out_expert_x, out_expert_x_scale, dp_x,
                     dp_x_scale, indices, weights, bound_m=None, do_send=True, do_recv=True):
        """PplxSteps.dispatch, sending only this rank's share of the group's tokens."""
        if do_send and isinstance(indices, torch.Tensor) and indices.dim() == 2:
            ids = indices.view(torch.int32) if indices.dtype == _UINT32 else indices
            indices = ids.masked_fill(self._their_rows(ids.shape[0], ids.device), -1)
        _ferry.PplxSteps.dispatch(self, out_expert_num_tokens, out_expert_x, out_expert_x_scale,
                                  dp_x, dp_x_scale, indices, weights, bound_m, do_send, do_recv)

    def _dp_combine(self, out_tokens, indices, weights, expert_y, bound_m=None, do_send=True,
                    do_recv=True, accumulate=False):
        """PplxSteps.combine; its receive half then shares each token's sum (its owner's row)
        with the group."""
        _ferry.PplxSteps.combine(self, out_tokens, indices, weights, expert_y, bound_m, do_send,
                                 do_recv, accumulate)
        if not do_recv:
            return
        out_tokens.masked_fill_(self._their_rows(out_tokens.shape[0], out_tokens.device), 0)
        words = out_tokens.view(torch.int32)
        if isinstance(self._dp, _ferry.Bootstrap):
            parts = self._dp.all_gather(words.cpu().numpy().tobytes(), self._timeout)
            total = torch.zeros(words.shape, dtype=torch.int32)
            for part in parts:
                total += torch.frombuffer(bytearray(part), dtype=torch.int32).view(words.shape)
            words.copy_(total)
        else:
            import torch.distributed as dist
            dist.all_reduce(words, group=self._dp)

    # dispatch and combine are PplxSteps' (python/src/compat.cc): every argument checked
    # before either half runs, then both in one call of the AllToAll's, on the caller's current
    # stream (the AllToAll takes it at its first dispatch; a call from another stream is
    # ordered by events). The halves run dispatch send, dispatch receive, combine send, combine
    # receive; `stage` says where they stand.


class DispatchHandle:
    """A dispatch whose send half ran (AllToAll.dispatch_async); recv() runs its receive half,
    once (later calls do nothing). The halves are ordered with whatever stream is current at
    each, as every call of the AllToAll's is."""

    def __init__(self, kernel, out_expert_num_tokens, out_expert_x, out_expert_x_scale, dp_x,
                 dp_x_scale, indices, weights, bound_m):
        self.kernel = kernel
        self.out_expert_num_tokens, self.out_expert_x = out_expert_num_tokens, out_expert_x
        self.out_expert_x_scale, self.dp_x, self.dp_x_scale = out_expert_x_scale, dp_x, dp_x_scale
        self.indices, self.weights, self.bound_m = indices, weights, bound_m
        self.recv_done = False

    def recv(self):
        if self.recv_done:
            return
        self.kernel.dispatch(self.out_expert_num_tokens, self.out_expert_x,
                             self.out_expert_x_scale, self.dp_x, self.dp_x_scale, self.indices,
                             self.weights, self.bound_m, False, True)
        self.recv_done = True


class CombineHandle:
    """A combine whose send half ran (AllToAll.combine_async); recv() runs its receive half
    into out_tokens, once."""

    def __init__(self, kernel, dispatch_handle, out_tokens, expert_y, bound_m, accumulate):
        self.kernel, self.dispatch_handle = kernel, dispatch_handle
        self.out_tokens, self.expert_y = out_tokens, expert_y
        self.bound_m, self.accumulate = bound_m, accumulate
        self.recv_done = False

    def recv(self):
        if self.recv_done:
            return
        self.kernel.combine(self.out_tokens, self.dispatch_handle.indices,
                            self.dispatch_handle.weights, self.expert_y, self.bound_m, False,
                            True, self.accumulate)
        self.recv_done = True


_UINT32 = getattr(torch, "uint32", None)  # pplx's id dtype (torch 2.3 on)


def _rank(group):
    return _ask(group, "rank", "rank", "get_rank")


def _size(group):
    return _ask(group, "world_size", "size", "get_world_size")


def _ask(group, bootstrap_attr, method, dist_fn):
    """A group's rank or size: a ferry.Bootstrap's attribute, a group object's method (or int
    attribute), or torch.distributed's answer for a torch group."""
    if isinstance(group, _ferry.Bootstrap):
        return getattr(group, bootstrap_attr)
    value = getattr(group, method, None)
    if callable(value):
        return value()
    if isinstance(value, int):
        return value
    import torch.distributed as dist
    return getattr(dist, dist_fn)(group=group)
