"""What the vcpo engines do per optimizer step whatever the backend (FSDP, Megatron): the step's record, the
mini-batch ESS ratio, and OPOB's batch preparation, per-micro-batch coefficients and baseline over ranks.
The backends keep only where gradients live and how they are reduced."""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.utils.tensordict_utils import maybe_fix_3d_position_ids
from verl.workers.config import HFModelConfig

from vcpo.actor_memory import StepMemory, choose_mode, step_memory
from vcpo.core import (
    ess_ratio_over_ranks,
    offpolicy_diagnostics,
    opob_normaliser,
    opob_sequence_scores,
    scaled_learning_rate,
)
from vcpo.core.collectives import gather_objects
from vcpo.methods import StepRule
from vcpo.runs import EFFECTIVE_LR, LR_SCALE, SEQ_ESS_RATIO
from vcpo.verl_contract import metrics_to_floats
from vcpo.verl_plugin.engine.batch import padded, response_log_probs, reward_key, sequence_labels, sequence_log_weights
from vcpo.verl_plugin.engine.rule import check_opob_loss, opob_mode_from_loss_function, rule_from_loss_function

logger = logging.getLogger(__name__)


@dataclass
class StepState:
    """One optimizer step's record, per micro-batch in the order the forwards ran."""

    rule: StepRule
    opob: bool
    opob_mode: str = "single"  # OPOB's mode for this step (vcpo.actor_memory.OPOB_MODES)
    packed: bool = False
    fsdp2: list = field(default_factory=list)  # FSDP2 modules held unsharded for this OPOB step
    normaliser: float = 1.0
    stack: contextlib.ExitStack | None = None
    seq_log_weights: list[torch.Tensor] = field(default_factory=list)
    valid: list[torch.Tensor] = field(default_factory=list)
    rewards: list[torch.Tensor] = field(default_factory=list)
    groups: list[torch.Tensor] = field(default_factory=list)  # global baseline-group ids (over all DP ranks)
    lengths: list[torch.Tensor] = field(default_factory=list)  # response tokens per sequence
    coef_s: list[torch.Tensor] = field(default_factory=list)
    scores: list[torch.Tensor] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)  # each sequence's row in the mini-batch
    metrics: dict[str, float] = field(default_factory=dict)  # the step's own metrics (OPOB's), beside verl's

    def close_micro_batch(self) -> None:
        if self.stack is not None:
            stack, self.stack = self.stack, None
            stack.close()

    def abort(self) -> None:
        if self.stack is not None:
            stack, self.stack = self.stack, None
            with contextlib.suppress(BaseException):
                stack.__exit__(RuntimeError, RuntimeError("aborted"), None)

    def record_log_weights(self, log_prob: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor) -> None:
        self.seq_log_weights.append(sequence_log_weights(log_prob, behav, mask))
        self.valid.append(mask.any(-1))

    def ess_ratio(self, dp_group, pp_group=None) -> float:
        """ρ_ess of the mini-batch over every data-parallel rank (from the last pipeline stage, which has the
        log-probs: the same on every rank)."""
        local_s = torch.cat(self.seq_log_weights) if self.seq_log_weights else torch.zeros(0, dtype=torch.float64)
        local_v = torch.cat(self.valid) if self.valid else torch.zeros(0, dtype=torch.bool)
        return ess_ratio_over_ranks(local_s, local_v, dp_group=dp_group, pp_group=pp_group)


