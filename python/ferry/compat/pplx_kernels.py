"""pplx-kernels' AllToAll (`pplx_kernels.AllToAll`, the API vLLM's pplx backend calls) over
ferry.pplx.

pplx-kernels is pplx-garden's predecessor, deprecated by its authors but still what vLLM's
`pplx` all2all backend imports: `pplx_kernels.AllToAll.intranode(...)` / `.internode(...)`
constructed from byte sizes, a dispatch without weights, the weights given to the combine, and
`pplx_kernels.nvshmem` to set NVSHMEM up first. `install()` puts this module where those imports
look (`pplx_kernels` and `pplx_kernels.nvshmem` in sys.modules), so that an engine written
against pplx-kernels runs on ferry unchanged:

    import ferry.pplx_kernels
    ferry.pplx_kernels.install()  # before the engine imports pplx_kernels

or, for every process an engine starts (its workers too), with nothing in its code changed:

    PYTHONPATH=$(python3 -c "import ferry.pplx_kernels as p; print(p.shim_path())")

(shim_path(): a folder holding a `pplx_kernels` package of this module's names).

What the calls mean, as pplx-kernels has them:

- intranode / internode(max_num_tokens, num_experts, experts_per_token, rank, world_size,
  dp_size, hidden_dim, hidden_dim_bytes, hidden_dim_scale_bytes[, group_name]): the rows'
  element follows from hidden_dim_bytes / hidden_dim (1: e4m3 or int8 with float32 scales, moved
  as they are; 2: bf16 or float16; 4: float32); hidden_dim_scale_bytes / 4 scales a row (vLLM
  rounds both to 16 bytes, so a row with 23 scales is given 24: the caller's dp_x_scale may have
  fewer columns than that, and the rest travel as zeros). intranode's ranks are the
  torch.distributed group named group_name ("default": the default group), internode's those
  nvshmem_init joined (the default group where it was not called); either takes a `group=` of
  the caller's (a torch group or a ferry.Bootstrap) instead. dp_size consecutive ranks hold the
  same tokens (a tensor-parallel group): each token is sent once per group and every rank of the
  group gets its sums (ferry.pplx's dp_group).
- dispatch(out_expert_num_tokens [local experts] int32, out_expert_x [local experts,
  max_num_tokens * world_size / dp_size, hidden], out_expert_x_scale, dp_x [tokens, hidden],
  dp_x_scale, indices [tokens, k] (uint32, int32 or int64), bound_m, do_send, do_recv): expert
  e's rows from row 0 of its block, out_expert_num_tokens its count. out_expert_x_scale may
  have more columns than a row's scales (vLLM gives per-token scales hidden of them): the
  scales fill its first columns.
- combine(out_tokens [tokens, hidden], indices, weights [tokens, k] float32, expert_y
  (out_expert_x's shape, bf16 or float16; float32 for float32 rows), bound_m, do_send,
  do_recv): each token's weighted sum of its experts' rows, written over out_tokens (of
  expert_y's dtype).

ferry needs no NVSHMEM, but its set-up calls mean what NVSHMEM's do: the unique id names where
rank 0 waits (a ferry rendezvous; nvshmem_get_unique_id says which address), and
`nvshmem_init(uid, rank, world_size)` joins the ranks given the same id. Those are internode's
ranks, whether or not they are a torch.distributed group (vLLM's EP group need not be the whole
world, and newer vLLM broadcasts the id through a store of its own). World size 1 runs too
(pplx-kernels asserts two DP groups or more). 2-byte rows may be bf16 or float16 (each combine
sums as its expert_y is, into out_tokens of the same dtype); what ferry cannot honour (1-byte
rows without scales, out_tokens of another dtype than expert_y's) is refused by name, as
ferry.pplx refuses it.
"""

import importlib.machinery
import os
import sys
import types

import torch

from .. import _ferry
from .._errors import FailedPrecondition, InvalidArgument, Unimplemented
from . import pplx as _pplx
from ._group import fp8_dtype, shim_path as _shim_path

