"""Exact per-sequence squared gradient norms of a megatron-core model under tensor parallelism, from one backward.

megatron-core's layers compute their own weight gradients (its custom autograd functions, gradient
buffers, TP collectives), so instead of replacing their forward as `PerSequenceGradients` does for
transformers modules, `MegatronSequenceNorms` watches them: a forward hook keeps each layer's input and
puts a hook on its output, whose gradient δ arrives during the backward of Σ_i l_i. From (input, δ) it forms
the per-sequence gradient of the layer's LOCAL parameters (the rank's shard) and reduces it at once to a
squared norm per sequence, as the transformers handlers do (``reductions``):

  ColumnParallelLinear   W shard (out/TP, in), input full: P_i = Σ_t δ_{i,t} ⊗ x_{i,t} (ghost norm); its bias is a shard.
  RowParallelLinear      W shard (out, in/TP), input the rank's slice, δ full; its bias is replicated.
  VocabParallelEmbedding W shard (rows [start, end) of the vocabulary): the δ rows of the ids inside it.
  Embedding              (learned positions) replicated.
  RMSNorm, LayerNorm     Σ_t δ_{i,t} ⊙ x̂_{i,t} (weight), Σ_t δ_{i,t} (bias): replicated.
  tied embeddings        the output layer uses the embedding's weight (``share_embeddings_and_output_weights``):
                         sequence i's gradient of that shard is E_i + H_i, so its squared norm adds the cross
                         term 2 Σ_t <H_i[id_t], δ^E_{i,t}>, from the rows of H_i at the shard's ids (the output
                         layer's gradient arrives first in the backward, the embedding's last).

Reduction rule (tested against one backward per sequence at TP 2): a parameter marked
``tensor_model_parallel`` is sharded, so its per-sequence squared norms sum over the tensor-parallel group;
every other parameter is replicated, identical on every rank, and counts once. Activations are
sequence-first, (tokens, sequences, width), as megatron lays them out; the embedding sees (sequences, tokens).

Sequence parallelism (``config.sequence_parallel``): activations between the tensor-parallel regions are
split along the tokens. A column-parallel linear's input and a row-parallel linear's (and the reduce-scattering
embedding's) output gradient are gathered along the tokens (one all-gather each, as the layers themselves
do); a norm sees only its rank's tokens, so its per-sequence gradient vectors are summed over the group before
they are squared (the layer's own gradient is all-reduced for the same reason).

Pipeline parallelism: each stage holds its own layers, so the stages' per-sequence squared norms add up
(one all-reduce over ``pp_group``); each stage's `combine` writes its own parameters' update. Embeddings tied
across stages: the first stage holds the embedding E, the last a copy for the output layer H, and megatron
sums their gradients over the embedding group after the backward; sequence i's squared norm of the tied weight
is ||E_i||² + ||H_i||² + 2 Σ_t <H_i[id_t], δ^E_{i,t}>. Each stage counts its own part; for the cross term the
last stage forms H_i's rows at the ids (``recording(ids=...)``: the last stage has no embedding to see them)
and sends them to the first over the embedding group (one broadcast, in `sq_norms`). `combine` writes each
copy its own part, which megatron's embedding-group sum then completes.

In bf16 (verl's Megatron engine trains in bf16) the norms and the update are as close to the float64 truth as
plain autograd's own bf16 gradients are (tests/test_megatron_per_sequence.py).

Not handled here, and refused rather than mis-counted: any trainable module of another kind. Layers are matched by
class name, so ``vcpo.core`` imports nothing from megatron.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from vcpo.core.per_sequence_grads.reductions import ghost_sq_norms, rows_at_ids, sparse_rows_sq_norms

LINEARS = ("ColumnParallelLinear", "RowParallelLinear")
NORMS = ("RMSNorm", "LayerNorm")
KINDS = (*LINEARS, "VocabParallelEmbedding", "Embedding", *NORMS)


def is_sharded(param: torch.Tensor) -> bool:
    """megatron-core marks the parameters it splits over the tensor-parallel group."""
    return bool(getattr(param, "tensor_model_parallel", False))


def normalized(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """x̂ of a norm's input: the module's own normalisation (torch's, which megatron's local norms are), without its affine."""
    if type(module).__name__ == "LayerNorm":
        return F.layer_norm(x, module.normalized_shape, None, None, module.eps)
    return F.rms_norm(x, module.normalized_shape, None, module.eps)


def shard_rows(ids: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Vocabulary ids as rows of the shard holding rows [start, end) (0 outside it), and which fall inside it."""
    inside = (ids >= start) & (ids < end)
    return torch.where(inside, ids - start, torch.zeros_like(ids)), inside


