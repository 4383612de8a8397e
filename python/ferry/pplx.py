"""pplx-garden's AllToAllKernel protocol (its P2PAllToAll) over ferry's AllToAll.

A pplx user constructs `ferry.pplx.AllToAll(...)` with P2PAllToAll's keyword arguments where
they constructed P2PAllToAll; `dispatch` and `combine` take the same tensors:

- dispatch(out_expert_num_tokens [local experts] int32, out_expert_x [rows, hidden],
  out_expert_x_scale, dp_x [tokens, hidden], dp_x_scale, indices [tokens, k], weights [tokens,
  k] fp32, bound_m, do_send, do_recv): each local expert's tokens land contiguously in
  out_expert_x, expert e's block starting where the blocks before it end, each block's rows
  rounded up to expert_padding (the layout grouped GEMMs take); out_expert_num_tokens holds the
  unpadded counts.
- combine(out_tokens [tokens, hidden] bf16, indices, weights, expert_y (out_expert_x's layout),
  bound_m, do_send, do_recv, accumulate): each token's weighted sum of its experts' rows.

do_send / do_recv split each call into its send and receive halves (ferry's four steps, in
order). CPU tensors run on ferry's host device, CUDA tensors on its CUDA device, ordered with
the current torch stream (any: the legacy default one too; graph capture works).
Arguments ferry cannot honour raise Unimplemented naming them; bad tensors InvalidArgument.
"""

import torch

from . import _ferry
from ._engine_api import (Group, check_tensor, current_stream_handle, env_timeout, fp8_dtype,
                          refuse)
from ._errors import FailedPrecondition, InvalidArgument, Unimplemented

__all__ = ["AllToAll"]

_SEND, _RECV = 1, 2  # AllToAll.dispatch / combine's halves
_AMAX = _ferry.Fp8Scaling.AMAX  # pplx's callers quantise themselves; unused but required

_ID_DTYPES = tuple(d for d in (torch.int32, torch.int64, getattr(torch, "uint32", None)) if d)


