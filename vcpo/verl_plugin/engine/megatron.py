"""VCPO's ESS step size and single-backward OPOB update inside verl 0.9.1's Megatron training engine.

Selected as the FSDP engine is (``+actor_rollout_ref.model.model_type=vcpo_language_model``), with
``actor_rollout_ref.actor.strategy=megatron``; the same step rule from the same preset (`vcpo.verl_plugin.engine.fsdp`).

(1) ESS step size. The loss records s_i on the last pipeline stage (the only one with log-probs);
    ρ_ess is gathered over the data-parallel ranks there and broadcast over the pipeline stages
    (``ess_ratio_over_ranks``); megatron's optimizer steps with every param group's learning rate scaled.

(2) OPOB. Megatron's layers compute their own weight gradients, so `MegatronSequenceNorms` watches them
    (hooks on the parallel linears, embeddings and norms; docs/per_sequence_gradients.md). Its pipeline
    schedules interleave the micro-batches' forwards and backwards, and only the last stage learns a
    micro-batch's coefficients, after its forward: the first stages' backward of that micro-batch runs
    later, but they never see the coefficients. So the backward here is of Σ_i c^S_i l_i (the last stage's
    loss), whose per-sequence gradients are h_i = c^S_i g_i on every stage, and the step accumulates
    G_R = Σ_i R_i h_i and G_S^γ = Σ_{i∈γ} h_i, with R_i and the groups known to every stage from the batch:
    G_R − Σ_γ b_γ G_S^γ = Σ_i c^S_i (R_i − b_i) g_i, the update of docs/ALGORITHMS.md §4 (c^R_i = c^S_i R_i).
    The norms follow as ||g_i||² = ||h_i||² / (c^S_i)² (c^S_i broadcast from the last stage). A sequence with
    c^S_i = 0 (its truncated weight underflowed, or it has no response token) has no update to scale: its
    norm is recorded as 0, and its weight w_i² in the baseline is 0 anyway.
    Megatron's schedule ends in ``finalize_model_grads`` (verl sets it), which sums the gradients over the
    data-parallel ranks (averaging: megatron's DDP scales by 1/DP), the tied embedding's copies over the
    embedding group and sequence-parallel parameters over the TP group. For the step the engine wraps it:
    first the baseline b* from every rank's norms (on the last stage, broadcast over the stages), then
    G_R − Σ_γ b_γ G_S^γ (times DP, for megatron's average) written over each parameter's ``main_grad``, then
    megatron's own finalize: one reduction of the combined gradient, as in VCPO App. C.

OPOB trains megatron's local layers (``recipes/megatron.yaml``, ``local_layers``, which ``python -m vcpo.launch``
composes): the local layer spec (mbridge made to follow ``transformer_impl``, `layer_spec`), the padded layout, no
sequence parallelism. At its first OPOB step the engine refuses, each by its key, what `megatron_opob_refusals` refuses
at the launcher's dry run (packed micro-batches, Transformer Engine's layers, Megatron-Bridge, sequence parallelism,
fused kernels, virtual pipeline stages, context parallelism, megatron's per-token loss, overlapping gradient reduction,
fp16, under pipeline parallelism any recompute of the layers the norms watch), top-K distillation, and anything `MegatronSequenceNorms` cannot
count (it names the module). Metrics as the FSDP engine logs them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_model_config
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.megatron_utils import unwrap_model
from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

from vcpo.actor_memory import Layout, ModelShape, StepShape, megatron_recompute
from vcpo.core.collectives import broadcast_here
from vcpo.core.per_sequence_grads.megatron import MegatronSequenceNorms
from vcpo.upstream import require
from vcpo.verl_contract import MegatronSetup, megatron_opob_refusals, step_rule_applied
from vcpo.verl_plugin.engine.layer_spec import honour_transformer_impl
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
    sequence_lengths,
)

require("megatron_engine")


class VcpoMegatronEngineWithLMHead(VcpoEngine, MegatronEngineWithLMHead):
    """verl's Megatron LM engine plus the ESS step size and the single-backward OPOB update (module doc)."""

    def __init__(self, model_config, *args, **kwargs):
        # before mbridge builds the model; in this process only, which builds a Megatron engine
        honour_transformer_impl()
        super().__init__(model_config, *args, **kwargs)
        self._norms: MegatronSequenceNorms | None = None
        self._ids_for_tied_head = False  # the last stage of embeddings tied across stages needs the input ids
        self._two_pass_baseline: torch.Tensor | None = None

    def train_batch(self, data: TensorDict, loss_function) -> Any:
        rule = active_rule(data, loss_function)
        if rule is None:
            return super().train_batch(data, loss_function)
        group = self.get_data_parallel_group()
        state = self._open_step(rule, data, loss_function, group)
        try:
            with self._opob_step(state, data):
                loss = recording_loss(loss_function, state, self._opob_loss)
                with step_rule_applied():
                    outputs = self.forward_backward_batch(data, loss, forward_only=False)
            ratio = state.ess_ratio(group, self._pipeline_group())
            if rule.opob and state.opob_mode == "two_pass":
                self._second_pass(data, state)
        except BaseException:
            self.optimizer_zero_grad()
            raise
        finally:
            self._step = None
        return scaled_optimizer_step(self, state, ratio, outputs)

    def _memory_inputs(self, data: TensorDict) -> tuple[ModelShape, Layout, StepShape]:
        """The model's shape, this rank's Megatron layout and the step's buffers (G_R and one per local group)."""
        count = sum(p.numel() for chunk in self.module for p in chunk.parameters() if p.requires_grad)
        tp, pp = mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size()
        shape = dataclasses.replace(ModelShape.from_config(self.model_config.hf_config), parameter_count=count * tp * pp)
        config = get_model_config(self.module[0])
        checkpointing, attention = megatron_recompute(getattr(config, "transformer_impl", None), getattr(config, "recompute_granularity", None),
                                                      getattr(config, "recompute_modules", None))
        layout = Layout(strategy="megatron", data_parallel=mpu.get_data_parallel_world_size(), tensor_parallel=tp,
                        pipeline_parallel=pp, compute_bytes=2, gradient_checkpointing=checkpointing,
                        distributed_optimizer=bool(getattr(self.engine_config, "use_distributed_optimizer", True)),
                        sequence_parallel=bool(getattr(config, "sequence_parallel", False)), attention=attention,
                        device=next(self.module[0].parameters()).device.type)
        labels = data["vcpo_group"].cpu()
        groups = int(torch.unique(labels).numel())
        per_micro_batch = None  # dynamic batch sizes: verl regroups the sequences (every group, the larger)
        if not tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=False):
            micro = int(tu.get_non_tensor_data(data=data, key="micro_batch_size_per_gpu", default=len(data)))
            per_micro_batch = max(int(torch.unique(labels[start : start + micro]).numel()) for start in range(0, len(data), micro))
        longest = int(sequence_lengths(data).max())
        return shape, layout, StepShape(tokens_per_micro_batch=micro_batch_tokens(data), buffers=groups, sequence_length=longest,
                                        groups_per_micro_batch=per_micro_batch)

    def _second_pass(self, data: TensorDict, state: StepState) -> None:
        """two_pass: megatron's plain step of Σ_i c^S_i (R_i − b_i) l_i (the last stage's loss; times the data-parallel
        size, which megatron's gradient reduction averages over), after pass 1's gradients are dropped."""
        self.optimizer_zero_grad()
        second_pass(self, data, state, self._two_pass_baseline, mpu.get_data_parallel_world_size(with_context_parallel=True))

    @staticmethod
    def _pipeline_group():
        return mpu.get_pipeline_model_parallel_group() if mpu.get_pipeline_model_parallel_world_size() > 1 else None

    # -- OPOB --------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _opob_step(self, state: StepState, data: TensorDict):
        """`MegatronSequenceNorms` hooked for the step, and megatron's finalize_model_grads wrapped (module doc)."""
        if not state.opob:
            yield
            return
        self._check_opob_setting()
        model = unwrap_model(self.module[0])
        tied_across_stages = getattr(model, "share_embeddings_and_output_weights", False) and mpu.get_pipeline_model_parallel_world_size() > 1
        embedding_group = mpu.get_embedding_group() if tied_across_stages else None
        norms = MegatronSequenceNorms(model, mpu.get_tensor_model_parallel_group(), self._pipeline_group(), embedding_group)
        self._ids_for_tied_head = tied_across_stages and norms.last_stage and not norms.first_stage
        local_groups = torch.unique(data["vcpo_group"].cpu(), return_inverse=True)[1]
        num_groups = int(local_groups.max()) + 1 if local_groups.numel() else 1
        data["vcpo_local_group"] = local_groups.to(data["vcpo_group"].device)
        config: TransformerConfig = get_model_config(self.module[0])
        finalize = config.finalize_model_grads_func
        if state.opob_mode == "two_pass":  # pass 1: the norms alone; its gradients are dropped, never reduced
            config.finalize_model_grads_func = functools.partial(self._finalize_norms, state, norms)
        else:
            config.finalize_model_grads_func = functools.partial(self._finalize_opob, state, norms, finalize)
        self._norms = norms
        try:
            with norms.step(None if state.opob_mode == "two_pass" else num_groups):
                yield
        finally:
            config.finalize_model_grads_func = finalize
            self._norms = None

    def _check_opob_setting(self) -> None:
        """Refuse, by key, what OPOB cannot run with (`megatron_opob_refusals`, as the launcher's dry run does)."""
        config, engine = get_model_config(self.module[0]), self.engine_config
        setup = MegatronSetup(
            packed=bool(engine.use_remove_padding), fused_kernels=bool(getattr(engine, "use_fused_kernels", False)),
            transformer_impl=getattr(config, "transformer_impl", None),
            vanilla_mbridge=bool(engine.use_mbridge and engine.vanilla_mbridge),
            sequence_parallel=bool(getattr(config, "sequence_parallel", False)), virtual_pipeline=len(self.module),
            context_parallel=mpu.get_context_parallel_world_size(), pipeline_parallel=mpu.get_pipeline_model_parallel_world_size(),
            per_token_loss=bool(getattr(config, "calculate_per_token_loss", False)),
            overlap_grad_reduce=bool(getattr(getattr(self.module[0], "ddp_config", None), "overlap_grad_reduce", False)),
            dtype="float16" if self.param_dtype == torch.float16 else "bfloat16",
            recompute_granularity=getattr(config, "recompute_granularity", None),
            recompute_modules=None if getattr(config, "recompute_modules", None) is None else tuple(config.recompute_modules))
        refused = megatron_opob_refusals(setup)
        if refused:
            raise NotImplementedError("OPOB in the vcpo Megatron engine cannot run with this config; set " + "; ".join(refused))

    def forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
        state = self._step
        if state is None or not state.opob:
            return super().forward_step(batch_iter, model, logits_processor_func, postprocess_micro_batch_func)
        batch = next(batch_iter)
        size = len(batch)
        ids = None
        if self._ids_for_tied_head:  # the ids as the first stage's embedding sees them: verl's padded (BSHD) layout
            from verl.models.mcore.util import preprocess_bshd_engine

            forced = tu.get_non_tensor_data(data=batch, key="forced_max_seqlen", default=None)
            ids = preprocess_bshd_engine(batch["input_ids"], pre_process=True, forced_max_seqlen=forced)[0]
        # every stage: this micro-batch's rewards and groups, which its gradients h_i = c^S_i g_i are combined with
        self._norms.micro_batch(size, coef_r=batch["vcpo_reward"].double(), coef_s=torch.ones(size, dtype=torch.float64),
                                groups=batch["vcpo_local_group"], ids=ids)
        return super().forward_step(iter([batch]), model, logits_processor_func, postprocess_micro_batch_func)

    def _opob_loss(self, data: TensorDict, log_prob, behav, mask):
        """Σ_i c^S_i l_i for the backward (last stage), the coefficients recorded."""
        coefficients, scores, metric = opob_micro_batch(self._step, data, log_prob, behav, mask)
        return (coefficients.score.to(device=scores.device, dtype=scores.dtype) * scores).sum(), metric

    def _baseline(self, state: StepState, norms: MegatronSequenceNorms) -> torch.Tensor:
        """b* of this rank's sequences from every rank's ||g_i||² = ||c^S_i g_i||² / (c^S_i)² (the last stage's, broadcast
        over the stages); the step's OPOB metrics into ``state`` on the last stage."""
        pp_group = self._pipeline_group()
        last_stage = mpu.is_pipeline_last_stage(ignore_virtual=True)
        last_rank = dist.get_process_group_ranks(pp_group)[-1] if pp_group is not None else None
        count = norms.num_sequences
        coef_s = torch.cat(state.coef_s) if last_stage else torch.zeros(count, dtype=torch.float64)
        if pp_group is not None:
            coef_s = broadcast_here(coef_s, src=last_rank, group=pp_group)
        sq_scaled = norms.sq_norms().cpu()  # ||c^S_i g_i||²
        nonzero = coef_s != 0
        sq_norms = torch.where(nonzero, sq_scaled / torch.where(nonzero, coef_s, 1.0) ** 2, 0.0)
        baseline = torch.zeros(count, dtype=torch.float64)
        if last_stage:
            baseline, metrics = opob_baseline_over_ranks(state, sq_norms, self.get_data_parallel_group())
            state.metrics.update(metrics)
        if pp_group is not None:
            baseline = broadcast_here(baseline, src=last_rank, group=pp_group)
        return baseline

    def _finalize_norms(self, state: StepState, norms: MegatronSequenceNorms, *args, **kwargs) -> None:
        """two_pass, pass 1: the baseline for pass 2, and no reduction of pass 1's gradients."""
        self._two_pass_baseline = self._baseline(state, norms)

    def _finalize_opob(self, state: StepState, norms: MegatronSequenceNorms, finalize, *args, **kwargs) -> None:
        """The combined OPOB gradient over each parameter's main_grad, then megatron's own finalize."""
        baseline = self._baseline(state, norms)
        # megatron averages the gradient over the data-parallel ranks; the update is their sum
        ranks = mpu.get_data_parallel_world_size(with_context_parallel=True)
        for param, gradient in norms.combined(baseline):
            target = getattr(param, "main_grad", None)
            if target is None:
                param.grad = (gradient * ranks).to(param.dtype)
            else:
                target.copy_(gradient * ranks)
        finalize(*args, **kwargs)


__all__ = ["VcpoMegatronEngineWithLMHead"]
