"""DeepEP's Buffer: construction, its static helpers and its end; each mode's calls are in a
file of their own (_low_latency.py, _normal.py, _shrink.py), what they share in _streams.py."""

import os

import torch

from ... import _ferry
from .._group import Group, env_timeout, refuse
from ..._errors import InvalidArgument, Unimplemented
from ._events import Config, EventHandle, EventOverlap, LowLatencyHandle, _DONE, _round_up
from ._low_latency import _LowLatency
from ._normal import _Normal
from ._shrink import _Shrink, rejoin_from_env
from ._streams import _Streams


class Buffer(_LowLatency, _Normal, _Shrink, _Streams, _ferry.DeepEpBuffer):
    """DeepEP's communication buffer: dispatch and combine among the ranks of `group`.

    group: a torch.distributed ProcessGroup (gloo or NCCL; None for the default group), or a
    ferry.Bootstrap. num_nvl_bytes + num_rdma_bytes bound the tokens a normal-mode dispatch
    takes per rank (ferry's buffers for `num_ranks` ranks' tokens of that hidden size must fit);
    the low-latency mode sizes its buffers from each call's num_max_dispatch_tokens_per_rank.
    engine: a ferry.TransferEngine to use (default: one from the FERRY_* environment, made when
    an AllToAll first needs one). ranks_per_node: the NVLink domain (default: ranks on one host).
    forwarding: how the normal mode's tokens reach other nodes (ferry.Forwarding; default
    PER_RANK; NODE_ONCE: once per node, forwarded inside it, as DeepEP's internode normal mode
    does). rejoin: a function returning a ferry.Bootstrap of the whole world, where a masked
    rank's new process and the survivors meet (low_latency_update_mask_buffer(rank, False));
    default: a rendezvous at FERRY_REJOIN_RENDEZVOUS. join (default: FERRY_JOIN set): this
    process replaces a rank the others masked -- it meets their readmission over rejoin() (its
    rank and world from FERRY_RANK and FERRY_WORLD_SIZE where rejoin is the default) and
    `group` is not used.

    low_latency_dispatch, low_latency_combine, dispatch and combine are the C++ base's
    (_ferry.DeepEpBuffer), written once there: every argument checked, every form run; it asks
    the mixins here by name for what stays Python (a shape's AllToAll, the streams' torch
    objects, the torch work of the less common forms).
    """

    num_sms = 20

    def __init__(self, group=None, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                 num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                 use_fabric=False, explicitly_destroy=False, enable_shrink=False, comm=None, *,
                 engine=None, ranks_per_node=None, timeout=None, forwarding=None, rejoin=None,
                 join=None):
        if num_nvl_bytes < 0 or num_rdma_bytes < 0:
            raise InvalidArgument("num_nvl_bytes and num_rdma_bytes: at least 0")
        refuse("allow_mnnvl", allow_mnnvl, False, "multi-node NVLink domains are not supported")
        refuse("use_fabric", use_fabric, False,
               "fabric memory handles (multi-node NVLink) are not supported")
        if join is None:
            join = os.environ.get("FERRY_JOIN", "") not in ("", "0")
        if join:
            # A new process for a rank the others masked: its world is the readmission's.
            self._rejoin = rejoin or rejoin_from_env(None, None)
            if not enable_shrink:
                raise InvalidArgument("join=True: a rank comes back into a Buffer with "
                                      "enable_shrink=True")
            group = self._rejoin_group("Buffer(join=True)")
        elif group is None and comm is not None:  # DeepEP's mpi4py communicator
            group = _ferry.CallbackBootstrap(comm.Get_rank(), comm.Get_size(),
                                             lambda data, timeout: comm.allgather(data))
        self._group = Group(group, engine, ranks_per_node)
        self.rank, self.group_size = self._group.rank, self._group.world_size
        # A masked rank's return (low_latency_update_mask_buffer(rank, False)): where the
        # survivors and its new process meet.
        if not join:
            self._rejoin = rejoin or rejoin_from_env(self.rank, self.group_size)
        # How the normal mode's tokens reach other nodes (the low-latency mode's combine takes
        # its weights at the combine, which node-once cannot: per rank there always).
        self._forwarding = self._check_forwarding(
            _ferry.Forwarding.PER_RANK if forwarding is None else forwarding)
        # Node-once's partial sums (ElasticBuffer's allow_multiple_reduction=False: fp32).
        self._partial_sums = _ferry.PartialSums.COMBINE_ELEMENT
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.explicitly_destroy = explicitly_destroy
        # Shrink mode (DeepEP's mask buffer): the low-latency AllToAlls mask a rank that missed
        # a call's deadline instead of failing the call, and the mask calls below work.
        self.enable_shrink = bool(enable_shrink)
        self._masked = [0] * self.group_size  # what the mask calls set or found
        self._timeout = env_timeout() if timeout is None else float(timeout)
        self._constants = {}   # (device, rows, columns, value, comm) -> _constant's tensor
        self._weights_scratch = {}  # weights AllToAll key -> its dispatch's unread outputs
        self._ranks = {}       # device -> arange(ranks) int32 (_rank_prefix_sums)
        self._outputs = {}     # (AllToAll, fp8 form) -> the low-latency output sets (_ll_sets)
        self._combine_buffers = {}  # AllToAll -> get_next_low_latency_combine_buffer's tensor
        self._stream = None    # the communication stream (CUDA)
        self._streams = {}     # torch objects for other streams AllToAlls took (_stream_of)
        # The low-latency calls: checked and run in C++ (_ll_sets adds each shape's AllToAll
        # and output sets there).
        super().__init__(self.group_size, self._timeout, _DONE, LowLatencyHandle)
        self._destroyed = False
        if join:
            self._join_world()

    def _check_forwarding(self, forwarding):
        """forwarding, InvalidArgument unless the ranks are several nodes of several ranks
        where it is node-once."""
        if forwarding == _ferry.Forwarding.NODE_ONCE:
            per = self._group.ranks_per_node()
            if not 1 < per < self.group_size:
                raise InvalidArgument(f"forwarding=NODE_ONCE: {self.group_size} ranks in nodes "
                                      f"of {per}; it needs several nodes of several ranks")
        elif forwarding != _ferry.Forwarding.PER_RANK:
            raise InvalidArgument(f"forwarding: a ferry.Forwarding, got {forwarding!r}")
        return forwarding

    # ---- DeepEP's static helpers ------------------------------------------------------------

    @staticmethod
    def is_sm90_compiled():
        """Whether ferry's CUDA kernels are built (for sm_90): DeepEP's callers ask before they
        take its SM90-only features (fp8, its low-latency kernels)."""
        return _ferry.cuda_device_built()

    @staticmethod
    def capture():
        """An EventOverlap of an event recorded on the current CUDA stream (none without
        CUDA), as DeepEP's capture() makes for a call's previous_event."""
        return EventOverlap(EventHandle())

    def get_comm_stream(self):
        """The Buffer's communication stream (torch.cuda.Stream): where the AllToAlls whose
        first call asked for async_finish enqueue their steps."""
        self._check_open("get_comm_stream")
        if not torch.cuda.is_available():
            raise Unimplemented("get_comm_stream: no CUDA here (every call finished when it "
                                "returned)")
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    @staticmethod
    def set_num_sms(new_num_sms):
        if new_num_sms % 2:
            raise InvalidArgument("set_num_sms: an even number of SMs")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks):
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks):
        return Config(Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                       num_experts):
        """Bytes of what ferry's expert-major AllToAll keeps per rank for these shapes (its send
        rows, receive rows and counts), as DeepEP's hint sizes num_rdma_bytes."""
        m = num_max_dispatch_tokens_per_rank
        row = hidden * 2 + hidden // 128 * 4 + 16
        dispatch = num_ranks * m * row + (num_experts // max(num_ranks, 1)) * num_ranks * m * row
        combine = 2 * num_ranks * m * hidden * 2
        return _round_up(dispatch + combine + num_ranks * num_experts * 8, 128)

    def get_local_buffer_tensor(self, dtype, size=None, offset=0, use_rdma_buffer=False):
        raise Unimplemented("get_local_buffer_tensor: ferry's buffers are not one tensor")

    def destroy(self):
        if not self.explicitly_destroy:
            raise InvalidArgument("destroy: the Buffer was made with explicitly_destroy=False")
        self._close()

    def _close(self):
        if not self._destroyed:
            self._destroyed = True
            self._close_shapes()
            self._group.close()

    def __del__(self):
        try:
            if not self.explicitly_destroy:
                self._close()
        except Exception:  # noqa: BLE001 -- interpreter shutdown
            pass
