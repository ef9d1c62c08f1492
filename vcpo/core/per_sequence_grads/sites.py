"""One site per parameterised module, and the per-micro-batch accumulator that reduces each module's
per-sequence gradients to squared norms and to the coefficient combinations (G_R, the score buffers)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from vcpo.core.per_sequence_grads.functions import _AffineFunction, _EmbeddingFunction, _OuterProductFunction
from vcpo.core.per_sequence_grads.reductions import (
    NORMS_IN_BACKWARD,
    NORMS_ONLY,
    PackedSegments,
    add_product,
    ghost_sq_norms,
    gram,
    gram_sq_norms,
    per_sample_outer,
    prefers_ghost,
    rms_normalize,
    rows_at_ids,
    rows_per_block,
    segment_sums,
    sparse_rows_sq_norms,
    wide_dtype,
    widened,
)


class SiteOwner(Protocol):
    """What a site reads of its ``PerSequenceGradients`` (which builds the sites, so this module cannot
    import it)."""

    norm_method: str
    combination: str
    tied_params: set[int]

    def active_micro_batch(self, name: str) -> _MicroBatch: ...
    def block_bytes(self, like: torch.Tensor) -> int: ...
    def block_row_multiple(self, like: torch.Tensor) -> int: ...
    def pass_cost(self, like: torch.Tensor) -> float: ...
    def score_buffer(self, key, param: torch.Tensor) -> tuple[torch.Tensor, bool]: ...
    def reward_buffer(self, param: torch.Tensor) -> torch.Tensor: ...

@dataclass(eq=False)
class _Site:
    """One handled module: installs its per-sequence forward and routes its backward to the micro-batch."""

    owner: SiteOwner
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
        micro_batch = self.owner.active_micro_batch(self.name)
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
        micro_batch = self.owner.active_micro_batch(self.name)
        inputs, delta = micro_batch.rows(x), micro_batch.rows(grad_out)
        weight, bias = self.module.weight, self.module.bias
        if weight.requires_grad:
            rows, cols = (inputs, delta) if self.transposed else (delta, inputs)
            micro_batch.add_outer_products(self.name, weight, rows, cols, shared=inputs)
            if micro_batch.is_tied(weight):
                block_bytes = self.owner.block_bytes(weight)
                micro_batch.add_tied_part(weight, lambda ids: delta.rows_at_ids(inputs, ids, block_bytes))
        if bias is not None and bias.requires_grad:
            micro_batch.add_dense(self.name, bias, delta.sums())

    def embedding_backward(self, ids: torch.Tensor, grad_out: torch.Tensor) -> None:
        micro_batch = self.owner.active_micro_batch(self.name)
        if micro_batch.segments is not None:
            ids, grad_out = micro_batch.per_sequence(ids), micro_batch.per_sequence(grad_out)
        padding_idx = self.module.padding_idx
        rows = grad_out if padding_idx is None else grad_out * (ids != padding_idx).unsqueeze(-1).to(grad_out.dtype)
        weight = self.module.weight
        micro_batch.add_sparse_rows(self.name, weight, ids, rows)
        if micro_batch.is_tied(weight):
            micro_batch.add_tied_part(weight, lambda _ids: rows)

    def affine_backward(self, x_hat: torch.Tensor, grad_out: torch.Tensor) -> None:
        micro_batch = self.owner.active_micro_batch(self.name)
        weight, bias = self.module.weight, getattr(self.module, "bias", None)
        if weight.requires_grad:
            weighted = grad_out * x_hat
            micro_batch.add_dense(self.name, weight, micro_batch.rows(weighted).sums(weighted.dtype))
        if bias is not None and bias.requires_grad:
            micro_batch.add_dense(self.name, bias, micro_batch.rows(grad_out).sums(grad_out.dtype))


@dataclass(frozen=True)
class _Rows:
    """A Linear/Conv1D input or output gradient, sequence by sequence, never copied.

    One row per sequence: ``values`` (B, T, w), row i = sequence i (zero after its end); the per-sequence
    products are batched matmuls. Packed: ``values`` (tokens, w), the packed row, and ``offsets``
    c_0 .. c_B: sequence i is the view values[c_i : c_{i+1}], and the per-sequence products are one
    matmul per sequence on those views, so nothing is gathered or padded. Tokens from c_B on (trailing
    padding) belong to no sequence and are never read.
    """

    values: torch.Tensor
    offsets: tuple[int, ...] | None = None

    @property
    def batch_size(self) -> int:
        return self.values.shape[0] if self.offsets is None else len(self.offsets) - 1

    @property
    def width(self) -> int:
        return self.values.shape[-1]

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def lengths(self) -> list[int]:
        if self.offsets is None:
            return [self.values.shape[1]] * self.values.shape[0]
        return [end - start for start, end in zip(self.offsets, self.offsets[1:])]

    @functools.cached_property
    def _views(self) -> list[torch.Tensor]:
        return [self.values[start:end] for start, end in zip(self.offsets, self.offsets[1:])]

    def sequences(self) -> list[torch.Tensor]:
        """Packed: the (T_i, w) view of every sequence."""
        return self._views

    def outer_blocks(self, cols: _Rows, block_rows: int, order: torch.Tensor | None = None):
        """Every sequence's selfᵢᵀ colsᵢ in blocks of ``block_rows`` rows, each (B, rows, C); packed, with ``order``,
        the sequences in that order. A block is one matmul (padded) or one per sequence (packed), the inputs sliced
        once per call, not per block: on a GPU every dispatched operator costs a launch."""
        if self.offsets is None:
            parts = (self.values,) if block_rows >= self.width else self.values.split(block_rows, -1)
            for part in parts:
                yield per_sample_outer(part, cols.values)
            return
        sequences = [sequence.t() for sequence in self.sequences()]
        columns = cols.sequences()
        for start in range(0, self.width, block_rows):
            stop = min(start + block_rows, self.width)
            out = self.values.new_empty((self.batch_size, stop - start, cols.width))
            for j, i in enumerate(range(self.batch_size) if order is None else order.tolist()):
                rows = sequences[i] if (start, stop) == (0, self.width) else sequences[i][start:stop]
                torch.mm(rows, columns[i], out=out[j])
            yield out

    def ghost_sq_norms(self, cols: _Rows, block_bytes: int, grams) -> torch.Tensor:
        """||selfᵢᵀ colsᵢ||² per sequence, the Gram matrices of at most ``block_bytes`` at a time, each
        from ``grams(values, start, stop)`` (sequences [start, stop) of one side)."""
        if self.offsets is not None:
            return torch.cat([ghost_sq_norms(r[None], c[None]) for r, c in zip(self.sequences(), cols.sequences())])
        batch, tokens = self.values.shape[0], self.values.shape[1]
        chunk = max(1, block_bytes // (2 * tokens * tokens * self.values.element_size()))
        return torch.cat([
            gram_sq_norms(grams(self.values, s, s + chunk), grams(cols.values, s, s + chunk))
            for s in range(0, batch, chunk)
        ])

    def select(self, indices: list[int]) -> _Rows:
        """Sequences ``indices`` alone (copied, unless they are consecutive)."""
        if self.offsets is None:
            return _Rows(self.values[indices])
        lengths = [self.lengths[i] for i in indices]
        offsets = tuple(int(end) for end in torch.tensor([0, *lengths]).cumsum(0))
        if indices == list(range(indices[0], indices[-1] + 1)):
            return _Rows(self.values[self.offsets[indices[0]] : self.offsets[indices[-1] + 1]], offsets)
        sequences = self.sequences()
        return _Rows(torch.cat([sequences[i] for i in indices]), offsets)

    def tokens(self) -> torch.Tensor:
        """Every token that belongs to a sequence, (N, w), in sequence order."""
        return self.values.reshape(-1, self.width) if self.offsets is None else self.values[: self.offsets[-1]]

    def weighted_tokens(self, per_sequence: torch.Tensor) -> torch.Tensor:
        """`tokens` with sequence i's tokens scaled by per_sequence[i] (its dtype), cast back to ours."""
        if self.offsets is None:
            return (per_sequence.view(-1, 1, 1) * self.values).to(self.dtype).reshape(-1, self.width)
        lengths = torch.tensor(self.lengths, device=per_sequence.device)
        return (per_sequence.repeat_interleave(lengths).view(-1, 1) * self.tokens()).to(self.dtype)

    def sums(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Σ_t of every sequence, (B, w), in ``dtype`` (default: the widened dtype)."""
        dtype = dtype or wide_dtype(self.dtype)
        if self.offsets is None:
            return self.values.sum(1, dtype=dtype)
        return segment_sums(self.values, self.offsets, dtype)

    def rows_at_ids(self, inputs: _Rows, ids: torch.Tensor, block_bytes: int) -> torch.Tensor:
        """`rows_at_ids` (self = δ, inputs = x) for ids (B, S), the gathered columns within ``block_bytes``."""
        if self.offsets is None:
            parts = [(self.values, inputs.values, ids)]
        else:  # one sequence at a time, as (1, T_i, ·)
            parts = [(d[None], x[None], ids[i : i + 1]) for i, (d, x) in enumerate(zip(self.sequences(), inputs.sequences()))]
        rows = []
        for delta, x, part_ids in parts:
            chunk = max(1, block_bytes // (delta.shape[0] * delta.shape[1] * delta.element_size()))
            rows.append(torch.cat([rows_at_ids(delta, x, part_ids[:, s : s + chunk]) for s in range(0, ids.shape[1], chunk)], 1))
        return torch.cat(rows)


@dataclass
class _TiedState:
    """The embedding ids of a tied weight, and the rows its first-arriving part left for the cross term."""

    ids: torch.Tensor | None = None
    rows: torch.Tensor | None = None


@dataclass(eq=False)
class _MicroBatch:
    """Accumulates one micro-batch: squared norms, and k combinations into p.grad and the score buffers."""

    owner: SiteOwner
    # (k, B) float64, one row per buffer: keys[j] None = G_R (p.grad), (label, v) = a score buffer. "buffers" and
    # "deferred": row 0 = c^R, then c^S of each label's sequences; "split": c^R and c^S − c^R of each label's
    coefficients: torch.Tensor
    keys: list
    sq_norms: torch.Tensor  # (B,) float64
    groups: torch.Tensor | None = None
    segments: PackedSegments | None = None  # None: one row per sequence
    received: set = field(default_factory=set)  # (site name, parameter id) of every gradient part
    forwards: set = field(default_factory=set)  # sites whose forward built a graph
    tied: dict = field(default_factory=dict)  # parameter id -> _TiedState
    # combination "deferred": (parameter, combine_into) of every gradient part, for `combine`
    pending: list = field(default_factory=list)
    # deferred: the last layer input (its identity, the tensor) and its Gram matrices by chunk, for the next weight
    input_grams: tuple | None = None
    _cast: dict = field(default_factory=dict)
    # (ordered, dtype) -> the norms ||P_i|| of every materialised block (not "buffers"), for `fold_block_norms`
    block_norms: dict = field(default_factory=dict)
    # "split": the sequences each row holds (its nonzero coefficients), which alone its combination reads, and an
    # order of all sequences in which each row's are consecutive, at positions spans[j] = (start, stop)
    members: list | None = None
    order: torch.Tensor | None = None
    spans: list | None = None
    # how many weight-gradient products of one sequence's tokens the combination forms (ghost route's cost)
    combinations_per_sequence: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.set_rows(self.coefficients, self.keys)

    def set_rows(self, coefficients: torch.Tensor, keys: list) -> None:
        self.coefficients, self.keys = coefficients, keys
        self._cast.clear()
        self.members = self.order = self.spans = None
        self.combinations_per_sequence = coefficients.shape[0]
        if self.owner.combination == "split":
            self.members = [row.nonzero().flatten().tolist() for row in coefficients.cpu()]
            order = _consecutive_order(self.members, [label for label, _ in keys], self.batch_size)
            position = {sequence: j for j, sequence in enumerate(order)}
            starts = [min(position[i] for i in m) for m in self.members]
            self.spans = [(start, start + len(m)) for start, m in zip(starts, self.members, strict=True)]
            self.order = torch.tensor(order, device=coefficients.device)
            self.combinations_per_sequence = max(1, *(sum(i in m for m in self.members) for i in range(self.batch_size)))

    @property
    def batch_size(self) -> int:
        return self.coefficients.shape[1]

    def coefficients_as(self, like: torch.Tensor) -> Coefficients:
        """The (k, B) coefficients in like's dtype and device."""
        return _cast_once(self._cast, self.coefficients, like)

    def ordered_coefficients_as(self, like: torch.Tensor) -> Coefficients:
        """`coefficients_as` with the sequences in `order`, each row over its span alone."""
        key = ("ordered", like.dtype, like.device)
        if key not in self._cast:
            self._cast[key] = Coefficients.of(self.coefficients[:, self.order].to(device=like.device, dtype=like.dtype),
                                              self.spans)
        return self._cast[key]

    def input_gram(self, values: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Gram matrices of sequences [start, stop) of a layer input. Deferred, the weights that read one input
        (q, k and v; gate and up) run their backward one after another, so the last input's Grams are kept for
        the next: formed once, and one input's at a time held (its values are kept for `combine` anyway; the
        reference kept here also stops its storage being reused while the Grams are)."""
        if self.owner.combination not in NORMS_IN_BACKWARD:
            return gram(values[start:stop])
        identity = (values.untyped_storage().data_ptr(), values.storage_offset(), tuple(values.shape), values.stride(),
                    values.dtype)
        if self.input_grams is None or self.input_grams[0] != identity:
            self.input_grams = (identity, values, {})
        chunks = self.input_grams[2]
        if (start, stop) not in chunks:
            chunks[start, stop] = gram(values[start:stop])
        return chunks[start, stop]

    def deferred_coefficients(self, per_label: dict) -> _CoefficientRow:
        """c_i = c^R_i − b_γ(i) c^S_i: the single row the deferred parts combine with, once b is known."""
        baselines = torch.tensor([per_label[label] for label, _ in self.keys[1:]], dtype=torch.float64)
        combined = self.coefficients[0] - baselines.to(self.coefficients.device) @ self.coefficients[1:]
        return _CoefficientRow(combined.unsqueeze(0))

    def _combination(self, param: torch.Tensor, combine_into, ordered: bool = False, targets: list | None = None) -> None:
        """A gradient part's combination ``combine_into(coefficients_as, targets)``, which adds
        Σ_i coefficients[j, i] P_i to targets[j] (a `Target`): now into the buffers of the rows (combinations
        "buffers", "split"; ``ordered``: P in `order`; ``targets``: those of the part's first block), or kept for
        `combine`, which applies it once with c^R − b c^S into G_R ("deferred"), or dropped (norms only)."""
        if self.owner.combination == NORMS_ONLY:
            return
        if self.owner.combination == "deferred":
            self.pending.append((param, combine_into))
        else:
            combine_into(self.ordered_coefficients_as if ordered else self.coefficients_as, self.targets(param) if targets is None else targets)

    def rows(self, values: torch.Tensor) -> _Rows:
        """A Linear/Conv1D input or output gradient as `_Rows` (views of the packed row, if packed)."""
        if self.segments is None:
            return _Rows(values.reshape(self.batch_size, -1, values.shape[-1]))
        return _Rows(values[0], self.segments.offsets)

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
        return id(param) in self.owner.tied_params

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

    def targets(self, param: torch.Tensor) -> list[Target]:
        """The buffer of each coefficient row: the G_R accumulator (p.grad, or a float32 buffer for a
        low-precision parameter) and the score buffers (G_S^γ; split: G_1^γ, G_0^γ). Once per gradient part:
        a score buffer it makes is new for all of that part's blocks."""
        targets = []
        for key in self.keys:
            buffer, new = (self.owner.reward_buffer(param), False) if key is None else self.owner.score_buffer(key, param)
            targets.append(Target(buffer.view(1, -1), new))
        return targets

    def _add_sq_norms(self, values: torch.Tensor, ordered: bool = False) -> None:
        """sq_norms += values, one per sequence (``ordered``: the sequences in `order`)."""
        values = values.to(device=self.sq_norms.device, dtype=torch.float64)
        if ordered:
            self.sq_norms.index_add_(0, self.order.to(self.sq_norms.device), values)
        else:
            self.sq_norms += values

    def _add_per_sample_sq_norms(self, per_sample: torch.Tensor, ordered: bool = False) -> torch.Tensor:
        """sq_norms += ||per_sample_i||² of per-sequence gradients (B, ...); returns them widened, as (B, n).

        "buffers" keeps the archived runs' arithmetic (vecdot, added block by block); the others take the norm
        kernel (one vectorised pass; vecdot multiplies into a temporary first) and keep each block's norms for
        `fold_block_norms`, which squares and adds all of them at once: one kernel per block, not four."""
        per_sample = widened(per_sample.reshape(per_sample.shape[0], -1))
        if self.owner.combination == "buffers":
            self._add_sq_norms(torch.linalg.vecdot(per_sample, per_sample))
        else:
            self.block_norms.setdefault((ordered, per_sample.dtype), []).append(torch.linalg.vector_norm(per_sample, dim=1))
        return per_sample

    def fold_block_norms(self) -> None:
        """sq_norms += the squares of the kept block norms (each squared in its own dtype, summed in float64)."""
        for (ordered, _), norms in self.block_norms.items():
            self._add_sq_norms(torch.stack(norms).square().sum(0, dtype=torch.float64), ordered)
        self.block_norms.clear()

    def _accumulate(self, param: torch.Tensor, per_sample: torch.Tensor, ordered: bool = False,
                    targets: list | None = None) -> None:
        """Norms and the combinations of per-sequence gradients (B, n), n the size of each target (the parameter,
        or the block of it that ``targets`` are views of); ``ordered``: their rows in `order`, each coefficient
        row's sequences consecutive (split), so that each combination reads its own sequences' rows only."""
        per_sample = self._add_per_sample_sq_norms(per_sample, ordered)
        spans = self.spans if ordered else None
        self._combination(
            param, functools.partial(_add_combinations, per_sample=per_sample, spans=spans), ordered, targets,
        )

    def add_dense(self, name: str, param: torch.Tensor, per_sample: torch.Tensor) -> None:
        """Per-sequence gradients of a whole parameter, shape (B, *param.shape)."""
        self._receive(name, param)
        self._accumulate(param, per_sample)

    def add_outer_products(self, name: str, param: torch.Tensor, rows: _Rows, cols: _Rows, shared: _Rows) -> None:
        """Per-sequence gradients P_i = rows_iᵀ cols_i of an (R, C) weight, by the cheaper route; ``shared``
        is whichever side is the layer's input (other weights may read it too).

        Deferred, the combination is one weight-gradient product by either route (`combine` knows the
        single coefficient row), so a materialised block only gives its norms."""
        self._receive(name, param)
        method, deferred = self.owner.norm_method, self.owner.combination in NORMS_IN_BACKWARD
        weighted_products = functools.partial(_add_weighted_products, rows=rows, cols=cols, members=self.members)
        if method == "ghost" or (
            method == "auto"
            and prefers_ghost(
                rows.lengths, rows.width, cols.width, self.combinations_per_sequence, self.owner.pass_cost(param),
                deferred,
            )
        ):
            def grams(values: torch.Tensor, start: int, stop: int) -> torch.Tensor:
                return self.input_gram(values, start, stop) if values is shared.values else gram(values[start:stop])

            self._add_sq_norms(rows.ghost_sq_norms(cols, self.owner.block_bytes(param), grams))
            self._combination(param, weighted_products)
            return
        # Blocks of weight rows small enough to stay in cache between the matmul and the reductions, which
        # read each block widened (bf16 / fp16 activations to fp32, whatever the parameter's dtype).
        num_rows, num_cols = rows.width, cols.width
        block_rows = rows_per_block(num_rows, rows.batch_size, num_cols, wide_dtype(rows.dtype).itemsize,
                                    self.owner.block_bytes(param), self.owner.block_row_multiple(param))
        # split, packed: each block's sequences in `order`, free (one matmul per sequence view either way); one row
        # per sequence, a reordered copy of the inputs cost more than the combinations read less (measured)
        ordered = self.order is not None and rows.offsets is not None
        targets = None if deferred or self.owner.combination == NORMS_ONLY else self.targets(param)
        # each target split into its blocks once (a view per block, not a slice per block and target)
        target_blocks = [] if targets is None else [
            (target.values,) if block_rows >= num_rows else target.values.split(block_rows * num_cols, 1)
            for target in targets
        ]
        for index, block in enumerate(rows.outer_blocks(cols, block_rows, self.order if ordered else None)):
            if deferred:
                self._add_per_sample_sq_norms(block)
            else:
                block_targets = None if targets is None else [
                    Target(blocks[index], target.new) for blocks, target in zip(target_blocks, targets, strict=True)
                ]
                self._accumulate(param, block, ordered=ordered, targets=block_targets)
        if deferred:
            self._combination(param, weighted_products)

    def add_sparse_rows(self, name: str, param: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Per-sequence embedding gradients: rows (B, T, d) scattered at ids (B, T)."""
        self._receive(name, param)
        self._add_sq_norms(sparse_rows_sq_norms(ids, rows, param.shape[0]))
        rows = widened(rows)

        def combine_into(coefficients_as, targets):
            coefficients, flat_ids = coefficients_as(rows).matrix, ids.flatten()
            for row, (target, new) in enumerate(targets):
                if new:  # a scatter adds to what is there
                    target.zero_()
                weighted_rows = (coefficients[row].view(-1, 1, 1) * rows).reshape(-1, rows.shape[-1])
                target.view(param.shape).index_add_(0, flat_ids, weighted_rows.to(target.dtype))

        self._combination(param, combine_into)

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
        self._add_sq_norms(2.0 * torch.einsum("btd,btd->b", widened(state.rows), widened(rows)))
        state.rows = None

    def check_complete(self) -> None:
        received = {name for name, _ in self.received}
        missing = sorted(self.forwards - received)
        if missing:
            raise RuntimeError(
                f"modules {missing[:3]} ran a forward inside `micro_batch` but their backward did not run inside "
                "it; call backward() inside the `with per_sequence.micro_batch(...)` block of its PerSequenceGradients"
            )


def _consecutive_order(members: list, labels: list, batch_size: int) -> list[int]:
    """An order of the sequences 0..B−1 in which the members of each row are consecutive. Rows of one label (a
    success and a failure row, either may be absent) share sequences only with each other: that label's success-
    only sequences, then those in both rows, then the failure-only ones. Sequences in no row come last."""
    order, placed = [], set()
    for label in dict.fromkeys(labels):
        rows = [set(m) for m, row_label in zip(members, labels) if row_label == label]
        first, second = rows if len(rows) == 2 else (rows[0], set())
        for part in (first - second, first & second, second - first):
            order += sorted(part)
        placed |= first | second
    return order + [i for i in range(batch_size) if i not in placed]


class Coefficients(NamedTuple):
    """A micro-batch's (k, B) coefficients in one dtype and device, and each row as a (1, ·) view of the sequences
    its combination reads (its span of `order`, or all): sliced once per micro-batch, not once per block of every
    weight (on a GPU each slice is a dispatch of the launch-bound step)."""

    matrix: torch.Tensor
    rows: list[torch.Tensor]

    @classmethod
    def of(cls, matrix: torch.Tensor, spans: list | None = None) -> Coefficients:
        if spans is None:  # not matrix.split(1), which gives a (0, B) matrix one empty row
            return cls(matrix, [matrix[j : j + 1] for j in range(matrix.shape[0])])
        return cls(matrix, [matrix[j : j + 1, start:stop] for j, (start, stop) in enumerate(spans)])


def _cast_once(cache: dict, coefficients: torch.Tensor, like: torch.Tensor) -> Coefficients:
    key = (like.dtype, like.device)
    if key not in cache:
        cache[key] = Coefficients.of(coefficients.to(device=like.device, dtype=like.dtype))
    return cache[key]


class Target(NamedTuple):
    """One coefficient row's buffer as one row (1, numel), and whether it is new: made uninitialised for this gradient
    part, which assigns each element once instead of adding to zeros (one kernel where a fill and an addition took
    two)."""

    values: torch.Tensor
    new: bool


@dataclass
class _CoefficientRow:
    """The combined coefficients (1, B) of a deferred micro-batch, cast once per dtype and device."""

    row: torch.Tensor
    _cast: dict = field(default_factory=dict)

    def __call__(self, like: torch.Tensor) -> torch.Tensor:
        return _cast_once(self._cast, self.row, like)


def _add_combinations(coefficients_as, targets: list[Target], per_sample: torch.Tensor, spans: list | None = None) -> None:
    """targets[j] += Σ_i coefficients[j, i] per_sample[i], for per_sample (B, n) and targets (1, n); with ``spans``,
    row j's sequences are per_sample[start:stop] alone (the others' coefficients are 0, unread)."""
    batch = per_sample.shape[0]
    for row, (coefficient_row, (target, new)) in enumerate(zip(coefficients_as(per_sample).rows, targets, strict=True)):
        start, stop = (0, batch) if spans is None else spans[row]
        samples = per_sample if (start, stop) == (0, batch) else per_sample[start:stop]
        add_product(target, coefficient_row, samples, assign=new)


def _add_weighted_products(coefficients_as, targets: list[torch.Tensor], rows: _Rows, cols: _Rows,
                           members: list | None = None) -> None:
    """targets[j] += Σ_i coefficients[j, i] rows_iᵀ cols_i, one weight-gradient matmul per target, the
    narrower side scaled by the coefficients; with ``members``, over the tokens of members[j] only."""
    # Coefficients scale in float32 (or wider), then the product runs in the rows' dtype, as
    # autograd's weight gradient of the same micro-batch would.
    coefficients = coefficients_as(rows.values.new_empty(0, dtype=wide_dtype(rows.dtype))).matrix
    for row, (target, new) in enumerate(targets):
        row_rows, row_cols, row_coefficients = rows, cols, coefficients[row]
        if members is not None and len(members[row]) < rows.batch_size:
            row_rows, row_cols = rows.select(members[row]), cols.select(members[row])
            row_coefficients = row_coefficients[members[row]]
        if cols.width < rows.width:
            add_product(target.view(rows.width, -1), row_rows.tokens().t(), row_cols.weighted_tokens(row_coefficients),
                        assign=new)
        else:
            add_product(target.view(rows.width, -1), row_rows.weighted_tokens(row_coefficients).t(), row_cols.tokens(),
                        assign=new)


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
