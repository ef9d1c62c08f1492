"""Input checks shared by every core function: bad input fails loudly, naming the argument."""

from __future__ import annotations

import torch


def as_bool_mask(mask: torch.Tensor, name: str = "mask") -> torch.Tensor:
    """Return ``mask`` as a bool tensor; accept bool or 0/1 numeric tensors."""
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point() or mask.dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        if mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(f"{name} must contain only 0 and 1")
        return mask != 0
    raise ValueError(f"{name} must be bool or 0/1 numeric, got dtype {mask.dtype}")


def check_float(tensor: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {tensor.dtype}")
    return tensor


def check_token_inputs(mask: torch.Tensor, **tensors: torch.Tensor | None) -> torch.Tensor:
    """Check that every given (B, T) float tensor matches ``mask``'s shape; return the bool mask.

    ``None`` values are skipped, so optional inputs can be passed through unconditionally.
    """
    mask = as_bool_mask(mask, "mask")
    if mask.dim() != 2:
        raise ValueError(f"mask must have shape (batch, tokens), got {tuple(mask.shape)}")
    for name, tensor in tensors.items():
        if tensor is None:
            continue
        check_float(tensor, name)
        if tensor.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)} but mask has shape {tuple(mask.shape)}")
        if tensor.device != mask.device:
            raise ValueError(f"{name} is on {tensor.device} but mask is on {mask.device}")
    return mask


def check_sequence_inputs(batch_size: int, **tensors: torch.Tensor | None) -> None:
    """Check that every given per-sequence tensor is 1-D with ``batch_size`` entries."""
    for name, tensor in tensors.items():
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.shape != (batch_size,):
            raise ValueError(f"{name} must have shape ({batch_size},), got {tuple(tensor.shape)}")


def check_bounds(lo: float, hi: float, name: str = "bounds") -> None:
    """Bounds of a ratio: 0 <= lo < hi < inf (an unbounded weight must stay in log space)."""
    if not (0.0 <= lo < hi):
        raise ValueError(f"{name} must satisfy 0 <= lo < hi, got lo={lo}, hi={hi}")
    if hi == float("inf"):
        raise ValueError(f"{name}: hi must be finite; unbounded weights only exist in log space")
