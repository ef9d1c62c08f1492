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
  QK layer norm          (``qk_layernorm``, Qwen3) a norm over each head's width, applied to every query (key) head: its
                         weight's gradient sums over the heads too; each rank holds its own heads (TP splits them), so the
                         per-sequence vectors are summed over the tensor-parallel group before they are squared, as
                         megatron's ``finalize_model_grads`` sums their gradient.
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
they are squared (the layer's own gradient is all-reduced for the same reason). `partial_over_tensor_parallel`
is megatron's own rule for which parameters these are.

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
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from vcpo.core.collectives import all_reduce_here, broadcast_here
from vcpo.core.per_sequence_grads.reductions import ghost_sq_norms, rows_at_ids, sparse_rows_sq_norms, wide_dtype

LINEARS = ("ColumnParallelLinear", "RowParallelLinear")
NORMS = ("RMSNorm", "LayerNorm")
KINDS = (*LINEARS, "VocabParallelEmbedding", "Embedding", *NORMS)


def is_sharded(param: torch.Tensor) -> bool:
    """megatron-core marks the parameters it splits over the tensor-parallel group."""
    return bool(getattr(param, "tensor_model_parallel", False))


def partial_over_tensor_parallel(config, name: str, param: torch.Tensor) -> bool:
    """A replicated parameter whose gradient on each rank is only its part (its tokens, or its heads), summed over the
    tensor-parallel group by megatron's ``finalize_model_grads``: the same test megatron applies there."""
    return bool((getattr(config, "sequence_parallel", False) and getattr(param, "sequence_parallel", False))
                or (getattr(config, "qk_layernorm", False) and ("q_layernorm" in name or "k_layernorm" in name)))


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


@dataclass
class _MicroBatch:
    """One micro-batch of a step: its sequences' squared-norm parts, coefficients and tied-embedding rows."""

    sharded: torch.Tensor  # (B,) float64: parts from tensor-parallel shards (summed over the TP group later)
    replicated: torch.Tensor  # (B,) float64: parts from replicated parameters (counted once)
    groups: torch.Tensor | None = None  # (B,) each sequence's baseline group, in [0, num_groups)
    coefficients: torch.Tensor | None = None  # (1 + g, B): c^R, then c^S of the sequences of each group present
    buffer_rows: torch.Tensor | None = None  # (1 + g,): the rows of the step's buffers these combinations add to
    tied_ids: torch.Tensor | None = None  # the ids as rows of this rank's shard of the tied weight
    head_rows: torch.Tensor | None = None  # rows of H_i (the output layer's gradient) at those ids
    embedding_rows: torch.Tensor | None = None  # δ^E of the tied embedding (first stage, tied across stages)


class MegatronSequenceNorms:
    """||g_i||² of every sequence of a step over ALL of a megatron-core model's trainable parameters (every
    TP shard, every pipeline stage), from the one backward of Σ_i l_i, and, given coefficients, the OPOB
    update Σ_i (c^R_i − b c^S_i) g_i of every local parameter (``docs/ALGORITHMS.md`` §4).

    A step is any number of micro-batches whose forwards and backwards may interleave, as megatron's
    pipeline schedules run them: each forward hook binds the layer's gradient to the micro-batch announced
    last (`micro_batch`, before its forward). On every rank::

        norms = MegatronSequenceNorms(model, tp_group, pp_group, embedding_group)
        with norms.step(num_groups):
            for batch in micro_batches:                       # the same order on every stage
                norms.micro_batch(coef_r, coef_s, groups, ids)
                ... forward (and, at any later point, the backward of) Σ_i l_i ...
        sq_norms = norms.sq_norms()          # (sequences of the step,) float64, in micro-batch order, alike on every rank
        for param, gradient in norms.combined(opob_baseline(...)): ...   # or norms.combine(...) into p.grad

    `recording` is the step of one micro-batch. Raises ValueError at construction for a trainable module or a
    setting it does not handle.
    """

    def __init__(self, model: nn.Module, tp_group: dist.ProcessGroup | None = None, pp_group: dist.ProcessGroup | None = None,
                 embedding_group: dist.ProcessGroup | None = None):
        self.model, self.tp_group, self.pp_group, self.embedding_group = model, tp_group, pp_group, embedding_group
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
        config = getattr(model, "config", None)
        self.partial = {id(p) for name, p in model.named_parameters() if partial_over_tensor_parallel(config, name, p)}
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._micro_batches: list[_MicroBatch] = []
        self._current: _MicroBatch | None = None
        self._num_groups = 0
        self._combining = False
        self._cross_added = False
        self._buffers: dict[int, torch.Tensor] = {}  # parameter id -> (1 + G, *shape): G_R, then every G_S^γ

    @contextlib.contextmanager
    def step(self, num_groups: int | None = None) -> Iterator[None]:
        """Hooks on the model for one step; every micro-batch's forward AND backward run inside. ``num_groups``:
        the baseline groups of the step (the labels `micro_batch` takes lie in [0, num_groups)); None: norms only."""
        self._micro_batches, self._current, self._buffers, self._cross_added = [], None, {}, False
        self._combining = num_groups is not None
        self._num_groups = num_groups or 0
        handles = [module.register_forward_hook(self._forward_hook) for module in self.modules]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._current = None

    def micro_batch(
        self,
        batch_size: int,
        coef_r: torch.Tensor | None = None,
        coef_s: torch.Tensor | None = None,
        groups: torch.Tensor | None = None,
        ids: torch.Tensor | None = None,
    ) -> None:
        """The next forward's micro-batch of ``batch_size`` sequences. In a step with groups, its gradients add
        c^R_i g_i to G_R and c^S_i g_i to G_S^γ of sequence i's group (``groups``: labels in [0, num_groups);
        None: group 0). ``ids`` (B, T): the input ids, which the last stage of embeddings tied across stages
        needs (and only it)."""
        if self.tied_across_stages and self.last_stage and not self.first_stage and ids is None:
            raise ValueError("micro_batch: the last stage of embeddings tied across pipeline stages needs the input ids")
        zeros = torch.zeros(batch_size, dtype=torch.float64, device=self.device)
        record = _MicroBatch(zeros, zeros.clone())
        if self._combining:
            if coef_r is None or coef_s is None:
                raise ValueError("micro_batch: a step with groups needs coef_r and coef_s")
            labels = torch.zeros(batch_size, dtype=torch.long) if groups is None else torch.as_tensor(groups, dtype=torch.long).cpu()
            if labels.numel() and not 0 <= int(labels.min()) <= int(labels.max()) < self._num_groups:
                raise ValueError(f"micro_batch: group labels must lie in [0, {self._num_groups}), got {labels.tolist()}")
            present, position = torch.unique(labels, return_inverse=True)
            score_rows = torch.zeros(present.numel(), batch_size, dtype=torch.float64)
            score_rows[position, torch.arange(batch_size)] = coef_s.detach().cpu().to(torch.float64)
            record.coefficients = torch.cat([coef_r.detach().cpu().to(torch.float64).unsqueeze(0), score_rows]).to(self.device)
            record.groups = labels
            record.buffer_rows = torch.cat([torch.zeros(1, dtype=torch.long), 1 + present]).to(self.device)
        if ids is not None and self.tied_across_stages and not self.first_stage:
            record.tied_ids = self._output_shard_ids(ids)
        self._micro_batches.append(record)
        self._current = record

    @contextlib.contextmanager
    def recording(
        self,
        batch_size: int,
        coef_r: torch.Tensor | None = None,
        coef_s: torch.Tensor | None = None,
        groups: torch.Tensor | None = None,
        ids: torch.Tensor | None = None,
    ) -> Iterator[None]:
        """A step of one micro-batch: run its forward AND its backward inside this block. ``groups``: any
        labels, one per sequence (None: one group)."""
        labels = None if groups is None else torch.unique(torch.as_tensor(groups), return_inverse=True)[1]
        num_groups = None if coef_r is None else (1 if labels is None else int(labels.max()) + 1)
        with self.step(num_groups):
            self.micro_batch(batch_size, coef_r, coef_s, labels, ids)
            yield

    def sq_norms(self) -> torch.Tensor:
        """The per-sequence squared norms of the last step, in micro-batch order, reduced over the TP group
        and summed over the pipeline stages (``pp_group``)."""
        if not self._micro_batches:
            raise ValueError("sq_norms() needs a step with a micro-batch first")
        if self.tied_across_stages and not self._cross_added:
            self._add_cross_term_across_stages()
        sharded = torch.cat([record.sharded for record in self._micro_batches])
        if dist.is_initialized():
            sharded = all_reduce_here(sharded, self.tp_group)
        total = sharded + torch.cat([record.replicated for record in self._micro_batches])
        if self.pp_group is not None:
            total = all_reduce_here(total, self.pp_group)
        return total

    @property
    def num_sequences(self) -> int:
        """The sequences of the step's micro-batches so far."""
        return sum(record.sharded.numel() for record in self._micro_batches)

    def combined(self, baseline: torch.Tensor | float) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, G_R − Σ_γ b_γ G_S^γ) for every local trainable parameter, ``baseline`` per sequence of
        the step (constant within each group, as `opob_baseline` returns it) or one number; a parameter no
        sequence reached gets zeros. In the buffers' dtype (float64 for float64 parameters, float32 for
        bf16/fp16). A ``sequence_parallel`` parameter gets this rank's tokens' part, which the TP group's sum
        completes (megatron's ``finalize_model_grads`` sums its gradient so)."""
        if not self._combining:
            raise ValueError("combined() needs a step with groups, whose micro-batches had coef_r and coef_s")
        labels = torch.cat([record.groups for record in self._micro_batches])
        per_sequence = torch.as_tensor(baseline, dtype=torch.float64).expand(labels.shape[0])
        per_group = torch.zeros(self._num_groups, dtype=torch.float64)
        per_group[labels] = per_sequence
        if not torch.allclose(per_group[labels], per_sequence, rtol=1e-6, atol=1e-12):
            raise ValueError("combine: the baseline must be constant within each group")
        weights = torch.cat([torch.ones(1, dtype=torch.float64), -per_group])  # 1 · G_R − Σ_γ b_γ G_S^γ
        for param in self.model.parameters():
            if param.requires_grad:
                buffer = self._buffers.get(id(param))
                if buffer is None:
                    yield param, torch.zeros_like(param, dtype=wide_dtype(param.dtype))
                else:
                    yield param, torch.tensordot(weights.to(device=buffer.device, dtype=buffer.dtype), buffer, 1)

    def combine(self, baseline: torch.Tensor | float) -> None:
        """p.grad ← `combined` for every local trainable parameter (replacing the layers' own gradient of Σ_i l_i)."""
        for param, gradient in self.combined(baseline):
            param.grad = gradient.to(param.dtype)

    def _output_shard_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """The ids as rows of this rank's shard of the output layer (0 outside it; the first stage's δ^E
        rows there are zero, so they add nothing to the cross term)."""
        rows = self.tied.shape[0]
        start = rows * (dist.get_rank(self.tp_group) if dist.is_initialized() and self.tp_group is not None else 0)
        return shard_rows(ids, start, start + rows)[0]

    def _add_cross_term_across_stages(self) -> None:
        """2 Σ_t <H_i[id_t], δ^E_{i,t}>: the last stage's rows of H_i, sent to the first stage, which adds them,
        one broadcast per micro-batch (their token counts may differ)."""
        self._cross_added = True
        if not (self.first_stage or self.last_stage):
            return
        last = dist.get_process_group_ranks(self.embedding_group)[-1]
        for record in self._micro_batches:
            if self.last_stage:
                broadcast_here(record.head_rows, src=last, group=self.embedding_group)
            else:  # a fresh contiguous buffer: one made with empty_like would keep a transposed stride
                head_rows = broadcast_here(torch.empty(record.embedding_rows.shape, dtype=torch.float64, device=record.embedding_rows.device),
                                           src=last, group=self.embedding_group)
                self._add(record, self.tied, 2.0 * torch.einsum("btd,btd->b", head_rows, record.embedding_rows))

    def _combine(self, record: _MicroBatch, param: torch.Tensor, gradients: torch.Tensor) -> None:
        """G_R and every G_S^γ of the micro-batch's groups += ``gradients`` (1 + g, *param.shape)."""
        if id(param) not in self._buffers:
            self._buffers[id(param)] = torch.zeros((1 + self._num_groups, *param.shape), dtype=wide_dtype(param.dtype), device=param.device)
        buffer = self._buffers[id(param)]
        buffer.index_add_(0, record.buffer_rows, gradients.to(buffer.dtype))

    def _add_dense(self, record: _MicroBatch, param: torch.Tensor, per_sequence: torch.Tensor) -> None:
        """Per-sequence gradients (B, *param.shape) of a whole parameter: squared norms and combinations.
        A parameter `partial_over_tensor_parallel` has this rank's part of each vector (its tokens, its heads):
        squared after their sum over the TP group, combined as they are (its gradient is summed over the group afterwards)."""
        flat = per_sequence.reshape(per_sequence.shape[0], -1)
        if id(param) in self.partial and self.tp_group is not None and dist.get_world_size(self.tp_group) > 1:
            summed = all_reduce_here(flat, self.tp_group)
            self._add(record, param, (summed * summed).sum(1))
        else:
            self._add(record, param, (flat * flat).sum(1))
        if record.coefficients is not None:
            self._combine(record, param, (record.coefficients @ flat).view(-1, *param.shape))

    def _gather_tokens(self, values: torch.Tensor) -> torch.Tensor:
        """A sequence-parallel activation (tokens/TP, ...) -> (tokens, ...), the ranks' slices in rank order."""
        parts = [torch.empty_like(values) for _ in range(dist.get_world_size(self.tp_group))]
        dist.all_gather(parts, values.contiguous(), group=self.tp_group)
        return torch.cat(parts)

    @staticmethod
    def _add(record: _MicroBatch, param: torch.Tensor, values: torch.Tensor) -> None:
        target = record.sharded if is_sharded(param) else record.replicated
        target += values.detach().to(device=target.device, dtype=torch.float64)

    def _forward_hook(self, module: nn.Module, args: tuple, output) -> None:
        record = self._current
        if not torch.is_grad_enabled() or record is None:
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
                record.tied_ids = inputs[0]
        else:
            handler = self._norm_gradient
            inputs = normalized(inputs, module)
        # the hook hands the input over and lets it go: megatron's schedule keeps a micro-batch's output (and with it
        # its graph's hooks) until the next micro-batch's forward has run, so an input held here would meet that
        # forward's activations (every watched layer's input of a micro-batch, after its backward had freed them)
        kept = [inputs]

        def on_gradient(grad: torch.Tensor) -> None:
            if not kept:
                raise RuntimeError(f"a second backward through {type(module).__name__}'s output in one micro-batch: its "
                                   "per-sequence norms would count it twice")
            handler(record, module, kept.pop(), grad.detach())

        out.register_hook(on_gradient)

    def _linear_gradient(self, record: _MicroBatch, module: nn.Module, x: torch.Tensor, delta: torch.Tensor) -> None:
        local_delta = delta  # under sequence parallelism a row-parallel output holds this rank's tokens
        if getattr(module, "sequence_parallel", False) and type(module).__name__ == "RowParallelLinear":
            delta = self._gather_tokens(delta)
        # (sequences, tokens, width), widened as the transformers handlers widen them (bf16 to float32; float64 stays):
        # the output layer's gradient is (tokens, vocabulary / TP), and a float64 copy of it was the largest tensor of
        # the step (docs/per_sequence_gradients.md, "Memory")
        wide = wide_dtype(delta.dtype)
        rows, cols = delta.transpose(0, 1).to(wide), x.transpose(0, 1).to(wide)
        weight = module.weight if module.weight is not None else self.tied
        if weight.requires_grad:
            self._add(record, weight, ghost_sq_norms(rows, cols))
            if record.coefficients is not None:  # Σ_i c_i δ_iᵀ x_i: one matmul per combination
                flat_cols = cols.reshape(-1, cols.shape[-1])
                self._combine(record, weight, torch.stack([
                    (coefficients.to(rows.dtype).view(-1, 1, 1) * rows).reshape(-1, rows.shape[-1]).t() @ flat_cols
                    for coefficients in record.coefficients
                ]))
            if weight is self.tied and record.tied_ids is not None:
                record.head_rows = rows_at_ids(rows, cols, record.tied_ids).to(torch.float64)
        bias = getattr(module, "bias", None)
        if bias is not None and bias.requires_grad:
            self._add_dense(record, bias, local_delta.to(torch.float64).sum(0))  # megatron marks it sequence_parallel when the tokens are split

    def _embedding_gradient(self, record: _MicroBatch, module: nn.Module, ids: tuple[torch.Tensor, torch.Tensor], delta: torch.Tensor) -> None:
        if getattr(module, "reduce_scatter_embeddings", False):  # its output is (tokens/TP, sequences, width)
            delta = self._gather_tokens(delta).transpose(0, 1)
        local, inside = ids  # `local_ids`
        rows = (delta * inside.unsqueeze(-1).to(delta.dtype)).to(torch.float64)
        self._add(record, module.weight, sparse_rows_sq_norms(local, rows, module.weight.shape[0]))
        if record.coefficients is not None:  # the weighted rows scattered at the ids
            combined = torch.zeros((record.coefficients.shape[0], *module.weight.shape), dtype=torch.float64, device=rows.device)
            for row, coefficients in enumerate(record.coefficients):
                combined[row].index_add_(0, local.flatten(), (coefficients.view(-1, 1, 1) * rows).reshape(-1, rows.shape[-1]))
            self._combine(record, module.weight, combined)
        if module.weight is self.tied and self.tied_across_stages:
            record.embedding_rows = rows
        elif module.weight is self.tied and record.head_rows is not None:
            self._add(record, module.weight, 2.0 * torch.einsum("btd,btd->b", record.head_rows, rows))
            record.head_rows = None  # a float64 (sequences, tokens, hidden) copy, otherwise kept to the step's end

    def _norm_gradient(self, record: _MicroBatch, module: nn.Module, x_hat: torch.Tensor, delta: torch.Tensor) -> None:
        """(tokens, sequences, [heads,] width): summed over the tokens and, for a QK layer norm, the heads."""
        delta64 = delta.to(torch.float64)

        def per_sequence(values: torch.Tensor) -> torch.Tensor:  # (sequences, width)
            return values.transpose(0, 1).reshape(values.shape[1], -1, values.shape[-1]).sum(1)

        self._add_dense(record, module.weight, per_sequence(delta64 * x_hat.to(torch.float64)))
        bias = getattr(module, "bias", None)
        if bias is not None and bias.requires_grad:
            self._add_dense(record, bias, per_sequence(delta64))


__all__ = ["KINDS", "MegatronSequenceNorms", "is_sharded", "partial_over_tensor_parallel"]