def rank_in(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def prepare_opob(data: TensorDict, state: StepState, group) -> None:
    """Per sequence of this rank's mini-batch, into ``data`` (so that every micro-batch carries them): its
    reward R_i (``vcpo_reward``), its baseline group numbered over all data-parallel ranks (``vcpo_group``)
    and that group's reward std (``vcpo_std``); the step's normaliser N (global count of sequences, or of
    tokens for token-mean) into ``state``."""
    rule = state.rule
    state.packed = bool(tu.get_non_tensor_data(data=data, key="use_remove_padding", default=True))
    mask = padded(data["response_mask"]).to(torch.bool)
    rewards = padded(data[reward_key(data)]).to(torch.float64).sum(-1)
    labels = sequence_labels(data) if rule.scope == "group" else [0] * len(data)
    parts = gather_objects((rewards.cpu(), labels, mask.any(-1).cpu(), mask.sum().item()), group)
    all_rewards = torch.cat([r for r, _, _, _ in parts])
    all_labels = [label for _, ls, _, _ in parts for label in ls]
    all_valid = torch.cat([v for _, _, v, _ in parts])
    tokens = sum(t for _, _, _, t in parts)
    ids = {label: i for i, label in enumerate(sorted(set(all_labels), key=str))}
    global_groups = torch.tensor([ids[label] for label in all_labels], dtype=torch.long)
    std = rule.reward_std(all_rewards, global_groups)
    start = sum(len(ls) for _, ls, _, _ in parts[: rank_in(group)])
    device = data["response_mask"].device
    data["vcpo_reward"] = rewards.to(device)
    data["vcpo_group"] = global_groups[start : start + len(data)].to(device)
    data["vcpo_std"] = std[start : start + len(data)].to(device)
    data["vcpo_position"] = torch.arange(len(data), device=device)  # follows each sequence into any micro-batch
    state.normaliser = opob_normaliser(rule.agg, tokens, int(all_valid.sum()))


def opob_micro_batch(state: StepState, data: TensorDict, log_prob, behav, mask):
    """The OPOB coefficients of one micro-batch's sequences from this forward's log-probs (recorded in
    ``state``), the per-sequence scores l_i (with their graph) and the loss's diagnostics as verl's metric."""
    rule = state.rule
    rewards = data["vcpo_reward"].double()
    coefficients = rule.coefficients(log_prob, behav, mask, rewards, data["vcpo_std"], state.normaliser)
    scores = opob_sequence_scores(log_prob, mask, rule.agg)
    r, weights = coefficients.log_ratio, coefficients.weights
    state.rewards.append(rewards.detach().cpu())
    state.positions.append(data["vcpo_position"].detach().cpu())
    state.groups.append(data["vcpo_group"].detach().cpu())
    state.lengths.append(mask.sum(-1).detach().cpu())
    state.coef_s.append(coefficients.score.detach().cpu())
    state.scores.append(scores.detach().double().cpu())
    # the loss's own diagnostics (ratio and KL statistics) under the names its verl loss logs; the step's
    # global seq_ess_ratio replaces this micro-batch's
    diagnostics = {**offpolicy_diagnostics(log_prob, behav, r, mask), **weights.metrics}
    diagnostics["actor/kept_token_frac"] = weights.keep.sum() / mask.sum().clamp_min(1)
    diagnostics.pop(SEQ_ESS_RATIO)
    return coefficients, scores, Metric.from_dict(metrics_to_floats(diagnostics), aggregation=AggregationType.MEAN)


def sequence_lengths(data: TensorDict) -> torch.Tensor:
    """Tokens of every sequence of ``data``: the nested (no-padding) ``input_ids``' segments, as verl's trainer hands
    them over, else the attention mask's."""
    ids = data["input_ids"]
    if getattr(ids, "is_nested", False):
        return ids.offsets().diff().cpu()
    if "attention_mask" in data.keys():
        return padded(data["attention_mask"]).sum(-1).cpu()
    return torch.full((len(data),), ids.shape[-1])


def micro_batch_tokens(data: TensorDict) -> int:
    """Tokens of the largest micro-batch verl will form of ``data``: its token budget under dynamic batch sizes,
    else the largest run of ``micro_batch_size_per_gpu`` consecutive sequences."""
    lengths = sequence_lengths(data)
    if tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=False):
        budget = tu.get_non_tensor_data(data=data, key="max_token_len_per_gpu", default=None)
        return int(lengths.sum()) if budget is None else min(int(lengths.sum()), max(int(budget), int(lengths.max())))
    micro = int(tu.get_non_tensor_data(data=data, key="micro_batch_size_per_gpu", default=len(data)))
    return max(int(lengths[start : start + micro].sum()) for start in range(0, len(data), micro))


