"""Exact per-sequence gradient norms and the single-backward OPOB update (VCPO §3.4, Alg. 1, App. C).

A micro-batch holds B sequences (one per row, or packed in one row) with per-sequence scores
l_i = Σ_t u_{i,t} l^θ_{i,t} (u: the loss's per-token aggregation weights, e.g. m_{i,t} or m_{i,t}/T_i)
and score gradients g_i = ∇_θ l_i. From ONE backward pass of Σ_i l_i this module obtains

    ||g_i||²                                over all trainable parameters, for every sequence,
    G_R   = Σ_i c^R_i g_i                   accumulated into p.grad,
    G_S^γ = Σ_{i in group γ} c^S_i g_i      one score buffer per baseline group γ,

and then forms the OPOB update  Ĝ = G_R − Σ_γ b_γ G_S^γ  (docs/ALGORITHMS.md §4) in p.grad. The caller
chooses the coefficients, e.g. c^R_i = w^TIS_i R_i / B and c^S_i = w^TIS_i / B, and takes b from
`vcpo.core.baselines.opob_baseline` applied to `sq_norms`.

Why it is exact and cheap. Rows of a batch do not interact (attention stays within a row), so the
gradient δ_i reaching row i of any layer's output belongs to sequence i alone (packed micro-batches:
the tokens of segment i, see below). Every parameterised
module runs its forward through a custom autograd function that returns the input gradient as usual
but NOT the parameter gradient: it forms the per-sequence parameter gradients from (saved input x,
output gradient δ) itself and reduces them at once to squared norms and to the k = 1 + #groups
combinations. autograd never computes its own weight gradient, so the extra work is reductions over
per-sequence gradients (kept in cache, block by block), not a second weight-gradient matmul.

Per module kind (`module_kind`; one backward handler each, sharing the accumulation code):
  Linear, GPT-2 Conv1D   per-sequence weight gradient P_i = δ_iᵀ x_i (Conv1D: x_iᵀ δ_i), either
                         materialised one block of weight rows at a time, or a "ghost" norm
                         ||δ_iᵀ x_i||² = Σ_{t,s} (x_t·x_s)(δ_t·δ_s) plus one matmul per combination;
                         the cheaper route is chosen per call (`prefers_ghost`). Bias: Σ_t δ_{i,t}.
  Embedding              a scatter of the δ rows at the ids; for the norm, rows of repeated ids are
                         summed first. A lookup with batch 1 (GPT-2 positions) is expanded to B rows.
  LayerNorm, RMSNorm     Σ_t δ_{i,t} ⊙ x̂_{i,t} (weight) and Σ_t δ_{i,t} (bias), x̂ the normalised input.
  Tied Embedding/Linear  (Qwen2 tie_word_embeddings, GPT-2 wte/lm_head) the per-sequence gradient is
                         E_i + H_i, so ||·||² includes the cross term 2<E_i, H_i> = 2 Σ_t <H_i[id_t], δ^E_t>,
                         formed from the rows of H_i at the embedding's ids.

A trainable parameter of any other module, a parameter shared other than as a tied embedding, a
module called twice in one micro-batch, or a gradient reaching a parameter outside these handlers
raises an error: the norms are never silently wrong.

Usage (scope "batch": one baseline for the whole minibatch)::

    engine = PerSequenceGradients(model)
    for mb in micro_batches:
        with engine.micro_batch(mb.coef_r, mb.coef_s):
            per_sequence_scores(model(mb.input_ids, attention_mask=mb.mask), mb).sum().backward()
    engine.combine(opob_baseline(rewards, engine.sq_norms, seq_log_weights))
    with scaled_learning_rate(optimizer, ess_step_scale(ess_ratio(seq_log_weights))):
        optimizer.step()

Scope "group" with group-aligned micro-batches (whole groups in one micro-batch): pass
``groups=`` to `micro_batch` and call `combine` after each micro-batch with that micro-batch's
baseline; the groups' score buffers are freed at once.

Packed ("remove padding") micro-batches: ``micro_batch(..., cu_seqlens=offsets)`` with B sequences
concatenated along the token dimension of ONE row (every module input (1, tokens, ...), sequence i =
tokens [c_i, c_{i+1}), attention block-diagonal). Every handler reduces per segment. Linear/Conv1D
gather each `length_buckets` group of sequences into its own (B_b, T_b, ·) rows (T_b: the group's
longest length, zeros after each end; a view of the packed tokens when the group is consecutive and
of equal length), so the per-sequence matmuls pad at most (BUCKET_SLACK − 1)·tokens and the ghost
Gram matrices are the diagonal blocks of the block-diagonal Gram product, one group at a time.
Embeddings and norm affines (hidden-width tensors) use the (B, max_len, ·) zero-padded layout of
`PackedSegments.pad`. Zero rows add nothing, so the result is exact and equals the one-row-per-sequence
result. Tokens after c_B (trailing padding) belong to no sequence: they are left out of the norms,
p.grad and the score buffers (their gradient is zero for any loss that ignores them).

Memory beyond a plain backward: one score buffer per open group label (one for scope "batch", one
per group of the micro-batch for scope "group"), plus one block of per-sequence gradients
(``block_bytes``) or the ghost Gram matrices (2·B·T² values, also chunked to ``block_bytes``), plus,
for a packed micro-batch, one module's bucketed copy of its input and output gradient (at most
BUCKET_SLACK x their tokens).

Limits: the engine cannot see the attention, and sequences must not interact through it (rows of a
padded batch; the block-diagonal mask of a packed row, which HF transformers 5 builds from position_ids
restarting at 0 only with attention_mask=None and use_cache=False). No torch.autocast (the functions
run in the parameters' dtype). Under data parallelism (paper App. C) defer the gradient all-reduce:
gather the B norms across ranks for the baseline, `combine` locally, then all-reduce p.grad once.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from vcpo.core.validation import check_float, check_sequence_inputs

MODES = ("auto", "materialize", "ghost")

# Per-sequence gradients are formed in blocks of weight rows of about this many bytes, so that the
# reductions that follow read them from cache (CPU: about the L2; GPU: a third of an H100's L2).
# Unblocked, the reductions over a (B, 32000, 512) lm_head gradient ran at DRAM speed, 1.5x slower.
DEFAULT_BLOCK_BYTES = {"cpu": 2 << 20, "cuda": 16 << 20}
MIN_BLOCK_ROWS = 16

# Packed micro-batches: the per-sequence weight gradients of sequences of unequal lengths are formed
# in buckets of similar lengths, each padded only to its own longest, with at most this many padded
# tokens per real token (`length_buckets`). One bucket (pad all to the longest) wasted 2x the
# multiply-adds at lengths 30-250; more buckets mean more, smaller matmuls.
BUCKET_SLACK = 1.25

# Cost of the reductions over one materialised per-sequence gradient element, in multiply-adds of
# a large matmul (the machine balance of in-cache passes). CPU: `benchmarks/opob_overhead.py
# --calibrate` measured 43-74 on a 2-core AVX-512 EPYC (512x1536 float32 layer, T = 32-256). CUDA: an
# estimate, ~4 accesses of 2 bytes per element at ~7 TB/s of L2 against ~400 T bf16 multiply-adds/s.
DEFAULT_PASS_COST = {"cpu": 64.0, "cuda": 512.0}

# HF RMSNorm classes whose forward is  weight * (x·rsqrt(mean(x²) + eps)) computed in float32.
# Matched by name so that vcpo.core does not import transformers; every matched module is
# checked against its own forward when the engine is built.
HF_RMS_NORM_CLASSES = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")


# ----------------------------------------------------------------------------------------------
# The math, as pure functions.
# ----------------------------------------------------------------------------------------------


def per_sample_outer(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """P_i = Σ_t rows_{i,t} ⊗ cols_{i,t} = rows_iᵀ cols_i, shape (B, R, C), for rows (B, T, R), cols (B, T, C).

    With rows = δ and cols = x this is sequence i's gradient of a Linear weight (out, in).
    """
    return torch.bmm(rows.transpose(1, 2), cols)


def ghost_sq_norms(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """||rows_iᵀ cols_i||²_F = Σ_{t,s} (rows_t·rows_s)(cols_t·cols_s) per sequence, shape (B,).

    Never forms the (R, C) matrix: cost B·T²·(R + C) multiply-adds and 2·B·T² values of memory.
    """
    row_gram = torch.bmm(rows, rows.transpose(1, 2))
    col_gram = torch.bmm(cols, cols.transpose(1, 2))
    return torch.einsum("bts,bts->b", row_gram, col_gram)


def prefers_ghost(tokens: int, rows: int, cols: int, num_combinations: int, pass_cost: float) -> bool:
    """True when the ghost route costs less than materialising per-sequence gradients.

    Costs beyond a plain backward, per sequence, in multiply-adds of a large matmul:
      materialise: the per-sequence matmuls replace autograd's weight gradient (same FLOPs); extra
                   are the in-cache reductions over R·C values:     pass_cost · R · C
      ghost:       the Gram matrices, and one weight-gradient matmul per combination beyond the first:
                   T²·(R + C) + (k − 1)·T·R·C
    Long sequences therefore materialise; only very short ones (T below ~pass_cost) go ghost.
    """
    materialize = pass_cost * rows * cols
    ghost = tokens * tokens * (rows + cols) + (num_combinations - 1) * tokens * rows * cols
    return ghost < materialize


def sparse_rows_sq_norms(ids: torch.Tensor, rows: torch.Tensor, num_embeddings: int) -> torch.Tensor:
    """||Σ_t e_{id_{i,t}} ⊗ rows_{i,t}||² per sequence, shape (B,), for ids (B, T), rows (B, T, d).

    Sequence i's embedding gradient has row v equal to Σ_{t: id_t = v} rows_t, so the rows of
    repeated ids are summed (per unique (sequence, id) key) before squaring.
    """
    batch, _ = ids.shape
    sequence = torch.arange(batch, device=ids.device).unsqueeze(1)
    keys = (sequence * num_embeddings + ids).flatten()
    unique_keys, key_of_position = torch.unique(keys, return_inverse=True)
    flat_rows = rows.reshape(-1, rows.shape[-1])
    summed = flat_rows.new_zeros(unique_keys.numel(), flat_rows.shape[1]).index_add_(0, key_of_position, flat_rows)
    key_sq_norms = torch.linalg.vecdot(summed, summed).to(torch.float64)
    return key_sq_norms.new_zeros(batch).index_add_(0, unique_keys // num_embeddings, key_sq_norms)


def rows_at_ids(delta: torch.Tensor, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows H_i[id_{i,s}] of sequence i's Linear weight gradient H_i = δ_iᵀ x_i, shape (B, S, d_in).

    H_i[v] = Σ_t δ_{i,t,v} x_{i,t}: gathers the δ columns at the ids instead of forming H_i,
    cost B·T·S·d_in. Used for the cross term of a tied embedding/lm_head weight.
    """
    batch, tokens, _ = delta.shape
    columns = delta.gather(2, ids.unsqueeze(1).expand(batch, tokens, ids.shape[1]))
    return torch.bmm(columns.transpose(1, 2), x)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x·rsqrt(mean(x²) + eps) in float32, cast back to x's dtype (the HF Llama/Qwen2 RMSNorm)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h.to(x.dtype)


