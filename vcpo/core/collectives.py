"""Gathers across ranks that the engines and the mini-batch ESS share."""

from __future__ import annotations

import torch.distributed as dist


def gather_objects(obj, group) -> list:
    """Every rank's ``obj`` over ``group``, in rank order; ``[obj]`` outside a process group or in a group of one."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