def local_ids(module: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An embedding's ids as rows of its shard (`shard_rows`)."""
    return shard_rows(ids, getattr(module, "vocab_start_index", 0), getattr(module, "vocab_end_index", module.weight.shape[0]))


class MegatronSequenceNorms:
    """||g_i||² of every sequence of a micro-batch over ALL of a megatron-core model's trainable
    parameters (every TP shard), from the one backward of Σ_i l_i, and, given coefficients, the OPOB
    update Σ_i (c^R_i − b c^S_i) g_i of every local parameter (``docs/ALGORITHMS.md`` §4).

    Usage, on every tensor-parallel rank::

        norms = MegatronSequenceNorms(model, tp_group)
        with norms.recording(batch_size, coef_r, coef_s):
            per_sequence_scores(model(...)).sum().backward()
        sq_norms = norms.sq_norms()          # (B,) float64, the same on every rank
        norms.combine(opob_baseline(rewards, sq_norms, seq_log_weights))   # p.grad of every local parameter

    Raises ValueError at construction for a trainable module or a setting it does not handle.
    """

    def __init__(self, model: nn.Module, tp_group: dist.ProcessGroup | None = None, pp_group: dist.ProcessGroup | None = None,
                 embedding_group: dist.ProcessGroup | None = None):
        self.model, self.tp_group, self.pp_group, self.embedding_group = model, tp_group, pp_group, embedding_group
        self.sequence_parallel = bool(getattr(getattr(model, "config", None), "sequence_parallel", False))
        self.first_stage, self.last_stage = getattr(model, "pre_process", True) is not False, getattr(model, "post_process", True) is not False
        tied = getattr(model, "share_embeddings_and_output_weights", False)
        self.tied_across_stages = tied and not (self.first_stage and self.last_stage)  # its other half on another stage
        if self.tied_across_stages and embedding_group is None:
            raise ValueError("MegatronSequenceNorms: embeddings tied across pipeline stages need the embedding group "
                             "(megatron's parallel_state.get_embedding_group()) for their cross term")
        self.tied = model.shared_embedding_or_output_weight() if tied else None  # this stage's copy of the tied weight
        self.modules = []
        for name, module in model.named_modules():
            trainable = [pname for pname, p in module.named_parameters(recurse=False) if p.requires_grad]
            if not trainable:
                continue
            kind = type(module).__name__
            if kind not in KINDS:
                raise ValueError(f"MegatronSequenceNorms: module {name!r} ({kind}) has trainable parameter {trainable[0]!r} and no handler; supported: {KINDS}")
            self.modules.append(module)
        for name, module in model.named_modules():  # the output layer of tied embeddings owns no parameter
            if type(module).__name__ in LINEARS and getattr(module, "weight", None) is None:
                if self.tied is None:
                    raise ValueError(f"MegatronSequenceNorms: {name!r} has no weight of its own and the model ties none")
                self.modules.append(module)
        self._sharded: torch.Tensor | None = None
        self._replicated: torch.Tensor | None = None
        self._coefficients: torch.Tensor | None = None  # (1 + G, B): c^R, then c^S of each group's sequences
        self._group_of_sequence: torch.Tensor | None = None  # (B,) row index - 1 of each sequence's group
        self._buffers: dict[int, torch.Tensor] = {}  # parameter id -> (1 + G, *shape): G_R, then every G_S^γ

    @contextlib.contextmanager
    def recording(
        self,
        batch_size: int,
        coef_r: torch.Tensor | None = None,
        coef_s: torch.Tensor | None = None,
        groups: torch.Tensor | None = None,
        ids: torch.Tensor | None = None,
    ) -> Iterator[None]:
        """Run the forward AND the backward of one micro-batch of ``batch_size`` sequences inside this block;
        with ``coef_r`` and ``coef_s`` (B,) also accumulate G_R = Σ c^R_i g_i and G_S^γ = Σ_{i in γ} c^S_i g_i,
        one per baseline group (``groups``: a label per sequence; None: one group), for `combine`. ``ids``
        (B, T): the input ids, which the last stage of embeddings tied across stages needs (and only it)."""
        if self.tied_across_stages and self.last_stage and not self.first_stage and ids is None:
            raise ValueError("recording: the last stage of embeddings tied across pipeline stages needs the input ids")
        self._sharded = torch.zeros(batch_size, dtype=torch.float64)
        self._replicated = torch.zeros(batch_size, dtype=torch.float64)
        self._buffers = {}
        self._coefficients = None
        if coef_r is not None:
            labels = torch.zeros(batch_size, dtype=torch.long) if groups is None else torch.unique(groups, return_inverse=True)[1]
            score_rows = torch.zeros(int(labels.max()) + 1, batch_size, dtype=torch.float64)
            score_rows[labels, torch.arange(batch_size)] = coef_s.detach().to(torch.float64)
            self._coefficients = torch.cat([coef_r.detach().to(torch.float64).unsqueeze(0), score_rows])
            self._group_of_sequence = labels
        self._tied_ids = self._head_rows = None  # the embedding's local ids; H_i's rows at them
        self._embedding_rows = None  # δ^E of the tied embedding (first stage), for the cross term across stages
        self._cross_added = False
        if ids is not None and self.tied_across_stages and not self.first_stage:
            self._tied_ids = self._output_shard_ids(ids)
        handles = [module.register_forward_hook(self._forward_hook) for module in self.modules]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def sq_norms(self) -> torch.Tensor:
        """The per-sequence squared norms of the last `recording` block, reduced over the TP group and
        summed over the pipeline stages (``pp_group``)."""
        if self._sharded is None:
            raise ValueError("sq_norms() needs a recording() block first")
        if self.tied_across_stages and not self._cross_added:
            self._add_cross_term_across_stages()
        sharded = self._sharded.clone()
        if dist.is_initialized():
            dist.all_reduce(sharded, group=self.tp_group)
        total = sharded + self._replicated
        if self.pp_group is not None:
            dist.all_reduce(total, group=self.pp_group)
        return total

    def combine(self, baseline: torch.Tensor | float) -> None:
        """p.grad ← G_R − Σ_γ b_γ G_S^γ for every local trainable parameter, ``baseline`` per sequence
        (constant within each group, as `opob_baseline` returns it) or one number (a parameter no sequence
        reached gets zeros). Replaces the layers' own gradient of Σ_i l_i."""
        if self._coefficients is None:
            raise ValueError("combine() needs a recording() block given coef_r and coef_s")
        per_sequence = torch.as_tensor(baseline, dtype=torch.float64).expand(self._group_of_sequence.shape[0])
        per_group = torch.zeros(self._coefficients.shape[0] - 1, dtype=torch.float64)
        per_group[self._group_of_sequence] = per_sequence
        if not torch.allclose(per_group[self._group_of_sequence], per_sequence, rtol=1e-6, atol=1e-12):
            raise ValueError("combine: the baseline must be constant within each group")
        weights = torch.cat([torch.ones(1, dtype=torch.float64), -per_group])  # 1 · G_R − Σ_γ b_γ G_S^γ
        for param in self.model.parameters():
            if param.requires_grad:
                buffer = self._buffers.get(id(param))
                combined = torch.zeros_like(param, dtype=torch.float64) if buffer is None else torch.tensordot(weights, buffer, 1)
                param.grad = combined.to(param.dtype)

    def _output_shard_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """The ids as rows of this rank's shard of the output layer (0 outside it; the first stage's δ^E
        rows there are zero, so they add nothing to the cross term)."""
        rows = self.tied.shape[0]
        start = rows * (dist.get_rank(self.tp_group) if dist.is_initialized() and self.tp_group is not None else 0)
        return shard_rows(ids, start, start + rows)[0]

    def _add_cross_term_across_stages(self) -> None:
        """2 Σ_t <H_i[id_t], δ^E_{i,t}>: the last stage's rows of H_i, sent to the first stage, which adds it."""
        self._cross_added = True
        if not (self.first_stage or self.last_stage):
            return
        last = dist.get_process_group_ranks(self.embedding_group)[-1]
        if self.last_stage:
            dist.broadcast(self._head_rows.contiguous(), src=last, group=self.embedding_group)
        else:
            head_rows = torch.empty(self._embedding_rows.shape, dtype=torch.float64)  # contiguous, as it is sent
            dist.broadcast(head_rows, src=last, group=self.embedding_group)
            self._add(self.tied, 2.0 * torch.einsum("btd,btd->b", head_rows, self._embedding_rows))

    def _combine(self, param: torch.Tensor, gradients: torch.Tensor) -> None:
        """G_R and every G_S^γ += ``gradients`` (1 + G, *param.shape), the coefficient combinations of this part."""
        if id(param) not in self._buffers:
            self._buffers[id(param)] = torch.zeros((self._coefficients.shape[0], *param.shape), dtype=torch.float64)
        self._buffers[id(param)].add_(gradients)

    def _add_dense(self, param: torch.Tensor, per_sequence: torch.Tensor) -> None:
        """Per-sequence gradients (B, *param.shape) of a whole parameter: squared norms and combinations."""
        flat = per_sequence.reshape(per_sequence.shape[0], -1)
        self._add(param, (flat * flat).sum(1))
        if self._coefficients is not None:
            self._combine(param, (self._coefficients @ flat).view(-1, *param.shape))

    def _gather_tokens(self, values: torch.Tensor) -> torch.Tensor:
        """A sequence-parallel activation (tokens/TP, ...) -> (tokens, ...), the ranks' slices in rank order."""
        parts = [torch.empty_like(values) for _ in range(dist.get_world_size(self.tp_group))]
        dist.all_gather(parts, values.contiguous(), group=self.tp_group)
        return torch.cat(parts)

    def _add_summed_over_tokens(self, param: torch.Tensor, per_sequence: torch.Tensor) -> None:
        """Per-sequence gradients (B, n) of a replicated parameter from this rank's tokens: under sequence
        parallelism the ranks hold different tokens, so the vectors are summed over the group first."""
        if self.sequence_parallel:  # in place: the caller's vectors are fresh
            dist.all_reduce(per_sequence, group=self.tp_group)
        self._add_dense(param, per_sequence)

    def _add(self, param: torch.Tensor, values: torch.Tensor) -> None:
        target = self._sharded if is_sharded(param) else self._replicated
        target += values.detach().to(device=target.device, dtype=torch.float64)

    def _forward_hook(self, module: nn.Module, args: tuple, output) -> None:
        if not torch.is_grad_enabled():
            return
        kind = type(module).__name__
        inputs = args[0].detach()
        out = output[0] if isinstance(output, tuple) else output
        if kind in LINEARS:
            handler = self._linear_gradient
            if getattr(module, "sequence_parallel", False) and kind == "ColumnParallelLinear":
                inputs = self._gather_tokens(inputs)
        elif kind in ("VocabParallelEmbedding", "Embedding"):
            handler = self._embedding_gradient
            inputs = local_ids(module, inputs)
            if module.weight is self.tied:
                self._tied_ids = inputs[0]
        else:
            handler = self._norm_gradient
            inputs = normalized(inputs, module)
        out.register_hook(lambda grad: handler(module, inputs, grad.detach()))

    def _linear_gradient(self, module: nn.Module, x: torch.Tensor, delta: torch.Tensor) -> None:
        if getattr(module, "sequence_parallel", False) and type(module).__name__ == "RowParallelLinear":
            delta = self._gather_tokens(delta)
        rows, cols = delta.transpose(0, 1).to(torch.float64), x.transpose(0, 1).to(torch.float64)  # (sequences, tokens, width)
        weight = module.weight if module.weight is not None else self.tied
        if weight.requires_grad:
            self._add(weight, ghost_sq_norms(rows, cols))
            if self._coefficients is not None:  # Σ_i c_i δ_iᵀ x_i: one matmul per combination
                flat_cols = cols.reshape(-1, cols.shape[-1])
                self._combine(weight, torch.stack([
                    (coefficients.view(-1, 1, 1) * rows).reshape(-1, rows.shape[-1]).t() @ flat_cols for coefficients in self._coefficients
                ]))
            if weight is self.tied and self._tied_ids is not None:
                self._head_rows = rows_at_ids(rows, cols, self._tied_ids)
        bias = getattr(module, "bias", None)
        if bias is not None and bias.requires_grad:
            self._add_dense(bias, rows.sum(1))  # full tokens here: the output gradient is gathered

    def _embedding_gradient(self, module: nn.Module, ids: tuple[torch.Tensor, torch.Tensor], delta: torch.Tensor) -> None:
        if getattr(module, "reduce_scatter_embeddings", False):  # its output is (tokens/TP, sequences, width)
            delta = self._gather_tokens(delta).transpose(0, 1)
        local, inside = ids  # `local_ids`
        rows = (delta * inside.unsqueeze(-1).to(delta.dtype)).to(torch.float64)
        self._add(module.weight, sparse_rows_sq_norms(local, rows, module.weight.shape[0]))
        if self._coefficients is not None:  # the weighted rows scattered at the ids
            combined = torch.zeros((self._coefficients.shape[0], *module.weight.shape), dtype=torch.float64)
            for row, coefficients in enumerate(self._coefficients):
                combined[row].index_add_(0, local.flatten(), (coefficients.view(-1, 1, 1) * rows).reshape(-1, rows.shape[-1]))
            self._combine(module.weight, combined)
        if module.weight is self.tied and self.tied_across_stages:
            self._embedding_rows = rows
        elif module.weight is self.tied and self._head_rows is not None:
            self._add(module.weight, 2.0 * torch.einsum("btd,btd->b", self._head_rows, rows))

    def _norm_gradient(self, module: nn.Module, x_hat: torch.Tensor, delta: torch.Tensor) -> None:
        delta64 = delta.to(torch.float64)
        self._add_summed_over_tokens(module.weight, (delta64 * x_hat.to(torch.float64)).sum(0))  # (sequences, width)
        bias = getattr(module, "bias", None)
        if bias is not None and bias.requires_grad:
            self._add_summed_over_tokens(bias, delta64.sum(0))


__all__ = ["KINDS", "MegatronSequenceNorms", "is_sharded"]
