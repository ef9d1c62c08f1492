"""VCPO's ESS step size and single-backward OPOB update inside verl 0.9.1's FSDP training engine.

Registered for the ``fsdp``/``fsdp2`` backends under the model type ``vcpo_language_model`` (`vcpo.verl_plugin.engine`,
which says how a run selects it). The engine resets ``model_type`` to ``language_model`` on its model config so
verl's model builder runs unchanged; the reference model (a deepcopy of the same model config) also gets this
class, whose inference path is verl's. What the engine does per optimizer step comes from the method preset named
by ``policy_loss.method``, which it reads from the loss function verl hands it
(``functools.partial(ppo_loss, config=actor_config)``): the step-size rule ``ess`` turns on (1), the
advantage estimator ``opob`` turns on (2); any other preset runs verl's ``train_batch`` untouched.

(1) ESS step size (docs/ALGORITHMS.md §2). s_i = Σ_t (l^θ − l^μ) with l^μ = ``old_log_probs`` (bypass
    convention) and l^θ the learner's log-probs of this optimizer step's forward passes (the parameters
    do not move before ``optimizer.step``, so these are the log-probs at the start of the step). The
    s_i of every sequence of the mini-batch on every data-parallel rank are all-gathered, ρ_ess =
    ``ess_ratio_over_ranks`` of them, and the optimizer's learning rate is multiplied by ``ess_step_scale(ρ_ess)``
    (the preset's rho_on, or ``policy_loss.rho_on`` when set, form, clamp) for that ``optimizer.step()`` only (``scaled_learning_rate``
    restores it; the LR scheduler is untouched). The loss stays verl's ``ppo_loss``.

(2) OPOB (docs/ALGORITHMS.md §3-4, VCPO App. C). Every micro-batch runs its forward and backward inside
    ``PerSequenceGradients.micro_batch``: after the forward the coefficients c^S_i = −w^TIS_i/(σ_g N),
    c^R_i = c^S_i R_i are set (w^TIS_i = min(w_i, c) from the learner's log-probs, σ_g the group's reward
    std when ``norm_by_std``, N the global count of valid sequences, or of tokens for token-mean) and
    the backward runs on Σ_i l_i (l_i the loss aggregation's per-sequence score), combining each
    sequence's gradient into its group's success or failure buffer (combination "split": one buffer per
    sequence for binary rewards; any reward is exact). After the last
    micro-batch the rewards, s_i and ||g_i||² of all ranks are all-gathered, b* = ``opob_baseline`` is
    computed (per prompt group for scope "group", labels from ``uid``; groups may span micro-batches
    and ranks), ``combine`` forms Σ_γ (1 − b_γ) G_1^γ − b_γ G_0^γ locally, and the combined gradient is summed over
    data-parallel ranks with ONE all-reduce (one flat buffer). Then the ESS-scaled optimizer step.
    That is OPOB's "single" mode. Its "two_pass" mode (what ``policy_loss.opob_mode=auto`` runs wherever single's
    projected peak exceeds 1.25x the plain step's or the GPU: `vcpo.actor_memory`) runs the same
    forwards with a norms-only backward (``combination="norms"``, FSDP2 sharded as in a plain step), the same
    baseline, then verl's own plain step of Σ_i c^S_i (R_i − b_i) l_i: no buffers, nothing unsharded, about twice
    the time. The step logs ``actor/opob_two_pass``.
    R_i = Σ_t token_level_rewards (after the KL-in-reward penalty; verl's V1 trainer sends them to the actor
    only when it applies one) or else Σ_t rm_scores (the verifiable reward). The advantages in the batch are not
    used. Packed micro-batches (remove-padding, also with ``pad_to_length``) go to ``micro_batch`` with
    ``cu_seqlens``; padded micro-batches (``use_remove_padding=False``) one sequence per row. Dynamic
    batch sizes work. Not supported (clear
    errors): Ulysses sequence parallelism, top-K distillation.

Metrics (one value per optimizer step, as one-element lists like verl's per-micro-batch metrics; the
trainer prefixes keys that do not start with ``actor/``, so the ESS ratio is logged as
``actor/rollout_corr/seq_ess_ratio``): ``rollout_corr/seq_ess_ratio``, ``actor/lr_scale``,
``actor/effective_lr`` (both rules); ``actor/opob_baseline`` (mean b*), ``actor/seq_grad_norm_{mean,max,min}``
(||g_i|| over all ranks), ``actor/pg_loss`` (Σ_i c^S_i (R_i − b_i) l_i, also verl's ``loss``),
``actor/opob_packed`` (OPOB).

FSDP. ``PerSequenceGradients`` replaces the forward of each Linear / Embedding / RMSNorm and writes
per-sequence sums into ``module.weight.grad``. FSDP2 (``strategy=fsdp2``, verl's ``fully_shard``): for an
OPOB step the engine unshards every FSDP module and turns FSDP2's gradient sync and resharding off
(``set_requires_gradient_sync`` / ``set_reshard_after_forward`` / ``set_reshard_after_backward``, and
verl's per-micro-batch no_sync toggling), so the handlers see the unsharded Parameters; after
``combine`` and the one all-reduce of the full gradient, each sharded parameter gets its shard as a
DTensor gradient (``distribute_tensor(..., src_data_rank=None)``: a local slice, no communication), the
modules are resharded and the flags restored; verl's ``optimizer_step`` (FSDP2 grad clipping) follows.
Cost: the whole model and its gradient are unsharded during an OPOB step (no ZeRO-3 saving in that
step) and the reduction is an all-reduce rather than FSDP2's reduce-scatter (2x the bytes per rank);
reduce-scatter would also be exact, since RS(G_R − b G_S) = RS(G_R) − b RS(G_S). FSDP1
(``strategy=fsdp``): its modules hold views of a FlatParameter whose own ``.grad`` is what FSDP
reduces, so the handlers' writes would be lost: OPOB raises a clear error (use fsdp2). Mixed
precision: verl's default (FSDP2 bf16 parameters for compute, fp32 reduction, the forward under
``torch.autocast(bf16)``) works: ``PerSequenceGradients`` forms the per-sequence gradients in bf16 as
autograd would, accumulates its buffers in float32 and writes the combined gradient into the bf16
unsharded gradients at ``combine``; the one all-reduce sums them in float32 (the local and the summed
gradient are each rounded once to bf16, like FSDP2's own bf16 gradient before its fp32 reduction) and
each fp32 sharded parameter gets its shard. fp16 loss scaling is refused (it would scale every norm). The ESS rule works with every strategy and precision (it touches only log-probs and the
learning rate).
Megatron (``strategy=megatron``): the same rule in ``vcpo.verl_plugin.engine.megatron``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils import torch_functional
from verl.utils.torch_dtypes import PrecisionType
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from vcpo.actor_memory import Layout, ModelShape, StepShape, hf_attention, split_buffers, verl_log_probs
from vcpo.core import PerSequenceGradients
from vcpo.core.per_sequence_grads.reductions import NORMS_ONLY
from vcpo.methods import StepRule
from vcpo.upstream import require
from vcpo.verl_contract import step_rule_applied
from vcpo.verl_plugin.engine.batch import all_reduce_gradients
from vcpo.verl_plugin.engine.step import (
    StepState,
    VcpoEngine,
    active_rule,
    micro_batch_tokens,
    opob_baseline_over_ranks,
    opob_micro_batch,
    recording_loss,
    scaled_optimizer_step,
    second_pass,
)

require("fsdp_engine")


class VcpoFSDPEngineWithLMHead(VcpoEngine, FSDPEngineWithLMHead):
    """verl's FSDP LM engine plus the ESS step size and the single-backward OPOB update (module doc)."""

    def __init__(self, model_config, *args, **kwargs):
        super().__init__(model_config, *args, **kwargs)
        self._per_sequence: PerSequenceGradients | None = None
        # Each sequence's gradient added to one buffer (binary rewards) during the backward: the micro-batches
        # are many and long, so nothing waits for the baseline (benchmarks/opob_engine.py times the others)
        self.opob_combination = "split"

    # -- the optimizer step ------------------------------------------------------------------------
    def train_batch(self, data: TensorDict, loss_function) -> Any:
        rule = active_rule(data, loss_function)
        if rule is None:
            return super().train_batch(data, loss_function)
        group = self.get_data_parallel_group()
        state = self._open_step(rule, data, loss_function, group, check_setting=self._check_opob_setting)
        try:
            if state.opob_mode == "two_pass" and rule.opob:
                outputs, ratio = self._two_pass_step(data, loss_function, state, group)
            else:
                with self._fsdp2_unsharded(state):
                    if rule.opob:
                        self._per_sequence_gradients(fsdp2=bool(state.fsdp2))
                    loss = recording_loss(loss_function, state, self._opob_loss)
                    with step_rule_applied():
                        outputs = self.forward_backward_batch(data, loss, forward_only=False)
                    state.close_micro_batch()
                    ratio = state.ess_ratio(group)
                    if rule.opob:
                        state.metrics.update(self._opob_combine(state, group))
        except BaseException:
            state.abort()
            if self._per_sequence is not None:
                self._per_sequence.discard()
            self._per_sequence = None
            self.optimizer_zero_grad()
            raise
        finally:
            self._step = None
        return scaled_optimizer_step(self, state, ratio, outputs)

    def _two_pass_step(self, data: TensorDict, loss_function, state: StepState, group) -> tuple[Any, float]:
        """Pass 1: every micro-batch's forward and a norms-only backward (no gradient, nothing kept), as verl's
        plain step runs them (FSDP2 sharded); the baseline from every rank's norms. Pass 2: verl's plain step of
        Σ_i c^S_i (R_i − b_i) l_i, its gradient reduced by FSDP2 as any other (times the data-parallel size, which
        FSDP2's reduction averages over, as verl's own losses do). The coefficients come from pass 1's forward
        (the parameters have not moved); pass 1's outputs (the loss's diagnostics) are the step's."""
        self._per_sequence = self._norms_only_gradients()
        loss = recording_loss(loss_function, state, self._opob_loss)
        with step_rule_applied():
            outputs = self.forward_backward_batch(data, loss, forward_only=False)
        state.close_micro_batch()
        ratio = state.ess_ratio(group)
        baseline, metrics = opob_baseline_over_ranks(state, self._per_sequence.sq_norms, group)
        state.metrics.update(metrics)
        self._per_sequence.discard()
        self._per_sequence = None
        fsdp = bool(self._fsdp2_modules())
        second_pass(self, data, state, baseline, self.get_data_parallel_size() if fsdp else 1)
        if not fsdp:  # an unwrapped module (the tests' float64 engine): nothing else sums over ranks
            all_reduce_gradients([p for p in self.module.parameters() if p.requires_grad], group)
        return outputs, ratio

    def _norms_only_gradients(self) -> PerSequenceGradients:
        """The norms-only engine over the Parameters FSDP2's forward will use: its unsharded ones (the same objects
        in every unshard of the step), so the module is unsharded while the handlers are built, then resharded."""
        modules = self._fsdp2_modules()
        for module in modules:
            module.unshard()
        try:
            return PerSequenceGradients(self.module, combination=NORMS_ONLY)
        finally:
            for module in modules:
                module.reshard()

    def _memory_inputs(self, data: TensorDict) -> tuple[ModelShape, Layout, StepShape]:
        """The model's shape (its real parameter count), this rank's layout and the step's buffers and tokens."""
        count = sum(p.numel() for p in self.module.parameters() if p.requires_grad)  # DTensors: the full shape's count
        shape = dataclasses.replace(ModelShape.from_config(self.model_config.hf_config), parameter_count=count)
        precision = dict(getattr(self.engine_config, "mixed_precision", None) or {})
        first = next(self.module.parameters())
        compute = PrecisionType.to_dtype(precision.get("param_dtype", "bf16")) if self._fsdp2_modules() else first.dtype
        layout = Layout(strategy="fsdp2", data_parallel=self.get_data_parallel_size(), param_bytes=first.element_size(),
                        compute_bytes=torch.empty(0, dtype=compute).element_size(),
                        gradient_checkpointing=bool(getattr(self.model_config, "enable_gradient_checkpointing", False)),
                        attention=hf_attention(first.device.type, getattr(self.module.config, "_attn_implementation", None),
                                               bool(self.use_remove_padding)),
                        # verl's own test of flash-attn's cross-entropy; were it renamed, the two-copy path, the larger
                        log_probs=verl_log_probs(getattr(torch_functional, "FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE", False), os.environ),
                        device=first.device.type)
        rewards, groups = data["vcpo_reward"].cpu(), data["vcpo_group"].cpu()
        before_last = None  # dynamic batch sizes: verl regroups the sequences, so every buffer may be open (the larger)
        if not tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=False):
            micro = int(tu.get_non_tensor_data(data=data, key="micro_batch_size_per_gpu", default=len(data)))
            last = micro * ((len(data) - 1) // micro)  # verl's micro-batches: runs of `micro` consecutive sequences
            before_last = split_buffers(rewards[:last], groups[:last])
        return shape, layout, StepShape(tokens_per_micro_batch=micro_batch_tokens(data), buffers=split_buffers(rewards, groups),
                                        buffers_before_last=before_last,
                                        combination="buffers" if self.opob_combination == "buffers" else "split")

    # -- OPOB --------------------------------------------------------------------------------------
    def _per_sequence_gradients(self, fsdp2: bool) -> PerSequenceGradients:
        # FSDP2: the unsharded Parameters of this step (FSDP2 may re-create them between steps)
        if fsdp2 or self._per_sequence is None:
            self._per_sequence = PerSequenceGradients(self.module, combination=self.opob_combination)
        return self._per_sequence

    def _fsdp2_modules(self) -> list:
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # pragma: no cover
            return []
        return [m for m in self.module.modules() if isinstance(m, FSDPModule)]

    @contextlib.contextmanager
    def _fsdp2_unsharded(self, state: StepState):
        """FSDP2 + OPOB: hold every parameter unsharded for the step, then shard the combined gradient.

        The per-sequence handlers write into the unsharded Parameters' ``.grad``; FSDP2's own gradient
        reduction is off for the whole step (no reduce-scatter, no reshard after forward or backward).
        `_opob_combine` combines and all-reduces those full gradients (one all-reduce, as in VCPO App. C);
        here each sharded parameter then gets its shard of it as a DTensor gradient, the unsharded
        gradients are dropped and the modules resharded. Memory: the whole model and its gradient
        unsharded for the step (no ZeRO-3 saving during an OPOB step), plus the score buffers.
        """
        modules = self._fsdp2_modules() if state.opob and state.opob_mode == "single" else []
        if not modules:
            yield
            return
        precision = dict(getattr(self.engine_config, "mixed_precision", None) or {})
        param_dtype = PrecisionType.to_dtype(precision.get("param_dtype", "bf16"))  # verl's names: fp32, 32, ...
        reduce_dtype = PrecisionType.to_dtype(precision.get("reduce_dtype", "fp32"))
        if param_dtype == torch.float32 and reduce_dtype != torch.float32:
            # fp32 parameters get their G_R in p.grad during the backward, which FSDP2 (gradient sync off)
            # would move into its private reduce-dtype accumulator; low-precision parameters accumulate in
            # the engine's own float32 buffers and reach p.grad only at combine, so they are safe
            raise NotImplementedError(
                f"OPOB under FSDP2 with fp32 parameters needs mixed_precision.reduce_dtype fp32, got {precision}"
            )
        state.fsdp2 = modules
        reshard_after_forward = getattr(self.engine_config, "reshard_after_forward", True)
        for module in modules:
            module.set_requires_gradient_sync(False, recurse=False)
            module.set_reshard_after_forward(False, recurse=False)
            module.set_reshard_after_backward(False, recurse=False)
        for module in modules:
            module.unshard()
        full_grads = None
        try:
            yield
            full_grads = {name: p.grad for name, p in self.module.named_parameters() if p.grad is not None}
        finally:
            for p in self.module.parameters():
                p.grad = None
            for module in modules:
                module.reshard()
                module.set_requires_gradient_sync(True, recurse=False)
                module.set_reshard_after_forward(reshard_after_forward, recurse=False)
                module.set_reshard_after_backward(True, recurse=False)
            self._per_sequence = None
        from torch.distributed.tensor import DTensor, distribute_tensor

        for name, param in self.module.named_parameters():
            grad = full_grads.get(name)
            if grad is None:
                continue
            if isinstance(param, DTensor):
                grad = distribute_tensor(grad.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
            param.grad = grad

    def _check_opob_setting(self, rule: StepRule) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        strategy = "fsdp" if isinstance(self.module, FullyShardedDataParallel) else "fsdp2"
        if strategy not in rule.strategies:
            raise NotImplementedError(
                f"method {rule.method!r} runs on actor_rollout_ref.actor.strategy={'|'.join(rule.strategies)} only, got "
                f"{strategy}: OPOB's per-sequence gradients cannot be written into FSDP1 flat-parameter gradients "
                "(or use a method without OPOB, e.g. tis_ess)"
            )
        if self.use_ulysses_sp:
            # each SP rank holds a slice of the packed row: per-sequence norms would need a cross-rank sum
            raise NotImplementedError("OPOB in the vcpo engine does not support Ulysses sequence parallelism")
        if getattr(self, "scaler", None) is not None:
            # fp16's loss scaling would scale every per-sequence norm (and its logged statistics) by the scale
            raise NotImplementedError("OPOB in the vcpo engine does not support fp16 loss scaling; train in bf16 or fp32")

    @contextlib.contextmanager
    def _gradient_sync_context(self, *, is_last_micro_batch: bool):
        if self._step is not None and self._step.fsdp2 and self._step.opob:
            yield  # FSDP2 gradient sync stays off for the whole OPOB step (see _fsdp2_unsharded)
            return
        with super()._gradient_sync_context(is_last_micro_batch=is_last_micro_batch):
            yield

    def forward_step(self, micro_batch: TensorDict, loss_function, forward_only):
        state = self._step
        if state is None or not state.opob or forward_only:
            return super().forward_step(micro_batch, loss_function, forward_only)
        # The previous micro-batch's backward has run (verl calls backward right after forward_step).
        state.close_micro_batch()
        size = len(micro_batch)
        zeros = torch.zeros(size, dtype=torch.float64)
        groups = micro_batch["vcpo_group"].cpu() if state.rule.scope == "group" else None
        kwargs = {}
        if state.packed:
            kwargs["cu_seqlens"] = micro_batch["input_ids"].offsets()
        stack = contextlib.ExitStack()
        stack.enter_context(self._per_sequence.micro_batch(zeros, zeros, groups=groups, **kwargs))
        state.stack = stack
        return super().forward_step(micro_batch, loss_function, forward_only)

    def _opob_loss(self, data: TensorDict, log_prob, behav, mask):
        """Set c^R, c^S from this forward's log-probs; return Σ_i l_i for the backward."""
        coefficients, scores, metric = opob_micro_batch(self._step, data, log_prob, behav, mask)
        self._per_sequence.set_coefficients(coefficients.reward, coefficients.score)
        return scores.sum(), metric

    def _opob_combine(self, state: StepState, group) -> dict[str, float]:
        """Baseline from the norms of every rank, combine locally, ONE all-reduce of the gradient."""
        baseline, metrics = opob_baseline_over_ranks(state, self._per_sequence.sq_norms, group)
        self._per_sequence.combine(baseline)
        all_reduce_gradients([p for p in self.module.parameters() if p.requires_grad], group)
        return metrics


__all__ = ["VcpoFSDPEngineWithLMHead"]