def choose_opob_mode(state: StepState, loss_function, memory: StepMemory, logged: list) -> None:
    """OPOB's mode for this step into ``state`` (``policy_loss.opob_mode``, auto: by the memory model, with this
    GPU's memory when there is one), its metric ``actor/opob_two_pass``, and a log line whenever the choice or its
    reason changes (``logged``: the engine's last one, a one-element list)."""
    capacity = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        capacity = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    state.opob_mode, why = choose_mode(memory, opob_mode_from_loss_function(loss_function), capacity)
    state.metrics["actor/opob_two_pass"] = float(state.opob_mode == "two_pass")
    if logged[0] != (state.opob_mode, why):
        logged[0] = (state.opob_mode, why)
        logger.warning("vcpo engine: OPOB runs %s (%s)", state.opob_mode, why)


def second_pass(engine, data: TensorDict, state: StepState, baseline: torch.Tensor, scale: float) -> None:
    """two_pass's second pass: the engine's plain step of Σ_i a_i l_i, a_i = ``scale`` · c^S_i (R_i − b_i) of every
    sequence the first pass's forwards saw (0 for the others: a pipeline stage without the loss), each at its row of
    the mini-batch (``vcpo_weight``), whatever micro-batches the engine forms. ``scale``: the data-parallel size where
    the engine's gradient reduction averages over the ranks, as verl's own losses do."""
    weights = torch.zeros(len(data), dtype=torch.float64)
    if state.positions:
        weights[torch.cat(state.positions)] = scale * torch.cat(state.coef_s) * (torch.cat(state.rewards) - baseline)
    data["vcpo_weight"] = weights.to(data["vcpo_reward"].device)
    state.opob = False  # the engine's forward_step runs as verl's, without the per-sequence handlers
    try:
        engine.forward_backward_batch(data, functools.partial(weighted_scores, agg=state.rule.agg), forward_only=False)
    finally:
        state.opob = True


def weighted_scores(model_output, data: TensorDict, dp_group=None, *, agg: str):
    """The second pass's loss: Σ_i a_i l_i, a_i the ``vcpo_weight`` `second_pass` set and l_i the loss aggregation's
    per-sequence score, for verl's plain backward."""
    log_prob, _, mask = response_log_probs(model_output, data)
    scores = opob_sequence_scores(log_prob, mask, agg)
    return (data["vcpo_weight"].to(scores.dtype) * scores).sum(), {}


def opob_baseline_over_ranks(state: StepState, sq_norms: torch.Tensor, group) -> tuple[torch.Tensor, dict[str, float]]:
    """b* from the per-sequence squared norms, log-weights, rewards and groups of every data-parallel rank
    (``sq_norms`` of this rank's sequences in micro-batch order); this rank's slice of it, and the step's
    OPOB metrics."""
    rule = state.rule
    local = (
        sq_norms.cpu(),
        torch.cat(state.seq_log_weights).cpu(),
        torch.cat(state.rewards),
        torch.cat(state.groups) if rule.scope == "group" else None,
        torch.cat(state.coef_s) * torch.cat(state.scores),
        torch.cat(state.lengths),
    )
    parts = gather_objects(local, group)
    all_norms, all_s, all_rewards = (torch.cat([p[k] for p in parts]) for k in range(3))
    all_groups = torch.cat([p[3] for p in parts]) if rule.scope == "group" else None
    all_lengths = torch.cat([p[5] for p in parts])
    baseline = rule.baseline(all_rewards, all_norms, all_s, all_groups, all_lengths)
    start = sum(p[0].shape[0] for p in parts[: rank_in(group)])
    # the loss whose gradient the update is: Σ_i c^S_i (R_i − b_i) l_i over all ranks
    pg_loss = float((torch.cat([p[4] for p in parts]) * (all_rewards - baseline)).sum())
    norms = all_norms.sqrt()
    metrics = {
        "actor/pg_loss": pg_loss,
        "actor/opob_baseline": float(baseline.mean()),
        "actor/seq_grad_norm_mean": float(norms.mean()),
        "actor/seq_grad_norm_max": float(norms.max()),
        "actor/seq_grad_norm_min": float(norms.min()),
        "actor/opob_packed": float(state.packed),
    }
    return baseline[start : start + sq_norms.shape[0]], metrics


