"""What the ranks of one instance share: the collectives their tensor parallelism needs and the
KV cache memory a leader registers with its engine.

An instance's ranks meet through a ferry.Bootstrap: forked on one host by ferry.run_local_ranks
(what the launcher does), or ferry.torch_bootstrap() where torchrun or Slurm starts them. Its
all-gather carries both the step plans and, in this example, the tensor-parallel sums (a
deployment on GPUs would use NCCL for those). Every sum adds the ranks' parts in rank order, so
every rank of a group holds the same bits.

On a CPU host each rank's cache is a file in /dev/shm mapped by the rank and by its leader: the
leader registers every rank's cache with its engine, as KvCudaShards maps GPU caches into it.
"""

import os
import pickle

import torch

import ferry
from model import F32

COLLECTIVE_TIMEOUT = 3600.0  # a rank waits this long for its peers' next step


def gather(bootstrap, obj, timeout=COLLECTIVE_TIMEOUT):
    """Every rank's obj, by rank."""
    return [pickle.loads(b) for b in bootstrap.all_gather(pickle.dumps(obj), timeout)]


def group_sum(bootstrap, tensor, members):
    """The sum over `members` (global ranks, this one among them) of their `tensor`s, in rank
    order. Collective over every rank of the bootstrap: each passes its own group."""
    if len(members) == 1:
        return tensor
    data = tensor.detach().cpu().contiguous()
    parts = bootstrap.all_gather(data.numpy().tobytes(), COLLECTIVE_TIMEOUT)
    total = None
    for r in members:
        part = torch.frombuffer(bytearray(parts[r]), dtype=data.dtype).view(data.shape)
        total = part if total is None else total + part
    return total.to(tensor.device)


def group_cat(bootstrap, tensor, members):
    """The members' tensors concatenated along dim 0, in rank order (their row counts may
    differ). Collective over every rank, as group_sum."""
    if len(members) == 1:
        return tensor
    data = tensor.detach().cpu().contiguous()
    raw = data.view(torch.int16) if data.dtype == torch.bfloat16 else data  # numpy has no bf16
    parts = gather(bootstrap, (tuple(raw.shape), raw.numpy().tobytes()))
    rows = [torch.frombuffer(bytearray(parts[r][1]), dtype=raw.dtype).view(parts[r][0])
            if parts[r][0][0] else torch.zeros(parts[r][0], dtype=raw.dtype) for r in members]
    return torch.cat(rows).view(data.dtype).to(tensor.device)


def cuda_view(tensor):
    """A CUDA tensor over a host tensor's memory: the memory is registered with CUDA (mapped;
    with unified addressing the GPU reaches it at the same address), so that kernels read and
    write it over PCIe while ferry's engine registers the host tensor. This is where a KV cache
    lives on a machine whose fabric cannot register GPU memory (no GPUDirect RDMA); with it, the
    caches would be GPU memory from ferry.KvCudaShards."""
    num_bytes = tensor.numel() * tensor.element_size()
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), num_bytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {num_bytes} bytes failed ({err})")

    class Mapped:  # what torch.as_tensor takes as CUDA memory
        __cuda_array_interface__ = {
            "shape": tuple(tensor.shape), "typestr": "<f4", "data": (tensor.data_ptr(), False),
            "version": 3, "strides": None}

    view = torch.as_tensor(Mapped(), device=f"cuda:{torch.cuda.current_device()}")
    view._ferry_host = tensor  # the mapping lives as long as the view
    return view


class SharedCaches:
    """Every rank of a TP group makes its cache here (zeroed float32 of `shape`, in /dev/shm);
    the group's leader also maps every member's. Collective over the bootstrap. `compute` is
    the rank's cache as its model uses it: the host tensor, or on a CUDA device a view of it."""

    def __init__(self, bootstrap, tag, shape, members, leader, device="cpu"):
        numel = 1
        for n in shape:
            numel *= n
        path = lambda r: f"/dev/shm/ferry-serve-{tag}-{r}"  # noqa: E731
        me = bootstrap.rank
        # Groups of one rank map no other's file, so they need no barrier: every rank's group
        # has the instance's one size, and a new process replacing one (decode.py --elastic)
        # makes its cache while its peers serve.
        shared = len(members) > 1
        if me in members:
            with open(path(me), "wb") as f:
                f.truncate(numel * 4)
            self.local = torch.from_file(path(me), shared=True, size=numel, dtype=F32).view(shape)
        if shared:
            bootstrap.barrier(COLLECTIVE_TIMEOUT)
        self.views = []
        if me == leader:
            self.views = [self.local if r == me else
                          torch.from_file(path(r), shared=True, size=numel,
                                          dtype=F32).view(shape) for r in members]
        if shared:
            bootstrap.barrier(COLLECTIVE_TIMEOUT)
        if me in members:
            os.unlink(path(me))  # the mappings stay; nothing is left behind in /dev/shm
            self.compute = cuda_view(self.local) if device != "cpu" else self.local


def engine(provider):
    """An engine on `provider` (FERRY_PROVIDER's value; its other settings from FERRY_*)."""
    return ferry.TransferEngine(ferry.EngineOptions.from_env(provider=provider))


def kv_side(config, tp):
    """How a side of tensor-parallel size tp lays out this model's cache for ferry: HND pages of
    float32, each rank holding kv_heads / tp heads."""
    model = ferry.KvModel(kv_heads=config.kv_heads, head_dim=config.head_dim, dtype_bytes=4,
                          page_tokens=config.page_tokens)
    return ferry.KvSide(model=model, order=ferry.KvOrder.HND, tp=tp)


def instance_args(parser, role):
    """The flags every instance takes."""
    parser.add_argument("--model", required=True, help="weights file (model.py's save)")
    parser.add_argument("--control", default="127.0.0.1:0",
                        help="HOST:PORT the router connects to")
    parser.add_argument("--pages", type=int, default=512, help="KV pages per rank")
    parser.add_argument("--provider", default=os.environ.get("FERRY_PROVIDER", "shm"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the model runs (the MoE layers on ferry's CUDA device)")
    parser.set_defaults(tag=f"{role}-{os.getpid()}")  # names its caches in /dev/shm


def run_instance(world_size, body):
    """body(bootstrap) in world_size ranks forked here; exits 0 once all ended well."""
    # One torch thread, set before the ranks fork: an OpenMP pool made in this process would
    # not exist in the forked ranks, whose parallel torch ops could then stall.
    torch.set_num_threads(1)
    exits = ferry.run_local_ranks(world_size, body, timeout=10 ** 7)
    raise SystemExit(0 if all(e.ok for e in exits) else 1)


def cuda_device(rank):
    """The GPU a rank of this host uses (ranks share GPUs round robin where there are fewer),
    made current, with a stream of the rank's own made torch's current one: ferry's steps and
    the layer counter go on that stream, in order with the model's kernels. (Not the legacy
    default stream: its handle is 0, which ferry's set_stream takes as "no stream".)"""
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    torch.cuda.set_stream(torch.cuda.Stream(index))
    return index