class AllToAll:
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
        if out_dtype != torch.bfloat16:
            raise InvalidArgument(f"out_dtype {out_dtype}: ferry's combine returns bfloat16")
        fp8 = in_dtype in (fp8_dtype(), torch.uint8)
        if in_dtype != torch.bfloat16 and not fp8:
            raise InvalidArgument(f"in_dtype {in_dtype}: bfloat16 or float8_e4m3fn")
        if fp8 and (scale_dtype != torch.float32 or hidden_dim_scale != hidden_dim // 128):
            raise InvalidArgument(
                f"fp8 input: scale_dtype float32 and hidden_dim_scale {hidden_dim // 128} "
                f"(one scale per 128 columns), got {scale_dtype} and {hidden_dim_scale}")
        if not fp8 and (scale_dtype is not None or hidden_dim_scale is not None):
            raise InvalidArgument("bfloat16 input takes no scale_dtype / hidden_dim_scale")
        if expert_padding < 1:
            raise InvalidArgument(f"expert_padding {expert_padding}: at least 1")
        if dp_group is not None and _size(dp_group) > 1:
            raise Unimplemented(f"dp_group of {_size(dp_group)} ranks: ranks of a data-parallel "
                                "group sharing their tokens are not supported")
        refuse("max_tokens_per_expert", max_tokens_per_expert, None,
               "a cap on one expert's tokens is not supported (ferry sizes for the worst case)")
        self._group = Group(global_group, transfer_engine,
                            _size(node_group) if node_group is not None else None)
        self.world_size, self.rank = self._group.world_size, self._group.rank
        if num_experts % self.world_size:
            raise InvalidArgument(f"num_experts {num_experts}: not divisible by "
                                  f"{self.world_size} ranks")
        self.num_local_experts = num_experts // self.world_size
        self._device, self._fp8, self._padding = device, fp8, expert_padding
        self._cuda = device.type == "cuda"
        self._device_id = device.index if self._cuda else -1  # as Tensor.get_device() says
        self._hidden, self._k, self._max_tokens = hidden_dim, num_experts_per_token, max_num_tokens
        self._in_dtype = in_dtype
        self._timeout = env_timeout() if timeout is None else float(timeout)
        cuda = device.type == "cuda"
        fields = dict(num_experts=num_experts, experts_per_token=num_experts_per_token,
                      max_tokens_per_rank=max_num_tokens, hidden=hidden_dim,
                      dtype=_ferry.DispatchDtype.FP8_E4M3 if fp8 else _ferry.DispatchDtype.BF16)
        if max_private_tokens is not None:
            fields["max_private_tokens"] = max_private_tokens

        def make():
            c = _ferry.AllToAllConfig(**fields)
            c.device = _ferry.MoeDevice.CUDA if cuda else _ferry.MoeDevice.HOST
            if cuda:
                c.cuda_device = device.index or 0
                c.ranks_per_node = self._group.ranks_per_node()
            return c

        self._a2a = self._group.acquire(("pplx",), make).a2a
        self.max_recv_tokens = self._a2a.config.padded_rows(expert_padding)
        self._stage = "idle"
        self._stream = None  # the AllToAll's own stream (CUDA), made at the first call
        self._recv_rows = 0  # out_expert_x's rows at the last dispatch (expert_y's at combine)
        # max_recv_tokens (set above): the rows out_expert_x needs, every copy of every rank's
        # tokens that can land here (each token at most min(k, local experts) times) and every
        # block's padding.

    def destroy(self):
        self._group.close()

    # ---- the protocol --------------------------------------------------------------------

    def dispatch(self, out_expert_num_tokens, out_expert_x, out_expert_x_scale, dp_x, dp_x_scale,
                 indices, weights, bound_m=None, do_send=True, do_recv=True):
        # Every argument checked before either half runs; then both in one call of the
        # AllToAll's, ordered once with the caller's stream.
        halves = (_SEND if do_send else 0) | (_RECV if do_recv else 0)
        if not halves:
            raise InvalidArgument("dispatch: do_send or do_recv (or both)")
        self._expect("idle" if do_send else "dispatched", "dispatch")
        tokens = None
        if do_send:
            self._check_tokens(dp_x, dp_x_scale, indices, weights)
            tokens = self._bound(dp_x, bound_m)
        if do_recv:
            self._check_expert_outputs(out_expert_num_tokens, out_expert_x, out_expert_x_scale)
        # ferry lays the padded blocks out itself (DispatchOutput::expert_padding).
        self._a2a.dispatch(dp_x, indices, weights, dp_x_scale, tokens,
                           bound_m if self._cuda else None, _AMAX, out_expert_x,
                           out_expert_num_tokens, out_expert_x_scale, self._timeout,
                           self._padding, self._current_stream(), halves, True, True)
        if do_recv:
            self._recv_rows = out_expert_x.shape[0]
        self._stage = "received" if do_recv else "dispatched"

    def combine(self, out_tokens, indices, weights, expert_y, bound_m=None, do_send=True,
                do_recv=True, accumulate=False):
        halves = (_SEND if do_send else 0) | (_RECV if do_recv else 0)
        if not halves:
            raise InvalidArgument("combine: do_send or do_recv (or both)")
        self._expect("received" if do_send else "combining", "combine")
        if do_send:
            check_tensor("expert_y", expert_y, torch.bfloat16, 2, self._device_id)
            if tuple(expert_y.shape) != (self._recv_rows, self._hidden):
                raise InvalidArgument(f"expert_y: shape {tuple(expert_y.shape)}, out_expert_x "
                                      f"was {(self._recv_rows, self._hidden)}")
        if do_recv:
            check_tensor("out_tokens", out_tokens, torch.bfloat16, 2, self._device_id)
            check_tensor("weights", weights, torch.float32, 2, self._device_id)
        self._a2a.combine(expert_y, out_tokens, weights, accumulate, self._timeout,
                          self._current_stream(), halves, True, True)
        self._stage = "idle" if do_recv else "combining"

    # ---- helpers ---------------------------------------------------------------------------

    def _expect(self, stage, call):
        if self._stage != stage:
            raise FailedPrecondition(
                f"{call} out of order: the halves run dispatch send, dispatch receive, combine "
                f"send, combine receive (this AllToAll is at '{self._stage}')")

    def _check_tokens(self, dp_x, dp_x_scale, indices, weights):
        check_tensor("dp_x", dp_x, self._in_dtype, 2, self._device_id)
        tokens, hidden = dp_x.shape
        if hidden != self._hidden or tokens > self._max_tokens:
            raise InvalidArgument(f"dp_x: shape {tuple(dp_x.shape)}, at most "
                                  f"{(self._max_tokens, self._hidden)}")
        if self._fp8:
            check_tensor("dp_x_scale", dp_x_scale, torch.float32, 2, self._device_id)
            if tuple(dp_x_scale.shape) != (tokens, hidden // 128):
                raise InvalidArgument(f"dp_x_scale: shape {tuple(dp_x_scale.shape)}, expected "
                                      f"{(tokens, hidden // 128)}")
        elif dp_x_scale is not None:
            raise InvalidArgument("dp_x_scale: bfloat16 input has no scales")
        check_tensor("indices", indices, _ID_DTYPES, 2, self._device_id)
        check_tensor("weights", weights, torch.float32, 2, self._device_id)
        for name, t in (("indices", indices), ("weights", weights)):
            if tuple(t.shape) != (tokens, self._k):
                raise InvalidArgument(f"{name}: shape {tuple(t.shape)}, expected "
                                      f"{(tokens, self._k)}")

    def _check_expert_outputs(self, counts, out_x, out_scales):
        check_tensor("out_expert_num_tokens", counts, torch.int32, 1, self._device_id)
        if counts.numel() != self.num_local_experts:
            raise InvalidArgument(f"out_expert_num_tokens: {self.num_local_experts} entries, got "
                                  f"{counts.numel()}")
        check_tensor("out_expert_x", out_x, self._in_dtype, 2, self._device_id)
        if out_x.shape[1] != self._hidden or out_x.shape[0] < self.max_recv_tokens:
            raise InvalidArgument(f"out_expert_x: shape {tuple(out_x.shape)}, needs at least "
                                  f"{(self.max_recv_tokens, self._hidden)} (max_recv_tokens: "
                                  f"the worst routing's padded blocks)")
        if self._fp8:
            check_tensor("out_expert_x_scale", out_scales, torch.float32, 2, self._device_id)
            if tuple(out_scales.shape) != (out_x.shape[0], self._hidden // 128):
                raise InvalidArgument(f"out_expert_x_scale: shape {tuple(out_scales.shape)}, "
                                      f"expected {(out_x.shape[0], self._hidden // 128)}")
        elif out_scales is not None:
            raise InvalidArgument("out_expert_x_scale: bfloat16 input has no scales")

    def _bound(self, dp_x, bound_m):
        """The tokens sent: bound_m's value (read here on the host device; on the GPU the
        kernels read it, dp_x's rows being the most it may hold)."""
        if bound_m is None:
            return dp_x.shape[0]
        check_tensor("bound_m", bound_m, torch.int32, None, self._device_id)
        if bound_m.numel() != 1:
            raise InvalidArgument(f"bound_m: one int32, got {bound_m.numel()}")
        if self._cuda:
            return dp_x.shape[0]
        m = int(bound_m.item())
        if not 0 <= m <= dp_x.shape[0]:
            raise InvalidArgument(f"bound_m {m}: dp_x has {dp_x.shape[0]} rows")
        return m

    def _current_stream(self):
        """The caller's current stream on the GPU (None on the CPU): the AllToAll's steps go on
        a stream of its own (set once: its four steps must share one), ordered after the
        caller's and the caller's after them by the AllToAll's event (no host wait; any current
        stream, the legacy default and a graph capture's included). The AllToAll keeps the
        caller's tensors referenced until their steps finish."""
        if not self._cuda:
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._device)
            self._a2a.set_stream(self._stream)
        return current_stream_handle(self._device_id)


def _size(group):
    if isinstance(group, _ferry.Bootstrap):
        return group.world_size
    size = getattr(group, "size", None)
    if callable(size):
        return size()
    if isinstance(size, int):
        return size
    import torch.distributed as dist
    return dist.get_world_size(group=group)