__all__ = ["AllToAll", "install", "nvshmem", "nvshmem_alloc_empty_unique_id",
           "nvshmem_finalize", "nvshmem_get_unique_id", "nvshmem_init", "shim_path"]

_UNIQUE_ID_BYTES = 128  # sizeof(nvshmemx_uniqueid_t): what callers broadcast among the ranks
_UID_MAGIC = b"ferry-uid:"  # then the rendezvous address, "HOST:PORT", NUL-padded
_uid_ports = {}  # address -> the socket that holds its port until rank 0's nvshmem_init
_team = None  # nvshmem_init's ranks: (uid bytes, rank, world_size, ferry.Bootstrap)


def nvshmem_get_unique_id():
    """A unique id for nvshmem_init (a uint8 CPU tensor of NVSHMEM's size, for the caller to
    broadcast), as NVSHMEM's: the address where rank 0's nvshmem_init will wait for the
    others. Its host is NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME's IPv4 address (the variable NVSHMEM
    reads: an interface name or the start of one), else the first non-loopback interface's that
    is up, else 127.0.0.1; its port is free, held from now until that nvshmem_init."""
    import socket
    host = _uid_host()
    port = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    port.bind((host, 0))
    address = "%s:%d" % port.getsockname()
    _uid_ports[address] = port
    uid = torch.zeros(_UNIQUE_ID_BYTES, dtype=torch.uint8)
    text = _UID_MAGIC + address.encode()
    uid[:len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    return uid


def nvshmem_alloc_empty_unique_id():
    """The receivers' buffer for the broadcast unique id (zeros)."""
    return torch.zeros(_UNIQUE_ID_BYTES, dtype=torch.uint8)


def nvshmem_init(uid, rank, world_size, local_rank=-1):
    """Joins the ranks of the unique id, as NVSHMEM's: rank 0 waits at its address for the
    world_size - 1 others (FERRY_RENDEZVOUS_TIMEOUT_MS, 60 s by default; DeadlineExceeded
    naming those that never came). internode's AllToAlls then run among them, whatever
    torch.distributed's groups are. Again with the same arguments: nothing to do. Returns 0,
    NVSHMEM's status for success."""
    global _team
    if not isinstance(uid, torch.Tensor) or uid.numel() != _UNIQUE_ID_BYTES:
        raise InvalidArgument(f"nvshmem_init: uid must be the {_UNIQUE_ID_BYTES}-byte tensor "
                              "nvshmem_get_unique_id returns")
    if not isinstance(rank, int) or not isinstance(world_size, int) or not 0 <= rank < world_size:
        raise InvalidArgument(f"nvshmem_init: rank {rank} of {world_size}")
    key = bytes(uid.detach().cpu().contiguous().view(torch.uint8).tolist())
    if _team is not None:
        if _team[:3] == (key, rank, world_size):
            return 0
        raise FailedPrecondition(f"nvshmem_init: already joined as rank {_team[1]} of "
                                 f"{_team[2]} (nvshmem_finalize first)")
    if not key.startswith(_UID_MAGIC):
        raise InvalidArgument("nvshmem_init: uid is not one nvshmem_get_unique_id made (was it "
                              "broadcast from the rank that made it?)")
    address = key[len(_UID_MAGIC):].rstrip(b"\0").decode(errors="replace")
    port = _uid_ports.pop(address, None)
    if port is not None:
        port.close()  # rank 0's rendezvous listens there now
    bootstrap = _ferry.join_rendezvous(address, world_size, rank)
    _team = (key, rank, world_size, bootstrap)
    return 0


def nvshmem_finalize():
    """Leaves nvshmem_init's ranks (AllToAlls made over them keep what they hold)."""
    global _team
    _team = None
    for port in _uid_ports.values():
        port.close()
    _uid_ports.clear()


def _uid_host():
    """The IPv4 address a unique id names (nvshmem_get_unique_id says which)."""
    import fcntl
    import socket
    import struct
    wanted = os.environ.get("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "")
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            if wanted and not name.startswith(wanted):
                continue
            packed = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack("H", fcntl.ioctl(probe, _SIOCGIFFLAGS, packed)[16:18])[0]
                address = socket.inet_ntoa(fcntl.ioctl(probe, _SIOCGIFADDR, packed)[20:24])
            except OSError:  # no IPv4 address
                continue
            if wanted or (flags & _IFF_UP and not flags & _IFF_LOOPBACK):
                return address
    finally:
        probe.close()
    if wanted:
        raise InvalidArgument(f"NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME={wanted}: no interface of "
                              "that name has an IPv4 address")
    return "127.0.0.1"


_SIOCGIFFLAGS, _SIOCGIFADDR = 0x8913, 0x8915  # linux/sockios.h
_IFF_UP, _IFF_LOOPBACK = 0x1, 0x8  # net/if.h


nvshmem = types.ModuleType("pplx_kernels.nvshmem", "pplx_kernels.nvshmem over ferry: "
                           "no NVSHMEM is set up (ferry.pplx_kernels says why)")
# importlib.util.find_spec (how engines ask whether a package is there) reads __spec__.
nvshmem.__spec__ = importlib.machinery.ModuleSpec("pplx_kernels.nvshmem", None)
for _name in ("nvshmem_get_unique_id", "nvshmem_alloc_empty_unique_id", "nvshmem_init",
              "nvshmem_finalize"):
    setattr(nvshmem, _name, globals()[_name])


def install():
    """Makes `import pplx_kernels` (and `pplx_kernels.nvshmem`) give this module in this
    process; refused if another pplx_kernels was imported first (its AllToAlls would not be
    ferry's). Nothing to do where the shim package (shim_path()) was imported."""
    this = sys.modules[__name__]
    for name, module in (("pplx_kernels", this), ("pplx_kernels.nvshmem", nvshmem)):
        present = sys.modules.get(name)
        if present is not None and present is not module:
            if getattr(present, "FERRY_SHIM", False):
                continue
            raise FailedPrecondition(f"install: {name} was imported before ferry's "
                                     f"({getattr(present, '__file__', present)})")
        sys.modules[name] = module


def shim_path():
    """The folder to put on PYTHONPATH for `import pplx_kernels` to find ferry's."""
    return _shim_path("pplx_kernels")


# What a row's bytes per column say its element is.
_ELEMENTS = {1: fp8_dtype(), 2: torch.bfloat16, 4: torch.float32}


class AllToAll:
    """pplx_kernels.AllToAll: made by intranode / internode, as pplx-kernels' is."""

    def __init__(self, inner, scales, k, max_num_tokens, device, dp):
        self._inner = inner  # ferry.pplx.AllToAll
        self._scales = scales  # float32 scales a row (0: rows without scales)
        self._scale_scratch = {}  # (experts, rows, device) -> [experts, rows, scales] float32
        # The dispatch's weights: pplx-kernels' dispatch takes none (its combine does); ferry's
        # reads a [tokens, k] float32 array at the send half and leaves its values unused.
        inner.use_ones(torch.ones(max_num_tokens, k, dtype=torch.float32, device=device))
        # combine(out_tokens, indices, weights, expert_y, bound_m, do_send=True, do_recv=True)
        # is ferry.pplx's (accumulate left False: pplx-kernels' combine writes out_tokens), and
        # so is the dispatch where nothing is left to do in Python (no scales to widen, no
        # data-parallel group): the calls go straight to C++, which checks their arguments.
        self.combine = inner.combine
        if not scales and not dp:
            self.dispatch = inner.dispatch_unweighted

    @classmethod
    def intranode(cls, max_num_tokens, num_experts, experts_per_token, rank, world_size,
                  dp_size, hidden_dim, hidden_dim_bytes, hidden_dim_scale_bytes,
                  group_name="default", *, group=None, device=None, timeout=None):
        """Ranks of one node: the torch.distributed group named group_name (or `group`)."""
        if group is None and group_name not in (None, "default"):
            group = _group_named(group_name)
        return cls._create(max_num_tokens, num_experts, experts_per_token, rank, world_size,
                           dp_size, hidden_dim, hidden_dim_bytes, hidden_dim_scale_bytes, group,
                           device, timeout)

    @classmethod
    def internode(cls, max_num_tokens, num_experts, experts_per_token, rank, world_size,
                  dp_size, hidden_dim, hidden_dim_bytes, hidden_dim_scale_bytes, *, group=None,
                  device=None, timeout=None):
        """Ranks of several nodes: those nvshmem_init joined (or `group`; without either, the
        default torch.distributed group)."""
        if group is None and _team is not None:
            if _team[1:3] != (rank, world_size):
                raise InvalidArgument(f"internode: rank {rank} of {world_size}, but nvshmem_init "
                                      f"was given rank {_team[1]} of {_team[2]}")
            group = _team[3]
        return cls._create(max_num_tokens, num_experts, experts_per_token, rank, world_size,
                           dp_size, hidden_dim, hidden_dim_bytes, hidden_dim_scale_bytes, group,
                           device, timeout)

    @classmethod
    def _create(cls, max_num_tokens, num_experts, experts_per_token, rank, world_size, dp_size,
                hidden_dim, hidden_dim_bytes, hidden_dim_scale_bytes, group, device, timeout):
        for name, v in (("max_num_tokens", max_num_tokens), ("num_experts", num_experts),
                        ("experts_per_token", experts_per_token), ("world_size", world_size),
                        ("dp_size", dp_size), ("hidden_dim", hidden_dim)):
            if not isinstance(v, int) or v < 1:
                raise InvalidArgument(f"{name} {v!r}: a positive int")
        if world_size % dp_size:
            raise InvalidArgument(f"dp_size {dp_size}: does not divide world_size {world_size}")
        item = hidden_dim_bytes // hidden_dim if hidden_dim_bytes % hidden_dim == 0 else 0
        if item not in _ELEMENTS:
            raise InvalidArgument(f"hidden_dim_bytes {hidden_dim_bytes}: hidden_dim "
                                  f"({hidden_dim}) elements of 1, 2 or 4 bytes")
        if hidden_dim_scale_bytes < 0 or hidden_dim_scale_bytes % 4:
            raise InvalidArgument(f"hidden_dim_scale_bytes {hidden_dim_scale_bytes}: float32 "
                                  "scales, a multiple of 4 bytes")
        scales = hidden_dim_scale_bytes // 4
        if item == 1 and not scales:
            raise Unimplemented("1-byte rows without scales (hidden_dim_scale_bytes 0): ferry "
                                "moves 1-byte rows as e4m3 with their float32 scales")
        if item != 1 and scales:
            raise Unimplemented(f"hidden_dim_scale_bytes {hidden_dim_scale_bytes} with "
                                f"{item}-byte rows: ferry moves scales with e4m3 rows only")
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if torch.cuda.is_available() else torch.device("cpu"))
        if not isinstance(group, _ferry.Bootstrap):
            import torch.distributed as dist
            if not dist.is_available() or not dist.is_initialized():
                raise InvalidArgument("group: torch.distributed is not initialised (or pass "
                                      "group=, a ferry.Bootstrap)")
        group_rank, group_size = _pplx._rank(group), _pplx._size(group)
        if (group_rank, group_size) != (rank, world_size):
            raise InvalidArgument(f"rank {rank} of {world_size}: the group has this process as "
                                  f"rank {group_rank} of {group_size}")
        in_dtype = _ELEMENTS[item]
        dp_group = _dp_group(group, rank, world_size, dp_size)
        inner = _pplx.AllToAll(
            max_num_tokens=max_num_tokens, num_experts=num_experts, expert_padding=1,
            hidden_dim=hidden_dim, hidden_dim_scale=scales or None, in_dtype=in_dtype,
            out_dtype=torch.float32 if item == 4 else torch.bfloat16,
            scale_dtype=torch.float32 if scales else None, num_experts_per_token=experts_per_token,
            device=device, dp_group=dp_group,
            global_group=group, max_tokens_per_expert=max_num_tokens * (world_size // dp_size),
            timeout=timeout)
        return cls(inner, scales, experts_per_token, max_num_tokens, device, dp_group is not None)

    def dispatch(self, out_expert_num_tokens, out_expert_x, out_expert_x_scale, dp_x, dp_x_scale,
                 indices, bound_m, do_send=True, do_recv=True):
        """ferry.pplx's dispatch without weights, the caller's scales taken as vLLM sizes them:
        dp_x_scale may have fewer columns than a row's scales (the rest travel as zeros) and
        out_expert_x_scale more (vLLM's per-token output is [experts, rows, hidden]: the
        scales land in its first columns, the rest untouched)."""
        s = self._scales
        # int8 rows (vLLM's int8 w8a8 path) are 1-byte rows as e4m3's are: moved as they are.
        if type(dp_x) is torch.Tensor and dp_x.dtype == torch.int8:
            dp_x = dp_x.view(_ELEMENTS[1])
        if type(out_expert_x) is torch.Tensor and out_expert_x.dtype == torch.int8:
            out_expert_x = out_expert_x.view(_ELEMENTS[1])
        if (do_send and s and type(dp_x_scale) is torch.Tensor and dp_x_scale.dim() == 2
                and dp_x_scale.shape[1] < s):
            dp_x_scale = torch.nn.functional.pad(dp_x_scale, (0, s - dp_x_scale.shape[1]))
        wide = None
        if (do_recv and s and type(out_expert_x_scale) is torch.Tensor
                and out_expert_x_scale.dim() == 3 and out_expert_x_scale.shape[2] > s):
            wide, out_expert_x_scale = out_expert_x_scale, self._scale_rows(out_expert_x_scale)
        self._inner.dispatch(out_expert_num_tokens, out_expert_x, out_expert_x_scale, dp_x,
                             dp_x_scale, indices, None, bound_m, do_send, do_recv)
        if wide is not None:
            wide[:, :, :s].copy_(out_expert_x_scale)

    def _scale_rows(self, wide):
        """A [experts, rows, scales] float32 tensor the receive half writes before its scales
        are copied into `wide` (kept per shape and device: a CUDA graph captures it)."""
        key = (wide.shape[0], wide.shape[1], wide.device)
        rows = self._scale_scratch.get(key)
        if rows is None:
            rows = self._scale_scratch[key] = torch.empty(
                wide.shape[0], wide.shape[1], self._scales, dtype=torch.float32,
                device=wide.device)
        return rows

    def destroy(self):
        """Closes the AllToAll (once; later calls fail FailedPrecondition)."""
        self._inner.destroy()


def _group_named(name):
    """The torch.distributed group of that name (ProcessGroup.group_name)."""
    from torch.distributed import distributed_c10d as c10d
    resolve = getattr(c10d, "_resolve_process_group", None)  # torch 2.2 on
    if resolve is not None:
        try:
            return resolve(name)
        except (KeyError, RuntimeError, ValueError):
            pass
    names = getattr(c10d, "_pg_names", None)
    if names is None:
        names = getattr(getattr(c10d, "_world", None), "pg_names", {})
    for g, n in names.items():
        if n == name:
            return g
    raise InvalidArgument(f"group_name {name!r}: no torch.distributed group of that name")


def _dp_group(group, rank, world_size, dp_size):
    """This rank's group of dp_size consecutive ranks (rank // dp_size), as pplx-kernels
    groups them; None for groups of one. Of a torch group, every rank makes every group, in
    order (new_group is collective); of a ferry.Bootstrap, the group's all-gather is the whole
    world's, each rank keeping its group's part (every rank calls each: ferry.pplx's combine,
    the one caller, is collective over the world)."""
    if dp_size == 1:
        return None
    first = rank - rank % dp_size
    if isinstance(group, _ferry.Bootstrap):
        def all_gather(data, timeout):
            return group.all_gather(data, timeout)[first:first + dp_size]
        return _ferry.CallbackBootstrap(rank - first, dp_size, all_gather)
    import torch.distributed as dist
    ranks = (list(range(world_size)) if group is None or group is dist.group.WORLD
             else dist.get_process_group_ranks(group))
    mine = None
    for start in range(0, world_size, dp_size):
        g = dist.new_group(ranks[start:start + dp_size])
        if start == first:
            mine = g
    return mine
