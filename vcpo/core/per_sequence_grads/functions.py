"""Autograd functions that return the input gradient as usual and hand the parameter gradient to the
module's site instead, and the module kinds they serve (Linear, Conv1D, Embedding, LayerNorm, RMSNorm)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# HF RMSNorm classes whose forward is  weight * (x·rsqrt(mean(x²) + eps)) computed in float32.
# Matched by name so that vcpo.core does not import transformers; every matched module is
# checked against its own forward when PerSequenceGradients is built.
HF_RMS_NORM_CLASSES = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")

def _out_in(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The weight as an (out, in) matrix: Conv1D stores it transposed."""
    return weight.t() if transposed else weight


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype ``torch.autocast`` runs matmuls in on ``device`` here, or None outside autocast."""
    if not torch.is_autocast_enabled(device.type):
        return None
    return torch.get_autocast_dtype(device.type)


class _OuterProductFunction(torch.autograd.Function):
    """y = x Wᵀ + b (Linear, W: (out, in)) or y = x W + b (Conv1D, W: (in, out)).

    Under ``torch.autocast`` the matmul runs as autocast would run F.linear: x, W and b cast to the
    autocast dtype (the output in that dtype). Those casts are saved, so the backward's input gradient
    and the per-sequence weight gradients are formed in the same dtype as autograd's would be.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, site):
        ctx.site, ctx.input_dtype = site, x.dtype
        dtype = autocast_dtype(x.device)
        if dtype is not None:
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        ctx.save_for_backward(x, weight)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x, _out_in(weight, site.transposed), bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_out = grad_out.to(x.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad_out @ _out_in(weight, ctx.site.transposed)).to(ctx.input_dtype)
        ctx.site.outer_product_backward(x, grad_out)
        return grad_x, None, None, None


class _EmbeddingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, site):
        ctx.site = site
        ctx.save_for_backward(ids)
        return F.embedding(ids, weight, site.module.padding_idx)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        ctx.site.embedding_backward(ids, grad_out)
        return None, None, None


class _AffineFunction(torch.autograd.Function):
    """y = x̂ ⊙ w + b over the last dimension (the affine part of LayerNorm / RMSNorm)."""

    @staticmethod
    def forward(ctx, x_hat, weight, bias, site):
        ctx.site = site
        ctx.save_for_backward(x_hat, weight)
        y = weight * x_hat
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, grad_out):
        x_hat, weight = ctx.saved_tensors
        grad_x_hat = (grad_out * weight).to(x_hat.dtype)
        ctx.site.affine_backward(x_hat, grad_out)
        return grad_x_hat, None, None, None


def module_type(module: nn.Module) -> type:
    """The module's class, seen through FSDP2: ``fully_shard`` turns a module's class into a new
    ``FSDP<Class>(FSDPModule, Class)`` whose forward is the class's own (FSDP2 adds hooks, not a forward)."""
    cls = type(module)
    bases = [base for base in cls.__bases__ if base.__name__ != "FSDPModule"]
    if len(bases) == 1 and len(cls.__bases__) == 2 and cls.__name__ == f"FSDP{bases[0].__name__}":
        return bases[0]
    return cls


def module_kind(module: nn.Module) -> str | None:
    """The handler for ``module``, or None. Exact types: a subclass may change the forward."""
    cls = module_type(module)
    if cls is nn.Linear:
        return "linear"
    if cls.__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx"):
        return "conv1d"
    if cls is nn.Embedding:
        return "embedding"
    if cls is nn.LayerNorm:
        return "layer_norm"
    if cls.__name__ in HF_RMS_NORM_CLASSES and hasattr(module, "variance_epsilon"):
        return "rms_norm"
    return None


def _check_module_options(name: str, kind: str, module: nn.Module) -> None:
    """Reject module options that couple sequences or change what the handler computes."""
    if kind == "embedding":
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise ValueError(
                f"embedding {name!r}: max_norm, scale_grad_by_freq and sparse are not supported "
                "(they rescale weights or couple the sequences of a batch)"
            )
    if kind == "layer_norm" and len(module.normalized_shape) != 1:
        raise ValueError(
            f"layer norm {name!r}: only a 1-D normalized_shape is supported, got {module.normalized_shape}"
        )


