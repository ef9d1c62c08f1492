"""Gathers across ranks that the engines and the mini-batch ESS share."""

from __future__ import annotations

import torch
import torch.distributed as dist


def gather_objects(obj, group) -> list:
    """Every rank's ``obj`` over ``group``, in rank order; ``[obj]`` outside a process group or in a group of one."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def communication_device(group=None) -> torch.device:
    """Where a tensor must be for a collective over ``group``: NCCL takes CUDA tensors only, gloo CPU ones."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_here(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """``tensor`` summed over ``group``, as a new tensor on ``tensor``'s device (moved for the collective
    where the backend needs another device)."""
    moved = tensor.to(communication_device(group), copy=True)
    dist.all_reduce(moved, group=group)
    return moved.to(tensor.device)


def broadcast_here(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """``tensor`` of global rank ``src`` on every rank of ``group`` (every rank passes a tensor of its shape
    and dtype), on ``tensor``'s device."""
    moved = tensor.to(communication_device(group), copy=True).contiguous()
    dist.broadcast(moved, src=src, group=group)
    return moved.to(tensor.device)