def recording_loss(loss_function, state: StepState, opob_loss):
    """verl's loss (or, for OPOB, ``opob_loss(data, log_prob, behav, mask)``) plus a record of s_i per micro-batch."""

    def loss(model_output, data, dp_group=None):
        log_prob, behav, mask = response_log_probs(model_output, data)
        state.record_log_weights(log_prob, behav, mask)
        if state.opob:
            return opob_loss(data, log_prob, behav, mask)
        return loss_function(model_output=model_output, data=data, dp_group=dp_group)

    loss.keywords = getattr(loss_function, "keywords", {})
    return loss


def active_rule(data: TensorDict, loss_function) -> StepRule | None:
    """The preset's rule for this optimizer step, or None where verl's own step is the method's; refuses what the
    vcpo step does not support."""
    rule = rule_from_loss_function(loss_function)
    if rule is None or not rule.active:
        return None
    if tu.get_non_tensor_data(data=data, key="distillation_use_topk", default=False):
        raise NotImplementedError("the vcpo engine's ESS/OPOB step does not support top-K distillation")
    maybe_fix_3d_position_ids(data)
    return rule


class VcpoEngine:
    """What both vcpo engines (FSDP, Megatron) add to verl's LM engine, placed before it in their bases: they are
    selected by their model type, then built and run as verl's language model; the current step's record, opened
    alike whatever the backend; the last (mode, reason) of OPOB logged."""

    def __init__(self, model_config: HFModelConfig, *args, **kwargs):
        model_config.model_type = "language_model"
        super().__init__(model_config, *args, **kwargs)
        self._step: StepState | None = None
        self._opob_mode_logged: list = [None]

    def _open_step(self, rule: StepRule, data: TensorDict, loss_function, group, check_setting=None) -> StepState:
        """The step's record for ``rule``, kept as the current step: with OPOB, the loss and the engine's setting
        checked (``check_setting(rule)``, the backend's own refusals), the batch prepared and the mode chosen by the
        memory model (the backend's ``_memory_inputs(data)``); then the gradients zeroed."""
        state = StepState(rule=rule, opob=rule.opob)
        if rule.opob:
            check_opob_loss(loss_function)
            if check_setting is not None:
                check_setting(rule)
            prepare_opob(data, state, group)
            choose_opob_mode(state, loss_function, step_memory(*self._memory_inputs(data)), self._opob_mode_logged)
        self.optimizer_zero_grad()
        self._step = state
        return state


def scaled_optimizer_step(engine, state: StepState, ratio: float, outputs: dict) -> dict:
    """The engine's optimizer step with the learning rate scaled by the rule for ρ_ess, and the step's metrics
    into verl's outputs on the rank that reports them."""
    scale = state.rule.lr_scale(ratio)
    lr = engine.optimizer.param_groups[0]["lr"]
    with scaled_learning_rate(engine.optimizer, scale):
        grad_norm = engine.optimizer_step()
    if engine.is_mp_src_rank_with_outputs():
        step_metrics(outputs, state.rule, ratio, scale, lr, grad_norm, state.metrics)
    return outputs


def step_metrics(outputs: dict, rule: StepRule, ratio: float, scale: float, lr: float, grad_norm, extra: dict[str, float]) -> None:
    """The step's metrics into verl's outputs (on the rank that reports them): one entry per step, as a list
    like verl's per-micro-batch metrics (the worker flattens lists)."""
    metrics = outputs["metrics"]
    assert "grad_norm" not in metrics
    metrics["grad_norm"] = grad_norm
    extra = {**extra, SEQ_ESS_RATIO: ratio, LR_SCALE: scale, EFFECTIVE_LR: lr * scale}
    if rule.opob:
        # verl's "loss" (summed over micro-batches, averaged over ranks) would be that of the backward's scores here
        outputs["loss"] = [extra["actor/pg_loss"]]
    metrics.update({name: [value] for name, value in extra.items()})
