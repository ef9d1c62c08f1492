"""The math of per-sequence gradients as pure functions: outer products and their norms (materialised
or ghost), sparse embedding rows, RMS normalisation, and the segments of a packed micro-batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

NORM_METHODS = ("auto", "materialize", "ghost")  # how PerSequenceGradients computes the norms
# How the per-sequence gradients are combined: during the backward into G_R and the score buffers, once
# the baseline is known into Ĝ, or during the backward into each group's success and failure buffers
# (PerSequenceGradients).
COMBINATIONS = ("buffers", "deferred", "split")
# The norms alone: a backward that forms ||g_i||² and no gradient (the first pass of a two-pass OPOB step,
# whose second pass is a plain backward of Σ_i (c^R_i − b_γ(i) c^S_i) l_i once b is known).
NORMS_ONLY = "norms"
# Combinations whose gradient is formed after the backward (at `combine`, or by a second pass): the backward
# forms the norms alone, and costs them as such.
NORMS_IN_BACKWARD = ("deferred", NORMS_ONLY)
# Per-sequence gradients of these dtypes (autocast's matmul outputs, bf16 parameters) are widened to
# float32 before they are squared, summed over sequences or scaled by coefficients.
LOW_PRECISION = (torch.float16, torch.bfloat16)

# Per-sequence gradients are formed in blocks of weight rows of about this many bytes. CPU: about the L2, so that
# the reductions that follow read them from cache (unblocked, the reductions over a (B, 32000, 512) lm_head gradient
# ran at DRAM speed, 1.5x slower). CUDA: few blocks, because every block dispatches about seven operators and the
# H200 step was bound by dispatching them (tables/gpu_check/profile_opob.txt: 0.64 s of CPU against 0.44 s of GPU at
# 16 MiB blocks); at 128 MiB the GPU check's step dispatches 1.39x a plain step's operators, at 16 MiB 1.88x
# (tables/opob_engine/aten_ops_0.5b.log). Such a block is larger than an H100's or H200's L2 (50 MB), so its passes
# run at HBM speed: `benchmarks/gpu_check.py` times both sizes (part `blocks`).
DEFAULT_BLOCK_BYTES = {"cpu": 2 << 20, "cuda": 128 << 20}
MIN_BLOCK_ROWS = 16
# Rows per block are a multiple of this (but for a weight's last block), so that each block's slice of the output
# gradient starts aligned for the GPU's tensor-core GEMMs: the H200 step had 834 blocks starting at a nonzero multiple
# of 1,170 or 215 bf16 rows (not 16-byte aligned), and tables/gpu_check/profile_opob.txt shows 836 calls of CUTLASS
# kernels at 127-236 us each (inferred, not isolated). CPU: 1, which keeps the archived runs' blocks and arithmetic.
DEFAULT_BLOCK_ROW_MULTIPLE = {"cpu": 1, "cuda": 64}

# Cost of the reductions over one materialised per-sequence gradient element, in multiply-adds of
# a large matmul (the machine balance of in-cache passes). CPU: `benchmarks/opob_overhead.py
# --calibrate` measured 43-74 on a 2-core AVX-512 EPYC (512x1536 float32 layer, T = 32-256). CUDA: 1143
# measured on an H200 (896x4864 bf16 layer, T = 2048; tables/gpu_check/calibrate.log), with 16 MiB blocks, whose passes
# ran in L2: the GPU check's calibrate part re-measures it at the present blocks.
DEFAULT_PASS_COST = {"cpu": 64.0, "cuda": 1143.0}


def device_default(per_device: dict, device_type: str):
    """A per-device-type default for a device type (one without its own entry takes CUDA's)."""
    return per_device.get(device_type, per_device["cuda"])



def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for float16 / bfloat16; other dtypes unchanged."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


def widened(values: torch.Tensor) -> torch.Tensor:
    return values.to(wide_dtype(values.dtype))


def add_product(target: torch.Tensor, a: torch.Tensor, b: torch.Tensor, assign: bool = False) -> None:
    """target += a @ b (``assign``: target = a @ b, its old values unread): the product in a's dtype (a bf16
    matmul under autocast), the sum in target's."""
    if target.dtype == a.dtype:
        if assign:
            torch.mm(a, b, out=target)
        else:
            target.addmm_(a, b)
    elif assign:
        target.copy_(a @ b)
    else:
        target.add_(a @ b)


def per_sample_outer(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """P_i = Σ_t rows_{i,t} ⊗ cols_{i,t} = rows_iᵀ cols_i, shape (B, R, C), for rows (B, T, R), cols (B, T, C).

    With rows = δ and cols = x this is sequence i's gradient of a Linear weight (out, in).
    """
    return torch.bmm(rows.transpose(1, 2), cols)


def gram(values: torch.Tensor) -> torch.Tensor:
    """The Gram matrices values_i values_iᵀ, shape (B, T, T), widened, for values (B, T, w)."""
    return widened(torch.bmm(values, values.transpose(1, 2)))


def ghost_sq_norms(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """||rows_iᵀ cols_i||²_F = Σ_{t,s} (rows_t·rows_s)(cols_t·cols_s) per sequence, shape (B,).

    Never forms the (R, C) matrix: cost B·T²·(R + C) multiply-adds and 2·B·T² values of memory.
    """
    return gram_sq_norms(gram(rows), gram(cols))


def gram_sq_norms(row_gram: torch.Tensor, col_gram: torch.Tensor) -> torch.Tensor:
    """`ghost_sq_norms` from the two sides' Gram matrices (B, T, T): Σ_{t,s} of their product."""
    return torch.linalg.vecdot(row_gram.flatten(1), col_gram.flatten(1))


def rows_per_block(num_rows: int, batch: int, num_cols: int, itemsize: int, block_bytes: int, multiple: int) -> int:
    """Rows of an (R, C) weight per block of per-sequence gradients (B, rows, C) of ``itemsize`` bytes: at most
    ``block_bytes`` (at least MIN_BLOCK_ROWS rows), a multiple of ``multiple``; all R where they fit."""
    rows = max(MIN_BLOCK_ROWS, block_bytes // (batch * num_cols * itemsize))
    return min(num_rows, max(multiple, rows // multiple * multiple))


def prefers_ghost(lengths: list[int], rows: int, cols: int, num_combinations: int, pass_cost: float,
                  deferred: bool = False) -> bool:
    """True when the ghost route costs less than materialising per-sequence gradients, for sequences of
    these token counts.

    Costs beyond a plain backward, per sequence of T tokens, in multiply-adds of a large matmul:
      materialise: the per-sequence matmuls replace autograd's weight gradient (same FLOPs); extra
                   are the in-cache reductions over R·C values:     pass_cost · R · C
      ghost:       the Gram matrices, and one weight-gradient matmul per combination beyond the first:
                   T²·(R + C) + (k − 1)·T·R·C
    Long sequences therefore materialise; only very short ones (T below ~pass_cost) go ghost.
    Deferred combination (one weight-gradient matmul either way, at `combine`), the norms alone:
      materialise: T·R·C + pass_cost·R·C        ghost: T²·(R + C)
    """
    if deferred:
        materialize = sum(tokens + pass_cost for tokens in lengths) * rows * cols
        ghost = sum(tokens * tokens * (rows + cols) for tokens in lengths)
        return ghost < materialize
    materialize = len(lengths) * pass_cost * rows * cols
    ghost = sum(tokens * tokens * (rows + cols) + (num_combinations - 1) * tokens * rows * cols for tokens in lengths)
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
    flat_rows = widened(rows.reshape(-1, rows.shape[-1]))
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


def segment_sums(packed: torch.Tensor, offsets: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Σ over tokens [offsets[i], offsets[i + 1]) of packed (tokens, ...) for every i, shape (B, ...), in ``dtype``:
    one product with the (B, tokens) indicator of the segments (B Python-level sums, or a
    zero-padded (B, max_len, ...) copy summed, cost more than the product of this width)."""
    total, batch = offsets[-1], len(offsets) - 1
    token = torch.arange(total, device=packed.device)
    starts, ends = (torch.tensor(bound, device=packed.device) for bound in (offsets[:-1], offsets[1:]))
    indicator = ((token >= starts[:, None]) & (token < ends[:, None])).to(dtype)
    flat = packed[:total].reshape(total, -1).to(dtype)
    return (indicator @ flat).view(batch, *packed.shape[1:])


@dataclass(frozen=True)
class PackedSegments:
    """B sequences packed along the token dimension of one row, at offsets cu_seqlens (B + 1,).

    Token t < cu_seqlens[-1] belongs to sequence i with cu_seqlens[i] <= t < cu_seqlens[i + 1]; tokens
    from cu_seqlens[-1] on (trailing padding) belong to none. `pad` lays a packed tensor out as
    (B, max_len, ...) with zeros after each sequence's end, the one-row-per-sequence layout of the
    embedding and norm handlers (Linear/Conv1D read views of each sequence instead); zero rows add
    nothing to any per-sequence gradient, norm or cross term, so the result is exact and trailing
    padding tokens are left out.
    """

    cu_seqlens: torch.Tensor  # (B + 1,) int64
    offsets: tuple[int, ...]  # the same, as Python integers (where each sequence's view starts and ends)
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
        return cls(offsets, tuple(offsets.tolist()), max_len, sequence * max_len + position)

    @property
    def batch_size(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    @property
    def lengths(self) -> list[int]:
        return [end - start for start, end in zip(self.offsets, self.offsets[1:])]

    @property
    def total_tokens(self) -> int:
        return self.flat_index.shape[0]

    def pad(self, packed: torch.Tensor) -> torch.Tensor:
        """(tokens, ...) with tokens >= total_tokens  ->  (B, max_len, ...), zero-filled; trailing tokens dropped."""
        rest = packed.shape[1:]
        padded = packed.new_zeros((self.batch_size * self.max_len, *rest))
        padded.index_copy_(0, self.flat_index, packed[: self.total_tokens])
        return padded.view(self.batch_size, self.max_len, *rest)
