"""What the compatibility layers (deep_ep, pplx) share: the process group a layer was given,
the AllToAlls it creates as the calls reveal their shapes, and the checks on the tensors it is
handed.

A layer's AllToAlls are collective to create, and both APIs learn a shape (hidden, top-k, the
dtype) only from a call's tensors, so an AllToAll is made at the first call of each shape: every
rank makes that call in the same order (the APIs require it of their own buffers), so every rank
creates the same AllToAll, with the same instance number, at the same point. Two calls of one
shape may overlap (two micro-batches, each dispatched before either is combined): each
call takes the first idle AllToAll of its shape and holds it until its combine's receive half.
"""

import os
import socket

import torch

from .. import _ferry
from .._errors import InvalidArgument, ResourceExhausted, Unimplemented
from .._torch import torch_bootstrap


MAX_INSTANCES = 16  # AllToAllConfig::kMaxInstances: the AllToAlls one engine serves
_ENGINE_INSTANCES = {}  # id(engine) -> instances taken on it by the layers


def fp8_dtype():
    """torch's e4m3 dtype, or uint8 (the same bytes) where torch has none (before 2.1)."""
    return getattr(torch, "float8_e4m3fn", torch.uint8)


# check_tensor(name, t, dtype=None, dims=None, device=None): InvalidArgument unless t is a
# contiguous tensor of that dtype (one, or a tuple of two), rank and device (an ordinal as
# Tensor.get_device() gives it: -1 for the CPU). In C++, as the layers' C++ calls check their
# tensors, with the same messages: read through the interpreter, a tensor's attributes cost
# a microsecond a check.
check_tensor = _ferry.check_tensor


def refuse(name, value, default, why):
    """Unimplemented naming an argument ferry cannot honour, unless it is left at its default
    (None compared by identity: a tensor's == is elementwise)."""
    if (value is not None) if default is None else (value != default):
        raise Unimplemented(f"{name}={value!r}: {why}")