def check_cu_seqlens(cu_seqlens: torch.Tensor, batch: int) -> torch.Tensor:
    """Validate the offsets of B packed sequences: 1-D integers 0 = c_0 < c_1 < ... < c_B; returns them as int64.

    Raises ValueError naming what is wrong (length against the B coefficients, not starting at 0,
    not strictly increasing: an empty sequence has no gradient to attribute).
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens must be a tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must hold integer offsets, got dtype {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] != batch + 1:
        raise ValueError(
            f"cu_seqlens must be 1-D with B + 1 = {batch + 1} offsets for the {batch} sequences of coef_r, "
            f"got shape {tuple(cu_seqlens.shape)}"
        )
    offsets = cu_seqlens.detach().to(torch.int64)
    if int(offsets[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {int(offsets[0])}")
    if not bool((offsets[1:] > offsets[:-1]).all()):
        raise ValueError(f"cu_seqlens must be strictly increasing (no empty sequences), got {offsets.tolist()}")
    return offsets


def length_buckets(lengths: list[int], slack: float = BUCKET_SLACK) -> list[list[int]]:
    """Sequence indices grouped so that padding each group to its longest costs <= slack x its tokens.

    Greedy over the lengths in decreasing order: a sequence joins the current group while
    (size + 1) · longest <= slack · (tokens + its length), else it starts a new group. Within a group the
    indices are increasing. Equal lengths give one group.
    """
    buckets: list[list[int]] = []
    tokens = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if buckets and (len(buckets[-1]) + 1) * lengths[buckets[-1][0]] <= slack * (tokens + lengths[i]):
            buckets[-1].append(i)
            tokens += lengths[i]
        else:
            buckets.append([i])
            tokens = lengths[i]
    return [sorted(bucket) for bucket in buckets]


@dataclass(frozen=True)
class PackedSegments:
    """B sequences packed along the token dimension of one row, at offsets cu_seqlens (B + 1,).

    Token t < cu_seqlens[-1] belongs to sequence i with cu_seqlens[i] <= t < cu_seqlens[i + 1]; tokens
    from cu_seqlens[-1] on (trailing padding) belong to none. `pad` lays a packed tensor out as
    (B, max_len, ...) with zeros after each sequence's end, the one-row-per-sequence layout of the
    embedding and norm handlers (Linear/Conv1D use the tighter `_Bucket` layouts); zero rows add
    nothing to any per-sequence gradient, norm or cross term, so the result is exact and trailing
    padding tokens are left out.
    """

    cu_seqlens: torch.Tensor  # (B + 1,) int64
    max_len: int
    flat_index: torch.Tensor  # (total,) position of every packed token in the flattened (B, max_len) layout

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, device: torch.device | None = None) -> PackedSegments:
        offsets = cu_seqlens.to(device=device, dtype=torch.int64)
        lengths = offsets[1:] - offsets[:-1]
        max_len = int(lengths.max())
        batch, total = lengths.shape[0], int(offsets[-1])
        sequence = torch.repeat_interleave(torch.arange(batch, device=offsets.device), lengths, output_size=total)
        position = torch.arange(total, device=offsets.device) - offsets[sequence]
        return cls(offsets, max_len, sequence * max_len + position)

    @property
    def batch_size(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    @property
    def lengths(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    @property
    def total_tokens(self) -> int:
        return self.flat_index.shape[0]

    def pad(self, packed: torch.Tensor) -> torch.Tensor:
        """(tokens, ...) with tokens >= total_tokens  ->  (B, max_len, ...), zero-filled; trailing tokens dropped."""
        rest = packed.shape[1:]
        padded = packed.new_zeros((self.batch_size * self.max_len, *rest))
        padded.index_copy_(0, self.flat_index, packed[: self.total_tokens])
        return padded.view(self.batch_size, self.max_len, *rest)


# ----------------------------------------------------------------------------------------------
# Autograd functions: input gradient as usual, parameter gradients handed to the module's site.
# ----------------------------------------------------------------------------------------------


def _out_in(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The weight as an (out, in) matrix: Conv1D stores it transposed."""
    return weight.t() if transposed else weight


