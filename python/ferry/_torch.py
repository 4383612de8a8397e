"""A Bootstrap over torch.distributed (or anything with its all_gather_object)."""

from . import _ferry


def torch_bootstrap(group=None, dist=None):
    """A ferry.Bootstrap whose all-gather is dist.all_gather_object over `group`.

    dist: torch.distributed (the default), or any object with get_rank, get_world_size and
    all_gather_object taking the same arguments. The process group's own timeout bounds each
    all-gather (torch has no per-call one), so set it when initialising the group.
    """
    if dist is None:
        import torch.distributed as dist
    rank = dist.get_rank(group=group)
    world_size = dist.get_world_size(group=group)

    def all_gather(data, timeout):
        gathered = [None] * world_size
        dist.all_gather_object(gathered, data, group=group)
        return gathered

    return _ferry.CallbackBootstrap(rank, world_size, all_gather)