class Group:
    """A layer's ranks: a torch.distributed process group (None: the default group) or a
    ferry.Bootstrap, and the engine its AllToAlls share."""

    def __init__(self, group, engine=None, ranks_per_node=None):
        if isinstance(group, _ferry.Bootstrap):
            self.bootstrap = group
            self.rank, self.world_size = group.rank, group.world_size
        else:
            import torch.distributed as dist
            if not dist.is_available() or not dist.is_initialized():
                raise InvalidArgument("group: torch.distributed is not initialised (or pass a "
                                      "ferry.Bootstrap)")
            self.bootstrap = torch_bootstrap(group)
            self.rank, self.world_size = self.bootstrap.rank, self.bootstrap.world_size
        self._engine = engine
        self._own_engine = engine is None
        self._ranks_per_node = ranks_per_node
        self._instances = 0  # AllToAlls made
        self._pools = {}  # key -> [_ferry.PooledAllToAll]

    def ranks_per_node(self):
        """Ranks that share this rank's host (its NVLink domain), from the ranks' host names:
        consecutive and the same on every host, as ferry's CUDA device needs."""
        if self._ranks_per_node is None:
            names = self.bootstrap.all_gather(socket.gethostname().encode(), 60.0)
            per = names.count(names[0])
            if self.world_size % per or any(names[i] != names[i - i % per]
                                            for i in range(self.world_size)):
                raise InvalidArgument(f"ranks per host differ or are not consecutive: {names}")
            self._ranks_per_node = per
        return self._ranks_per_node

    def engine(self, needed):
        if self._engine is None and needed:
            self._engine = _ferry.TransferEngine(_ferry.EngineOptions.from_env())
        return self._engine

    def acquire(self, key, make_config=None):
        """The first idle AllToAll of `key`, taken; when none is idle, one created
        (collectively) from make_config(), or None without make_config (callers look first
        without building one: a closure a call costs)."""
        pool = self._pools.get(key)
        if pool is not None:
            for p in pool:
                if not p.busy:
                    p.busy = True
                    return p
        if make_config is None:
            return None
        pool = self._pools.setdefault(key, [])
        config = make_config()
        config.world_size, config.rank = self.world_size, self.rank
        engine = self._engine_for(config)
        # Instances are numbered per engine (layers given one engine share its numbers); the
        # ranks make the same calls in the same order, so they agree on each number.
        taken = _ENGINE_INSTANCES.get(id(engine), 0) if engine is not None else self._instances
        # Node-once forwarding's AllToAll is three (its rail's, its node's and the weights
        # rail's), on three instances.
        needed = 3 if config.chosen_forwarding() == _ferry.Forwarding.NODE_ONCE else 1
        if taken + needed > MAX_INSTANCES:
            raise ResourceExhausted(
                f"an engine serves at most {MAX_INSTANCES} AllToAlls (one per shape and "
                f"overlapped call), all taken: combine a call before dispatching more")
        config.instance = taken
        config.validate()
        a2a = _ferry.AllToAll(config, engine, self.bootstrap)
        if engine is not None:
            _ENGINE_INSTANCES[id(engine)] = taken + needed
        self._instances += needed
        p = _ferry.PooledAllToAll(a2a)
        p.busy = True
        pool.append(p)
        return p

    def all_to_alls(self, kind):
        """Every AllToAll made for keys whose first element is `kind`, idle or busy."""
        return [p.a2a for key, pool in self._pools.items() if key[0] == kind for p in pool]

    def keyed(self, kind):
        """(key, AllToAll) for every AllToAll of `kind`, in the order they were made (their
        instances'), which every rank shares."""
        made = [(key, p.a2a) for key, pool in self._pools.items() if key[0] == kind
                for p in pool]
        return sorted(made, key=lambda ka: ka[1].config.instance)

    def next_instance(self):
        """The instance the next AllToAll takes."""
        if self._engine is not None:
            return _ENGINE_INSTANCES.get(id(self._engine), 0)
        return self._instances

    def _engine_for(self, config):
        """The engine an AllToAll of `config` uses: none for the CUDA device in one node."""
        one_node = (config.device == _ferry.MoeDevice.CUDA
                    and config.ranks_per_node == self.world_size)
        return self.engine(not one_node)

    def join(self, key, config, instance, timeout):
        """A new process's AllToAll of `key` in a running world (ferry.AllToAll.join over this
        group's bootstrap, on the world's `instance`), idle in the pool."""
        config.world_size, config.rank, config.instance = self.world_size, self.rank, instance
        config.validate()
        a2a = _ferry.AllToAll.join(config, self._engine_for(config), self.bootstrap, timeout)
        self._pools.setdefault(key, []).append(_ferry.PooledAllToAll(a2a))

    def set_next_instance(self, instance):
        """The next AllToAll made takes `instance` (the world's, which this process joined)."""
        self._instances = instance
        if self._engine is not None:
            _ENGINE_INSTANCES[id(self._engine)] = instance

    def drop(self, keep):
        """Closes and forgets every AllToAll whose key's kind is not `keep` (those of a world
        that lost a rank: its steps fail, and the world they are remade in is another)."""
        for key in [k for k in self._pools if k[0] != keep]:
            for p in self._pools.pop(key):
                p.a2a.close()

    def known_ranks_per_node(self):
        """ranks_per_node() where a call asked it already, else None (asking is collective)."""
        return self._ranks_per_node

    def rebase(self, bootstrap, ranks_per_node=None):
        """Collectives from now on over `bootstrap` (a new world of the same ranks, which a
        replaced rank joined); ranks_per_node: the world's, where known."""
        if (bootstrap.rank, bootstrap.world_size) != (self.rank, self.world_size):
            raise InvalidArgument(f"rank {bootstrap.rank} of {bootstrap.world_size} in the new "
                                  f"world, {self.rank} of {self.world_size} before")
        self.bootstrap = bootstrap
        if ranks_per_node is not None:
            self._ranks_per_node = ranks_per_node

    def close(self):
        for pool in self._pools.values():
            for p in pool:
                p.a2a.close()
        self._pools.clear()
        if self._own_engine and self._engine is not None:
            _ENGINE_INSTANCES.pop(id(self._engine), None)
            self._engine.close()
            self._engine = None


# The current stream as a cudaStream_t: torch's raw accessor where it has one (what compilers
# built on torch call), else the Stream object's handle (several times slower).
_raw_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream_handle(ordinal):
    """The current stream of CUDA device `ordinal` as a cudaStream_t (an int)."""
    if _raw_current_stream is not None:
        return _raw_current_stream(ordinal)
    return torch.cuda.current_stream(ordinal).cuda_stream


def shim_path(name):
    """The folder holding the package `name` (deep_ep, pplx_kernels) over ferry's layer: put on
    PYTHONPATH, `import name` finds ferry's in every process started with it."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shims",
                        name)


def env_timeout(default=30.0):
    """Seconds a receive half waits for its peers (FERRY_MOE_TIMEOUT)."""
    return float(os.environ.get("FERRY_MOE_TIMEOUT", default))