class _OuterProductFunction(torch.autograd.Function):
    """y = x Wᵀ + b (Linear, W: (out, in)) or y = x W + b (Conv1D, W: (in, out))."""

    @staticmethod
    def forward(ctx, x, weight, bias, site):
        ctx.site = site
        ctx.save_for_backward(x, weight)
        return F.linear(x, _out_in(weight, site.transposed), bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ _out_in(weight, ctx.site.transposed) if ctx.needs_input_grad[0] else None
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


# ----------------------------------------------------------------------------------------------
# Module kinds.
# ----------------------------------------------------------------------------------------------


def _is_hf_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def module_kind(module: nn.Module) -> str | None:
    """The handler for ``module``, or None. Exact types: a subclass may change the forward."""
    if type(module) is nn.Linear:
        return "linear"
    if _is_hf_conv1d(module):
        return "conv1d"
    if type(module) is nn.Embedding:
        return "embedding"
    if type(module) is nn.LayerNorm:
        return "layer_norm"
    if type(module).__name__ in HF_RMS_NORM_CLASSES and hasattr(module, "variance_epsilon"):
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


def _kind_forward(site: _Site, x: torch.Tensor) -> torch.Tensor:
    """The module's forward with its parameters routed through the per-sequence functions."""
    module, kind = site.module, site.kind
    if kind in ("linear", "conv1d"):
        return _OuterProductFunction.apply(x, module.weight, module.bias, site)
    if kind == "embedding":
        return _EmbeddingFunction.apply(x, module.weight, site)
    if kind == "layer_norm":
        x_hat = F.layer_norm(x, module.normalized_shape, None, None, module.eps)
    else:
        x_hat = rms_normalize(x, module.variance_epsilon)
    return _AffineFunction.apply(x_hat, module.weight, module.bias if kind == "layer_norm" else None, site)


def _check_same_forward(name: str, site: _Site) -> None:
    """The handler must reproduce the module's own forward (guards name-matched HF classes)."""
    module = site.module
    width = module.nx if site.kind == "conv1d" else module.weight.shape[-1]
    generator = torch.Generator(device="cpu").manual_seed(0)
    probe = torch.randn(2, 3, width, generator=generator).to(module.weight.device, module.weight.dtype)
    with torch.no_grad():
        expected = type(module).forward(module, probe)
        actual = _kind_forward(site, probe)
    tolerance = 1e-2 if module.weight.dtype in (torch.float16, torch.bfloat16) else 1e-4
    if expected.shape != actual.shape or not torch.allclose(expected, actual, rtol=tolerance, atol=tolerance):
        raise ValueError(
            f"module {name!r} ({type(module).__name__}) does not compute what its handler assumes; it is not supported"
        )


# ----------------------------------------------------------------------------------------------
# Per-module sites and the per-micro-batch accumulator.
# ----------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Site:
    """One handled module: installs its per-sequence forward and routes its backward to the micro-batch."""

    engine: PerSequenceGradients
    name: str
    module: nn.Module
    kind: str

    @property
    def transposed(self) -> bool:
        return self.kind == "conv1d"

    def install(self) -> None:
        # An instance attribute shadows the class's forward; nn.Module.__call__ (hooks included) is unchanged.
        self.module.forward = self.forward

    def uninstall(self) -> None:
        del self.module.forward

    def forward(self, *args, **kwargs) -> torch.Tensor:
        if len(args) != 1 or kwargs:
            raise ValueError(f"module {self.name!r}: the per-sequence forward takes exactly one input tensor")
        (x,) = args
        micro_batch = self.engine.active_micro_batch(self.name)
        if torch.is_grad_enabled():
            micro_batch.forward_ran(self.name)
        if micro_batch.segments is not None:
            self._check_packed_input(x, micro_batch.segments)
            if self.kind == "embedding":
                micro_batch.record_tied_ids(self.module.weight, micro_batch.per_sequence(x))
        elif self.kind == "embedding":
            x = self._per_sequence_ids(x, micro_batch.batch_size)
            micro_batch.record_tied_ids(self.module.weight, x)
        elif x.shape[0] != micro_batch.batch_size:
            raise ValueError(
                f"module {self.name!r}: input batch dimension {x.shape[0]} != micro-batch size "
                f"{micro_batch.batch_size} (one row per sequence, or pass cu_seqlens= for packed sequences)"
            )
        return _kind_forward(self, x)

    def _check_packed_input(self, x: torch.Tensor, segments: PackedSegments) -> None:
        """Packed micro-batch: ids (1, tokens) or activations (1, tokens, width), tokens >= cu_seqlens[-1]."""
        expected = 2 if self.kind == "embedding" else 3
        what = "ids of shape (1, tokens)" if expected == 2 else "input of shape (1, tokens, width)"
        if x.dim() != expected or x.shape[0] != 1:
            raise ValueError(
                f"module {self.name!r}: a packed micro-batch (cu_seqlens given) needs {what}, got {tuple(x.shape)}"
            )
        if x.shape[1] < segments.total_tokens:
            raise ValueError(
                f"module {self.name!r}: cu_seqlens[-1] = {segments.total_tokens} is beyond the token dimension "
                f"{x.shape[1]} of its input {tuple(x.shape)}"
            )

    def _per_sequence_ids(self, ids: torch.Tensor, batch_size: int) -> torch.Tensor:
        if ids.dim() == 2 and ids.shape[0] == 1 and batch_size > 1:
            # A lookup shared by all rows (GPT-2 positions): give every sequence its own copy so that
            # its gradient stays per-sequence; the broadcast sum downstream is unchanged.
            return ids.expand(batch_size, -1)
        if ids.dim() != 2 or ids.shape[0] != batch_size:
            raise ValueError(
                f"embedding {self.name!r}: ids must have shape (batch, tokens) with batch {batch_size}, "
                f"got {tuple(ids.shape)}"
            )
        return ids

    # Backward handlers: each forms the per-sequence gradients of its parameters.

    def outer_product_backward(self, x: torch.Tensor, grad_out: torch.Tensor) -> None:
        micro_batch = self.engine.active_micro_batch(self.name)
        batch = micro_batch.batch_size
        # (bucket, x_b, δ_b): (B_b, T_b, ·) rows, zero after each sequence's end (`_Bucket`).
        parts = [(bucket, bucket.gather(x, batch), bucket.gather(grad_out, batch)) for bucket in micro_batch.buckets]
        weight, bias = self.module.weight, self.module.bias
        if weight.requires_grad:
            outer = [(bucket, *((x_b, d_b) if self.transposed else (d_b, x_b))) for bucket, x_b, d_b in parts]
            micro_batch.add_outer_products(self.name, weight, outer)
            if micro_batch.is_tied(weight):

                def rows_at(ids: torch.Tensor) -> torch.Tensor:
                    return micro_batch.from_buckets(
                        [(b, micro_batch.chunked_rows_at_ids(d_b, x_b, b.rows_of(ids))) for b, x_b, d_b in parts]
                    )

                micro_batch.add_tied_part(weight, rows_at)
        if bias is not None and bias.requires_grad:
            micro_batch.add_dense(self.name, bias, micro_batch.from_buckets([(b, d_b.sum(1)) for b, _, d_b in parts]))

    def embedding_backward(self, ids: torch.Tensor, grad_out: torch.Tensor) -> None:
        micro_batch = self.engine.active_micro_batch(self.name)
        if micro_batch.segments is not None:
            ids, grad_out = micro_batch.per_sequence(ids), micro_batch.per_sequence(grad_out)
        padding_idx = self.module.padding_idx
        rows = grad_out if padding_idx is None else grad_out * (ids != padding_idx).unsqueeze(-1).to(grad_out.dtype)
        weight = self.module.weight
        micro_batch.add_sparse_rows(self.name, weight, ids, rows)
        if micro_batch.is_tied(weight):
            micro_batch.add_tied_part(weight, lambda _ids: rows)

    def affine_backward(self, x_hat: torch.Tensor, grad_out: torch.Tensor) -> None:
        micro_batch = self.engine.active_micro_batch(self.name)
        x_hat, delta = micro_batch.per_sequence(x_hat), micro_batch.per_sequence(grad_out)
        weight, bias = self.module.weight, getattr(self.module, "bias", None)
        if weight.requires_grad:
            micro_batch.add_dense(self.name, weight, (delta * x_hat).sum(1))
        if bias is not None and bias.requires_grad:
            micro_batch.add_dense(self.name, bias, delta.sum(1))


@dataclass(frozen=True)
class _Bucket:
    """Sequences whose per-sequence weight gradients are formed together, as (B_b, T_b, ...) rows.

    One row per sequence: the single default bucket, every sequence, the input reshaped to (B, T, ...).
    Packed: the sequences of one `length_buckets` group (``sequences``), laid out with T_b = their
    longest length, zero after each end; ``span`` when they are consecutive and of equal length (a view
    of the packed tokens), else ``token_index`` (their packed tokens) and ``slot_index`` (where those go
    in the flattened (B_b, T_b) layout).
    """

    sequences: torch.Tensor | None = None  # (B_b,) indices in the micro-batch
    tokens: int = 0
    span: tuple[int, int] | None = None
    token_index: torch.Tensor | None = None
    slot_index: torch.Tensor | None = None

    def gather(self, values: torch.Tensor, batch: int) -> torch.Tensor:
        """A module input or output gradient -> this bucket's (B_b, T_b, ...) rows."""
        if self.sequences is None:
            return values.reshape(batch, -1, values.shape[-1])
        packed, count = values[0], self.sequences.shape[0]
        if self.span is not None:
            return packed[self.span[0] : self.span[1]].view(count, self.tokens, *packed.shape[1:])
        out = packed.new_zeros((count * self.tokens, *packed.shape[1:]))
        out.index_copy_(0, self.slot_index, packed.index_select(0, self.token_index))
        return out.view(count, self.tokens, *packed.shape[1:])

    def rows_of(self, per_sequence: torch.Tensor) -> torch.Tensor:
        """(B, ...) -> this bucket's rows (B_b, ...)."""
        return per_sequence if self.sequences is None else per_sequence.index_select(0, self.sequences)


def _buckets(segments: PackedSegments | None, device: torch.device) -> list[_Bucket]:
    """The default bucket, or the `length_buckets` groups of a packed micro-batch."""
    if segments is None:
        return [_Bucket()]
    offsets, lengths = segments.cu_seqlens.tolist(), segments.lengths
    buckets = []
    for group in length_buckets(lengths, BUCKET_SLACK):
        tokens = max(lengths[i] for i in group)
        sequences = torch.tensor(group, device=device)
        if group == list(range(group[0], group[-1] + 1)) and all(lengths[i] == tokens for i in group):
            buckets.append(_Bucket(sequences, tokens, span=(offsets[group[0]], offsets[group[-1] + 1])))
            continue
        token_index = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in group])
        slot_index = torch.cat([slot * tokens + torch.arange(lengths[i]) for slot, i in enumerate(group)])
        buckets.append(_Bucket(sequences, tokens, None, token_index.to(device), slot_index.to(device)))
    return buckets


