"""`PerSequenceGradients`: exact per-sequence gradient norms and the single-backward OPOB update (VCPO §3.4, Alg. 1,
App. C).

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

    per_sequence = PerSequenceGradients(model)
    for mb in micro_batches:
        with per_sequence.micro_batch(mb.coef_r, mb.coef_s):
            per_sequence_scores(model(mb.input_ids, attention_mask=mb.mask), mb).sum().backward()
    per_sequence.combine(opob_baseline(rewards, per_sequence.sq_norms, seq_log_weights))
    with scaled_learning_rate(optimizer, ess_step_scale(ess_ratio(seq_log_weights))):
        optimizer.step()

Scope "group" with group-aligned micro-batches (whole groups in one micro-batch): pass
``groups=`` to `micro_batch` and call `combine` after each micro-batch with that micro-batch's
baseline; the groups' score buffers are freed at once.

Combination "deferred" (``PerSequenceGradients(model, combination="deferred")``): the backward forms only the
norms and keeps each part's input and output gradient (Linear, Conv1D) or per-sequence gradients (the rest);
`combine`, knowing b, forms Ĝ = Σ_i (c^R_i − b_γ(i) c^S_i) g_i with one weight-gradient product per parameter and
no score buffers. Cheaper where there are many groups (k − 1 fewer combinations of every per-sequence gradient, and
then the ghost norms win for short sequences); it holds the kept tensors of every micro-batch until `combine`.

Packed ("remove padding") micro-batches: ``micro_batch(..., cu_seqlens=offsets)`` with B sequences
concatenated along the token dimension of ONE row (every module input (1, tokens, ...), sequence i =
tokens [c_i, c_{i+1}), attention block-diagonal). Every handler reduces per segment. Linear/Conv1D
run one matmul per sequence on its view of the packed tokens (`_Rows`): no copy, no padded
multiply-adds (gathering length buckets into padded rows, the earlier route, cost a tenth of the
OPOB step in copies on CPU); the ghost Gram matrices are the diagonal blocks of the block-diagonal
Gram product, one sequence at a time. Embeddings and norm affines (hidden-width tensors) use the (B, max_len, ·) zero-padded layout of
`PackedSegments.pad`. Zero rows add nothing, so the result is exact and equals the one-row-per-sequence
result. Tokens after c_B (trailing padding) belong to no sequence: they are left out of the norms,
p.grad and the score buffers (their gradient is zero for any loss that ignores them).

Mixed precision. Under ``torch.autocast`` (bf16 or fp16) a Linear's matmuls run in the autocast dtype,
as autocast would run them, and so do the per-sequence weight gradients; with bf16 (or fp16)
parameters (FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)``) everything runs in their dtype.
Either way the per-sequence gradients are widened to float32 before they are squared (the norms),
scaled by the coefficients and summed over sequences; the score buffers are float32, and so is G_R
for a low-precision parameter (a buffer `combine` adds to p.grad, so G_R − b G_S is formed in
float32); p.grad keeps the parameter's dtype. The error against float64 is that of plain autograd
under the same precision (tests/test_per_sequence_grads_mixed_precision.py measures both).

Memory beyond a plain backward: for bf16 / fp16 parameters a float32 G_R buffer (2x their size); one
(float32 for those) score buffer per open group label (one for scope "batch", one
per group of the micro-batch for scope "group"), plus one block of per-sequence gradients
(``block_bytes``) or the ghost Gram matrices (2·B·T² values, chunked to ``block_bytes``; packed: 2·T_i²
for one sequence at a time). Deferred: no score buffers, but every open micro-batch's layer inputs and output
gradients until `combine`, and the Gram matrices of one layer input (shared by the weights that read it).

Limits: the handlers cannot see the attention, and sequences must not interact through it (rows of a
padded batch; the block-diagonal mask of a packed row, which HF transformers 5 builds from position_ids
restarting at 0 only with attention_mask=None and use_cache=False). Under data parallelism (paper App. C) defer the gradient all-reduce:
gather the B norms across ranks for the baseline, `combine` locally, then all-reduce p.grad once.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn

from vcpo.core.per_sequence_grads.functions import (
    HF_RMS_NORM_CLASSES,
    _check_module_options,
    module_kind,
)
from vcpo.core.per_sequence_grads.reductions import (
    COMBINATIONS,
    DEFAULT_BLOCK_BYTES,
    DEFAULT_BLOCK_ROW_MULTIPLE,
    DEFAULT_PASS_COST,
    LOW_PRECISION,
    NORM_METHODS,
    NORMS_ONLY,
    PackedSegments,
    check_cu_seqlens,
    device_default,
    wide_dtype,
)
from vcpo.core.per_sequence_grads.sites import Target, _check_same_forward, _MicroBatch, _Site
from vcpo.core.validation import check_float, check_sequence_inputs
from vcpo.upstream import require

require("per_sequence_gradients")


class PerSequenceGradients:
    """Per-sequence squared gradient norms and the two-buffer OPOB update from one backward pass.

    Args:
        model: any torch module built from supported module kinds (module docstring); every
            trainable parameter must belong to one. Modules without trainable parameters are untouched.
        norm_method: "auto" picks ghost norms or materialised per-sequence gradients per call from the cost
            model `prefers_ghost`; "materialize" / "ghost" force one route (both exact).
        block_bytes: size of one block of materialised per-sequence gradients; default per device
            type (``DEFAULT_BLOCK_BYTES``).
        pass_cost: the machine balance of `prefers_ghost`; default per device type (``DEFAULT_PASS_COST``).
        block_row_multiple: rows per block are a multiple of this (aligned GEMM operands on a GPU); default
            per device type (``DEFAULT_BLOCK_ROW_MULTIPLE``).
        combination: "buffers" accumulates G_R and one score buffer G_S^γ per open group during the
            backward (k = 1 + #groups combinations of every per-sequence gradient; memory: the buffers,
            any number of micro-batches). "deferred" keeps every part's inputs and output gradients
            until `combine`, which knows b and forms Ĝ = Σ_i (c^R_i − b_γ(i) c^S_i) g_i with ONE
            weight-gradient product per parameter, as a plain backward would (memory: every open
            micro-batch's layer inputs and output gradients; for one micro-batch per combine, or few).
            "split" accumulates during the backward, as "buffers" does, into the success buffer
            G_1^γ = Σ c^R_i g_i and the failure buffer G_0^γ = Σ (c^S_i − c^R_i) g_i of each group, so
            that Ĝ = Σ_γ (1 − b_γ) G_1^γ − b_γ G_0^γ; a sequence whose c^R_i is 0 or c^S_i (binary rewards,
            c^R_i = R_i c^S_i) is combined into one buffer only, once, and only the sequences a buffer
            holds are read for it (memory: two float32 buffers per open group). The three differ in
            floating-point order only; "buffers" keeps the arithmetic of the archived simulator runs.
            "norms" (``NORMS_ONLY``) forms the squared norms and nothing else: no p.grad, no buffer, nothing kept
            after each micro-batch (memory: one block of per-sequence gradients or one input's Gram matrices);
            read `sq_norms`, then `discard`. The first pass of a two-pass OPOB step, whose second pass is a plain
            backward of Σ_i (c^R_i − b_γ(i) c^S_i) l_i (exact: the coefficients do not change within the step).

    Raises ValueError naming the module and parameter if a trainable parameter is not handled.
    """

    def __init__(
        self, model: nn.Module, norm_method: str = "auto", block_bytes: int | None = None, pass_cost: float | None = None,
        combination: str = "buffers", block_row_multiple: int | None = None,
    ):
        if norm_method not in NORM_METHODS:
            raise ValueError(f"norm_method must be one of {NORM_METHODS}, got {norm_method!r}")
        if combination not in (*COMBINATIONS, NORMS_ONLY):
            raise ValueError(f"combination must be one of {(*COMBINATIONS, NORMS_ONLY)}, got {combination!r}")
        if block_bytes is not None and not block_bytes > 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        if block_row_multiple is not None and not block_row_multiple > 0:
            raise ValueError(f"block_row_multiple must be positive, got {block_row_multiple}")
        if pass_cost is not None and not (math.isfinite(pass_cost) and pass_cost > 0):
            raise ValueError(f"pass_cost must be a positive finite number, got {pass_cost}")
        self.norm_method = norm_method
        self.combination = combination
        self._block_bytes = block_bytes
        self._pass_cost = pass_cost
        self._block_row_multiple = block_row_multiple
        self.sites, self.tied_params = _collect_sites(self, model)
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._active: _MicroBatch | None = None
        # (label, v) -> {parameter id: (parameter, buffer)}: the buffer of the rows of that label whose sum enters
        # Ĝ with factor v − b_label (v = 0: G_S^γ, or split's G_0^γ; v = 1: split's G_1^γ)
        self._score_buffers: dict = {}
        self._reward_buffers: dict = {}  # parameter id -> (parameter, float32 G_R) of low-precision parameters
        self._open_norms: list[torch.Tensor] = []
        self._open_labels: list = []
        self._open_micro_batches: list[_MicroBatch] = []  # combination "deferred": their pending parts
        self._grouped: bool | None = None

    def block_bytes(self, like: torch.Tensor) -> int:
        return self._block_bytes or device_default(DEFAULT_BLOCK_BYTES, like.device.type)

    def block_row_multiple(self, like: torch.Tensor) -> int:
        return self._block_row_multiple or device_default(DEFAULT_BLOCK_ROW_MULTIPLE, like.device.type)

    def pass_cost(self, like: torch.Tensor) -> float:
        return self._pass_cost or device_default(DEFAULT_PASS_COST, like.device.type)

    def active_micro_batch(self, name: str) -> _MicroBatch:
        if self._active is None:
            raise RuntimeError(f"module {name!r} ran its per-sequence forward or backward outside `micro_batch`")
        return self._active

    def score_buffer(self, key, param: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The buffer of ``key`` for ``param``, and whether this call made it (uninitialised: its first gradient part
        assigns every element; a failed micro-batch discards it)."""
        buffers = self._score_buffers.setdefault(key, {})
        if id(param) in buffers:
            return buffers[id(param)][1], False
        buffers[id(param)] = (param, torch.empty_like(param, dtype=wide_dtype(param.dtype)))
        return buffers[id(param)][1], True

    def reward_buffer(self, param: torch.Tensor) -> torch.Tensor:
        """Where G_R accumulates: p.grad itself, or for a float16 / bfloat16 parameter a float32 buffer
        that `combine` adds to p.grad (so the subtraction G_R − b G_S happens in float32)."""
        if param.dtype in LOW_PRECISION:
            if id(param) not in self._reward_buffers:
                self._reward_buffers[id(param)] = (param, torch.zeros_like(param, dtype=torch.float32))
            return self._reward_buffers[id(param)][1]
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        return param.grad

    def _add_to_reward_buffers(self, buffers, alpha: float) -> None:
        """G_R += alpha · buffer for every (parameter, buffer) of ``buffers``, as two foreach operations over all
        parameters (on a GPU a few kernels, not one per parameter); a G_R not made yet (split: nothing reached it
        during the backward) becomes the buffer itself, scaled: no zeros written and added to."""
        def made(param: torch.Tensor) -> bool:
            return id(param) in self._reward_buffers if param.dtype in LOW_PRECISION else param.grad is not None

        adopted, added = [], []
        for param, buffer in buffers:
            (added if made(param) else adopted).append((param, buffer))
        if adopted:
            torch._foreach_mul_([buffer for _, buffer in adopted], alpha)
            for param, buffer in adopted:
                if param.dtype in LOW_PRECISION:
                    self._reward_buffers[id(param)] = (param, buffer)
                else:
                    param.grad = buffer
        if added:
            torch._foreach_add_([self.reward_buffer(param) for param, _ in added], [buffer for _, buffer in added],
                                alpha=alpha)

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
        sequence i. If the block raises, every open sequence is dropped and p.grad (fp32 parameters) holds a partial
        sum: zero it.

        Args:
            coef_r: c^R_i, shape (B,): coefficients of G_R (accumulated into p.grad; for a bf16 / fp16
                parameter into a float32 buffer that `combine` adds to p.grad).
            coef_s: c^S_i, shape (B,): coefficients of the score buffers G_S.
            groups: baseline group label per sequence (integers), or None for one baseline over all
                sequences up to `combine`. One score buffer per label is kept until `combine`.
            cu_seqlens: packed ("remove padding") micro-batch: integer offsets (B + 1,), 0 = c_0 < ... < c_B,
                of B sequences concatenated along the token dimension of ONE row; every module input is
                then (1, tokens, ...) with tokens >= c_B. Sequence i is tokens [c_i, c_{i+1}). Tokens from
                c_B on are padding that belongs to no sequence: they are left out of every norm and of
                p.grad and the score buffers (their gradient, zero for a loss that ignores them, is
                dropped). The attention must not cross sequences (e.g. HF position_ids restarting at 0
                with attention_mask=None and use_cache=False, or flash-attn varlen): the handlers cannot check it.
        """
        if self._active is not None:
            raise RuntimeError("micro_batch blocks cannot be nested")
        grouped_before = self._grouped
        coefficients, keys, label_of_sequence = self._coefficient_rows(coef_r, coef_s, groups)
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
            owner=self,
            coefficients=coefficients,
            keys=keys,
            sq_norms=torch.zeros(coefficients.shape[1], dtype=torch.float64, device=device),
            groups=groups,
            segments=segments,
        )
        guards = [p.register_hook(_unhandled_gradient_guard) for p in self._params]
        for site in self.sites:
            site.install()
        self._active = micro_batch
        try:
            yield
            micro_batch.check_complete()
            micro_batch.fold_block_norms()
        except BaseException:
            self.discard()
            raise
        finally:
            self._active = None
            micro_batch.input_grams = None
            for site in self.sites:
                site.uninstall()
            for guard in guards:
                guard.remove()
        self._open_norms.append(micro_batch.sq_norms)
        self._open_labels.extend(label_of_sequence)
        if micro_batch.pending:
            self._open_micro_batches.append(micro_batch)

    def set_coefficients(self, coef_r: torch.Tensor, coef_s: torch.Tensor) -> None:
        """Replace c^R and c^S of the open micro-batch after its forward and before its backward.

        Truncated weights such as min(w_i, c) depend on the learner's log-probs, which exist only
        after the forward; setting them here saves a separate no-grad forward.
        """
        active = self.active_micro_batch("set_coefficients")
        if active.received:
            raise RuntimeError("set_coefficients must be called before the micro-batch's backward")
        coefficients, keys, _ = self._coefficient_rows(coef_r, coef_s, active.groups)
        if coefficients.shape[1] != active.batch_size:
            raise ValueError(f"coef_r has {coefficients.shape[1]} sequences, the micro-batch {active.batch_size}")
        active.set_rows(coefficients, keys)

    def _coefficient_rows(self, coef_r, coef_s, groups):
        """(k, B) coefficient matrix, the buffer key of each row (None: G_R, the reward buffer; (label, v): a
        score buffer), and each sequence's label."""
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
        label_of_sequence = groups.tolist() if grouped else [None] * batch
        labels = sorted(set(label_of_sequence)) if grouped else [None]
        in_label = torch.tensor([[sequence_label == label for sequence_label in label_of_sequence] for label in labels],
                                device=coef_s.device)

        def of_label(values: torch.Tensor) -> torch.Tensor:  # (labels, B): each label's sequences' values, +0 elsewhere
            return torch.where(in_label, values, torch.zeros((), dtype=values.dtype, device=values.device))

        if self.combination == NORMS_ONLY:
            return coef_r.new_zeros((0, batch)), [], label_of_sequence
        if self.combination == "split":
            rows = torch.stack([of_label(coef_r), of_label(coef_s - coef_r)], 1).flatten(0, 1)
            keys = [(label, v) for label in labels for v in (1, 0)]
            used = [i for i in range(len(keys)) if bool(rows[i].ne(0).any())]
            return rows[used], [keys[i] for i in used], label_of_sequence
        return torch.cat([coef_r.unsqueeze(0), of_label(coef_s)]), [None] + [(label, 0) for label in labels], label_of_sequence

    def combine(self, baseline: torch.Tensor | float) -> None:
        """p.grad ← G_R − Σ_γ b_γ G_S^γ, then free the score buffers (Algorithm 1, line 15); split:
        p.grad ← Σ_γ (1 − b_γ) G_1^γ − b_γ G_0^γ; deferred: p.grad ← Σ_i (c^R_i − b_γ(i) c^S_i) g_i from the kept
        parts.

        Args:
            baseline: b per sequence since the last combine, shape (n,), constant within each group
                (as `opob_baseline` returns it), or one number for all of them.
        """
        if not self._open_norms:
            raise ValueError("combine() needs at least one micro_batch since the last combine()")
        if self.combination == NORMS_ONLY:
            raise ValueError("combination 'norms' forms no gradient to combine: read sq_norms, then discard()")
        per_label = self._baseline_per_label(baseline)
        with torch.no_grad():  # the kept layer inputs are activations of the graph
            for micro_batch in self._open_micro_batches:
                coefficients_as = micro_batch.deferred_coefficients(per_label)
                for param, combine_into in micro_batch.pending:
                    combine_into(coefficients_as, [Target(self.reward_buffer(param).view(1, -1), False)])
        for (label, v), buffers in self._score_buffers.items():
            self._add_to_reward_buffers(list(buffers.values()), v - per_label[label])
        for param, combined in self._reward_buffers.values():
            param.grad = combined.to(param.dtype) if param.grad is None else param.grad.add_(combined)
        self.discard()

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

    def discard(self) -> None:
        """Drop every open sequence, buffer and kept part (after a failed step, or after a norms-only pass)."""
        self._score_buffers = {}
        self._reward_buffers = {}
        self._open_norms = []
        self._open_labels = []
        self._open_micro_batches = []
        self._grouped = None


def _unhandled_gradient_guard(grad: torch.Tensor | None) -> None:
    # The per-sequence functions return no parameter gradient; a real one came from elsewhere.
    if grad is not None:
        raise RuntimeError(
            "a trainable parameter received a gradient through an operation outside the per-sequence "
            "handlers (e.g. a functional use of a module's weight); its per-sequence norm would be wrong"
        )


def _collect_sites(owner: PerSequenceGradients, model: nn.Module) -> tuple[list[_Site], set[int]]:
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
        site = _Site(owner, name, module, kind)
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


__all__ = ["PerSequenceGradients"]