@dataclass
class _TiedState:
    """The embedding ids of a tied weight, and the rows its first-arriving part left for the cross term."""

    ids: torch.Tensor | None = None
    rows: torch.Tensor | None = None


@dataclass(eq=False)
class _MicroBatch:
    """Accumulates one micro-batch: squared norms, and k combinations into p.grad and the score buffers."""

    engine: PerSequenceGradients
    coefficients: torch.Tensor  # (k, B) float64: row 0 = c^R, row 1 + j = c^S of the sequences of labels[j]
    labels: list
    sq_norms: torch.Tensor  # (B,) float64
    groups: torch.Tensor | None = None
    segments: PackedSegments | None = None  # None: one row per sequence
    buckets: list = field(default_factory=lambda: [_Bucket()])  # of the per-sequence weight gradients
    received: set = field(default_factory=set)  # (site name, parameter id) of every gradient part
    forwards: set = field(default_factory=set)  # sites whose forward built a graph
    tied: dict = field(default_factory=dict)  # parameter id -> _TiedState
    _cast: dict = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.coefficients.shape[1]

    def coefficients_as(self, like: torch.Tensor, bucket: _Bucket | None = None) -> torch.Tensor:
        """The (k, B) coefficients in like's dtype and device; with a bucket, its columns (k, B_b)."""
        sequences = None if bucket is None else bucket.sequences
        key = (like.dtype, like.device, None if sequences is None else id(bucket))
        if key not in self._cast:
            cast = self.coefficients.to(device=like.device, dtype=like.dtype)
            self._cast[key] = cast if sequences is None else cast[:, sequences.to(like.device)]
        return self._cast[key]

    def per_sequence(self, values: torch.Tensor) -> torch.Tensor:
        """A module input or output gradient as (B, T, ...), row i = sequence i.

        One row per sequence: (B, ..., width) -> (B, T, width). Packed: (1, tokens, ...) -> (B, max_len, ...),
        zero after each sequence's end (`PackedSegments.pad`); tokens after cu_seqlens[-1] are dropped.
        """
        if self.segments is not None:
            return self.segments.pad(values[0])
        return values.reshape(self.batch_size, -1, values.shape[-1])

    def forward_ran(self, name: str) -> None:
        self.forwards.add(name)

    def is_tied(self, param: torch.Tensor) -> bool:
        return id(param) in self.engine.tied_params

    def record_tied_ids(self, param: torch.Tensor, ids: torch.Tensor) -> None:
        if self.is_tied(param):
            self.tied.setdefault(id(param), _TiedState()).ids = ids

    def _receive(self, name: str, param: torch.Tensor) -> None:
        """Each module contributes each parameter's gradient once per micro-batch: a second part from
        the same module (called twice, or a second backward) would need a cross term nobody computes."""
        key = (name, id(param))
        if key in self.received:
            raise RuntimeError(
                f"module {name!r} received a second gradient for the same parameter in one micro-batch (called "
                "twice, or two backward passes); its per-sequence norm would miss the cross term"
            )
        self.received.add(key)

    def _targets(self, param: torch.Tensor) -> list[torch.Tensor]:
        """Flat views of p.grad (G_R) and of the score buffer of each label of this micro-batch (G_S^γ)."""
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        buffers = [self.engine.score_buffer(label, param) for label in self.labels]
        return [param.grad.view(-1)] + [buffer.view(-1) for buffer in buffers]

    def _add_sq_norms(self, values: torch.Tensor, bucket: _Bucket | None = None) -> None:
        """sq_norms += values, one per sequence (of the bucket's sequences, if given)."""
        values = values.to(device=self.sq_norms.device, dtype=torch.float64)
        if bucket is None or bucket.sequences is None:
            self.sq_norms += values
        else:
            self.sq_norms.index_add_(0, bucket.sequences.to(self.sq_norms.device), values)

    def _accumulate(
        self, param: torch.Tensor, per_sample: torch.Tensor, offset: int, bucket: _Bucket | None = None
    ) -> None:
        """Norms and k combinations of per-sequence gradients (B, n) of the flat slice [offset, offset + n).

        With a bucket, the rows of per_sample are its sequences (B_b, n).
        """
        per_sample = per_sample.reshape(per_sample.shape[0], -1).to(param.dtype)
        self._add_sq_norms(torch.linalg.vecdot(per_sample, per_sample), bucket)
        coefficients = self.coefficients_as(per_sample, bucket)
        n = per_sample.shape[1]
        for row, target in enumerate(self._targets(param)):
            target[offset : offset + n].view(1, n).addmm_(coefficients[row : row + 1], per_sample)

    def add_dense(self, name: str, param: torch.Tensor, per_sample: torch.Tensor) -> None:
        """Per-sequence gradients of a whole parameter, shape (B, *param.shape)."""
        self._receive(name, param)
        self._accumulate(param, per_sample, 0)

    def add_outer_products(self, name: str, param: torch.Tensor, parts: list) -> None:
        """Per-sequence gradients P_i = rows_iᵀ cols_i of an (R, C) weight, by the cheaper route.

        ``parts``: (bucket, rows (B_b, T_b, R), cols (B_b, T_b, C)) for every bucket of the micro-batch.
        """
        self._receive(name, param)
        for bucket, rows, cols in parts:
            self._add_bucket_outer_products(param, bucket, rows, cols)

    def from_buckets(self, parts: list) -> torch.Tensor:
        """Per-bucket values (bucket, (B_b, ...)) -> per-sequence values (B, ...) in micro-batch order."""
        if len(parts) == 1 and parts[0][0].sequences is None:
            return parts[0][1]
        first = parts[0][1]
        out = first.new_zeros((self.batch_size, *first.shape[1:]))
        for bucket, values in parts:
            out.index_copy_(0, bucket.sequences, values)
        return out

    def _add_bucket_outer_products(
        self, param: torch.Tensor, bucket: _Bucket, rows: torch.Tensor, cols: torch.Tensor
    ) -> None:
        batch, tokens, num_rows, num_cols = rows.shape[0], rows.shape[1], rows.shape[2], cols.shape[2]
        mode = self.engine.mode
        if mode == "ghost" or (
            mode == "auto"
            and prefers_ghost(tokens, num_rows, num_cols, self.coefficients.shape[0], self.engine.pass_cost(param))
        ):
            self._add_outer_products_ghost(param, bucket, rows, cols)
            return
        # Blocks of weight rows small enough to stay in cache between the matmul and the reductions.
        block_rows = self.engine.block_bytes(param) // (batch * num_cols * param.element_size())
        block_rows = min(num_rows, max(MIN_BLOCK_ROWS, block_rows))
        for start in range(0, num_rows, block_rows):
            block = per_sample_outer(rows[..., start : start + block_rows], cols)
            self._accumulate(param, block, start * num_cols, bucket)

    def _add_outer_products_ghost(
        self, param: torch.Tensor, bucket: _Bucket, rows: torch.Tensor, cols: torch.Tensor
    ) -> None:
        batch, tokens = rows.shape[0], rows.shape[1]
        chunk = max(1, self.engine.block_bytes(param) // (2 * tokens * tokens * rows.element_size()))
        norms = [ghost_sq_norms(rows[s : s + chunk], cols[s : s + chunk]) for s in range(0, batch, chunk)]
        self._add_sq_norms(torch.cat(norms), bucket)
        coefficients = self.coefficients_as(rows, bucket)
        flat_cols = cols.reshape(-1, cols.shape[-1])
        for row, target in enumerate(self._targets(param)):
            weighted_rows = (coefficients[row].view(-1, 1, 1) * rows).reshape(-1, rows.shape[-1])
            target.view(rows.shape[-1], -1).addmm_(weighted_rows.t(), flat_cols)

    def add_sparse_rows(self, name: str, param: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Per-sequence embedding gradients: rows (B, T, d) scattered at ids (B, T)."""
        self._receive(name, param)
        self._add_sq_norms(sparse_rows_sq_norms(ids, rows, param.shape[0]))
        rows = rows.to(param.dtype)
        coefficients = self.coefficients_as(rows)
        flat_ids = ids.flatten()
        for row, target in enumerate(self._targets(param)):
            weighted_rows = (coefficients[row].view(-1, 1, 1) * rows).reshape(-1, rows.shape[-1])
            target.view(param.shape).index_add_(0, flat_ids, weighted_rows)

    def chunked_rows_at_ids(self, delta: torch.Tensor, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`rows_at_ids` over chunks of ids, so the gathered (B, T, S) columns stay within ``block_bytes``."""
        batch, tokens = delta.shape[0], delta.shape[1]
        chunk = max(1, self.engine.block_bytes(delta) // (batch * tokens * delta.element_size()))
        return torch.cat([rows_at_ids(delta, x, ids[:, s : s + chunk]) for s in range(0, ids.shape[1], chunk)], 1)

    def add_tied_part(self, param: torch.Tensor, rows_at) -> None:
        """Cross term 2 Σ_t <H_i[id_t], δ^E_{i,t}> of a tied weight, once both parts have arrived.

        ``rows_at(ids)`` gives this part's rows at the embedding positions, shape (B, T_e, d).
        """
        state = self.tied.get(id(param))
        if state is None or state.ids is None:
            return  # the embedding did not run in this micro-batch: there is no cross term
        rows = rows_at(state.ids)
        if state.rows is None:
            state.rows = rows
            return
        self._add_sq_norms(2.0 * torch.einsum("btd,btd->b", state.rows, rows))
        state.rows = None

    def check_complete(self) -> None:
        received = {name for name, _ in self.received}
        missing = sorted(self.forwards - received)
        if missing:
            raise RuntimeError(
                f"modules {missing[:3]} ran a forward inside `micro_batch` but their backward did not run inside "
                "it; call backward() inside the `with engine.micro_batch(...)` block"
            )


# ----------------------------------------------------------------------------------------------
# The engine.
# ----------------------------------------------------------------------------------------------


class PerSequenceGradients:
    """Per-sequence squared gradient norms and the two-buffer OPOB update from one backward pass.

    Args:
        model: any torch module built from supported module kinds (module docstring); every
            trainable parameter must belong to one. Modules without trainable parameters are untouched.
        mode: "auto" picks ghost norms or materialised per-sequence gradients per call from the cost
            model `prefers_ghost`; "materialize" / "ghost" force one route (both exact).
        block_bytes: size of one block of materialised per-sequence gradients; default per device
            type (``DEFAULT_BLOCK_BYTES``).
        pass_cost: the machine balance of `prefers_ghost`; default per device type (``DEFAULT_PASS_COST``).

    Raises ValueError naming the module and parameter if a trainable parameter is not handled.
    """

    def __init__(
        self, model: nn.Module, mode: str = "auto", block_bytes: int | None = None, pass_cost: float | None = None
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if block_bytes is not None and not block_bytes > 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        if pass_cost is not None and not (math.isfinite(pass_cost) and pass_cost > 0):
            raise ValueError(f"pass_cost must be a positive finite number, got {pass_cost}")
        self.mode = mode
        self._block_bytes = block_bytes
        self._pass_cost = pass_cost
        self.sites, self.tied_params = _collect_sites(self, model)
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._active: _MicroBatch | None = None
        self._score_buffers: dict = {}  # label -> {parameter id: G_S buffer}
        self._open_norms: list[torch.Tensor] = []
        self._open_labels: list = []
        self._grouped: bool | None = None

    def block_bytes(self, like: torch.Tensor) -> int:
        return self._block_bytes or DEFAULT_BLOCK_BYTES.get(like.device.type, DEFAULT_BLOCK_BYTES["cuda"])

    def pass_cost(self, like: torch.Tensor) -> float:
        return self._pass_cost or DEFAULT_PASS_COST.get(like.device.type, DEFAULT_PASS_COST["cuda"])

    def active_micro_batch(self, name: str) -> _MicroBatch:
        if self._active is None:
            raise RuntimeError(f"module {name!r} ran its per-sequence forward or backward outside `micro_batch`")
        return self._active

    def score_buffer(self, label, param: torch.Tensor) -> torch.Tensor:
        buffers = self._score_buffers.setdefault(label, {})
        if id(param) not in buffers:
            buffers[id(param)] = (param, torch.zeros_like(param))
        return buffers[id(param)][1]

    @property
    def sq_norms(self) -> torch.Tensor:
        """||g_i||² (float64) of every sequence since the last `combine`, in micro-batch order."""
        if not self._open_norms:
            raise ValueError("no micro-batch has run since the last combine()")
        return torch.cat(self._open_norms)

    @property
    def groups(self) -> torch.Tensor | None:
        """Group labels of the sequences since the last `combine` (None without ``groups=``)."""
        return torch.tensor(self._open_labels) if self._grouped else None

    @contextlib.contextmanager
    def micro_batch(
        self,
        coef_r: torch.Tensor,
        coef_s: torch.Tensor,
        groups: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> Iterator[None]:
        """Run the forward AND backward of one micro-batch inside this block.

        Backpropagate the plain sum Σ_i l_i of the per-sequence scores (unit weights): every weight
        belongs in the coefficients. Without ``cu_seqlens`` row i of every module input must be
        sequence i. If the block raises, every open sequence is dropped and p.grad holds a partial
        sum: zero it.

        Args:
            coef_r: c^R_i, shape (B,): coefficients of G_R (accumulated into p.grad).
            coef_s: c^S_i, shape (B,): coefficients of the score buffers G_S.
            groups: baseline group label per sequence (integers), or None for one baseline over all
                sequences up to `combine`. One score buffer per label is kept until `combine`.
            cu_seqlens: packed ("remove padding") micro-batch: integer offsets (B + 1,), 0 = c_0 < ... < c_B,
                of B sequences concatenated along the token dimension of ONE row; every module input is
                then (1, tokens, ...) with tokens >= c_B. Sequence i is tokens [c_i, c_{i+1}). Tokens from
                c_B on are padding that belongs to no sequence: they are left out of every norm and of
                p.grad and the score buffers (their gradient, zero for a loss that ignores them, is
                dropped). The attention must not cross sequences (e.g. HF position_ids restarting at 0
                with attention_mask=None and use_cache=False, or flash-attn varlen): the engine cannot check it.
        """
        if self._active is not None:
            raise RuntimeError("micro_batch blocks cannot be nested")
        grouped_before = self._grouped
        coefficients, labels, label_of_sequence = self._coefficient_rows(coef_r, coef_s, groups)
        device = self._params[0].device if self._params else coef_r.device
        segments = None
        if cu_seqlens is not None:
            try:
                offsets = check_cu_seqlens(cu_seqlens, coefficients.shape[1])
            except ValueError:
                self._grouped = grouped_before  # nothing was opened
                raise
            segments = PackedSegments.from_cu_seqlens(offsets, device)
        micro_batch = _MicroBatch(
            engine=self,
            coefficients=coefficients,
            labels=labels,
            sq_norms=torch.zeros(coefficients.shape[1], dtype=torch.float64, device=device),
            groups=groups,
            segments=segments,
            buckets=_buckets(segments, device),
        )
        guards = [p.register_hook(_unhandled_gradient_guard) for p in self._params]
        for site in self.sites:
            site.install()
        self._active = micro_batch
        try:
            yield
            micro_batch.check_complete()
        except BaseException:
            self._discard()
            raise
        finally:
            self._active = None
            for site in self.sites:
                site.uninstall()
            for guard in guards:
                guard.remove()
        self._open_norms.append(micro_batch.sq_norms)
        self._open_labels.extend(label_of_sequence)

    def set_coefficients(self, coef_r: torch.Tensor, coef_s: torch.Tensor) -> None:
        """Replace c^R and c^S of the open micro-batch after its forward and before its backward.

        Truncated weights such as min(w_i, c) depend on the learner's log-probs, which exist only
        after the forward; setting them here saves a separate no-grad forward.
        """
        active = self.active_micro_batch("set_coefficients")
        if active.received:
            raise RuntimeError("set_coefficients must be called before the micro-batch's backward")
        coefficients, labels, _ = self._coefficient_rows(coef_r, coef_s, active.groups)
        if coefficients.shape[1] != active.batch_size:
            raise ValueError(f"coef_r has {coefficients.shape[1]} sequences, the micro-batch {active.batch_size}")
        active.coefficients, active.labels = coefficients, labels
        active._cast.clear()

    def _coefficient_rows(self, coef_r, coef_s, groups):
        """(k, B) coefficient matrix, the labels of its score rows, and each sequence's label."""
        check_float(coef_r, "coef_r")
        check_float(coef_s, "coef_s")
        if coef_r.dim() != 1 or coef_r.shape[0] == 0:
            raise ValueError(f"coef_r must be 1-D with one coefficient per sequence, got {tuple(coef_r.shape)}")
        batch = coef_r.shape[0]
        check_sequence_inputs(batch, coef_s=coef_s, groups=groups)
        for name, value in (("coef_r", coef_r), ("coef_s", coef_s)):
            if not bool(torch.isfinite(value).all()):
                raise ValueError(f"{name} must be finite")
        grouped = groups is not None
        if self._grouped is not None and grouped != self._grouped:
            raise ValueError("groups must be given for every micro-batch up to combine(), or for none")
        if grouped and groups.is_floating_point():
            raise ValueError(f"groups must hold integer labels, got dtype {groups.dtype}")
        self._grouped = grouped
        coef_r, coef_s = coef_r.detach().to(torch.float64), coef_s.detach().to(torch.float64)
        if not grouped:
            return torch.stack([coef_r, coef_s]), [None], [None] * batch
        label_of_sequence = groups.tolist()
        labels = sorted(set(label_of_sequence))
        row_of_sequence = torch.tensor([labels.index(label) for label in label_of_sequence], device=coef_s.device)
        score_rows = torch.zeros(len(labels), batch, dtype=torch.float64, device=coef_s.device)
        score_rows[row_of_sequence, torch.arange(batch, device=coef_s.device)] = coef_s
        return torch.cat([coef_r.unsqueeze(0), score_rows]), labels, label_of_sequence

    def combine(self, baseline: torch.Tensor | float) -> None:
        """p.grad ← G_R − Σ_γ b_γ G_S^γ, then free the score buffers (Algorithm 1, line 15).

        Args:
            baseline: b per sequence since the last combine, shape (n,), constant within each group
                (as `opob_baseline` returns it), or one number for all of them.
        """
        if not self._open_norms:
            raise ValueError("combine() needs at least one micro_batch since the last combine()")
        per_label = self._baseline_per_label(baseline)
        for label, buffers in self._score_buffers.items():
            for param, buffer in buffers.values():
                param.grad.add_(buffer, alpha=-per_label[label])
        self._discard()

    def _baseline_per_label(self, baseline) -> dict:
        count = len(self._open_labels)
        if not isinstance(baseline, torch.Tensor):
            baseline = torch.full((count,), float(baseline), dtype=torch.float64)
        check_float(baseline, "baseline")
        check_sequence_inputs(count, baseline=baseline)
        values = baseline.detach().to(torch.float64).cpu()
        if not bool(torch.isfinite(values).all()):
            raise ValueError("baseline must be finite")
        per_label: dict = {}
        for label, value in zip(self._open_labels, values.tolist(), strict=True):
            first = per_label.setdefault(label, value)
            if abs(first - value) > 1e-6 * (1.0 + abs(first)):
                raise ValueError(
                    f"baseline must be constant within a group (group {label!r} has {first} and {value}); "
                    "pass groups= to micro_batch for per-group baselines"
                )
        return per_label

    def _discard(self) -> None:
        self._score_buffers = {}
        self._open_norms = []
        self._open_labels = []
        self._grouped = None


def _unhandled_gradient_guard(grad: torch.Tensor | None) -> None:
    # The per-sequence functions return no parameter gradient; a real one came from elsewhere.
    if grad is not None:
        raise RuntimeError(
            "a trainable parameter received a gradient through an operation outside the per-sequence "
            "handlers (e.g. a functional use of a module's weight); its per-sequence norm would be wrong"
        )


def _collect_sites(engine: PerSequenceGradients, model: nn.Module) -> tuple[list[_Site], set[int]]:
    """A site for every module with trainable parameters, and the ids of tied weights.

    Rejects anything not handled exactly: unknown module kinds, unsupported options, and parameters
    shared other than one weight between one Embedding and one Linear.
    """
    sites, owners = [], {}
    for name, module in model.named_modules():
        trainable = [(pname, p) for pname, p in module.named_parameters(recurse=False) if p.requires_grad]
        if not trainable:
            continue
        kind = module_kind(module)
        if kind is None:
            raise ValueError(
                f"module {name!r} ({type(module).__name__}) has trainable parameter {trainable[0][0]!r} but no "
                "per-sequence gradient handler; supported: Linear, HF Conv1D, Embedding, LayerNorm, HF RMSNorm "
                f"{HF_RMS_NORM_CLASSES}. Freeze it (requires_grad=False) or add a handler"
            )
        _check_module_options(name, kind, module)
        if "forward" in vars(module):
            raise ValueError(f"module {name!r} has an instance-level forward (a wrapper); not supported")
        site = _Site(engine, name, module, kind)
        if kind in ("rms_norm", "conv1d"):
            _check_same_forward(name, site)
        sites.append(site)
        for pname, p in trainable:
            owners.setdefault(id(p), []).append((f"{name}.{pname}" if name else pname, kind))
    tied = set()
    for param_id, users in owners.items():
        if len(users) == 1:
            continue
        kinds = sorted(kind for _, kind in users)
        if kinds != ["embedding", "linear"] or not all(user.endswith("weight") for user, _ in users):
            raise ValueError(
                f"parameter shared by {[user for user, _ in users]}: only a weight tied between one Embedding "
                "and one Linear (tied input/output embeddings) is supported"
            )
        tied.add(param_id)
    return sites, tied
