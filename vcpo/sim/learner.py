"""One optimizer step of the simulator: advantages, the policy loss, OPOB, the ESS step size, AdamW.

The math is not here. Losses come from verl's registry (``get_policy_loss_fn``: the vcpo plugin's
losses and verl's own vanilla / GSPO / CISPO / SAPO), called with ``old_log_prob`` = the behaviour
log-probs (verl's bypass semantics); GRPO and OTB advantages are verl's estimators; OPOB, the ESS
rule, KL-in-reward and the off-policy diagnostics are ``vcpo.core`` functions. OPOB presets form
their gradient with ``vcpo.core.PerSequenceGradients`` in one backward pass (docs/ALGORITHMS.md §4):

    loss gradient = −(1/B) Σ_i w_i (R_i − b_g(i)) / σ_g(i) · ∇ l_i,   b from VCPO Eq. 7 on ||∇ l_i||²

with w_i the preset's sequence weight (min(w_i, 8) for VCPO), l_i the per-sequence score the loss
aggregates (mean_t l^θ for seq-mean-token-mean) and σ_g the group's reward std (norm_by_std). The
registry loss is then evaluated, without a second backward, on the same log-probs with those
advantages for its value and metrics: its autograd gradient is the same vector (tested).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn
from verl.workers.config import PolicyLossConfig
from verl.workers.config.actor import FSDPActorConfig

from vcpo.core import (
    PerSequenceGradients,
    ess_ratio,
    kl_in_reward,
    offpolicy_diagnostics,
    opob_normaliser,
    opob_sequence_scores,
    scaled_learning_rate,
    sequence_log_ratio,
    token_log_ratio,
)
from vcpo.core.registry import POLICY_LOSSES
from vcpo.methods import VERL_POLICY_LOSSES, Method, StepRule, step_rule
from vcpo.runs import EFFECTIVE_LR, LR_SCALE
from vcpo.sim.rollout import TOOL_TOKEN, Trajectory
from vcpo.verl_contract import step_rule_applied
from vcpo.verl_plugin import VcpoPolicyLossConfig


@dataclass
class Batch:
    """A consumed batch as tensors: prompts left-padded to P, responses right-padded to R."""

    input_ids: torch.Tensor  # (B, P + R)
    attention_mask: torch.Tensor  # (B, P + R)
    position_ids: torch.Tensor  # (B, P + R)
    prompt_width: int
    response_ids: torch.Tensor  # (B, R)
    mask: torch.Tensor  # (B, R) bool: policy-generated tokens (tool output and padding excluded)
    behav_log_prob: torch.Tensor  # (B, R) in the learner's precision, 0 where not mask
    sum_pi_squared: torch.Tensor  # (B, R)
    versions: torch.Tensor  # (B, R) long, TOOL_TOKEN / -2 where not generated
    rewards: torch.Tensor  # (B,) float32 task rewards
    groups: torch.Tensor  # (B,) long prompt-group labels

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, start: int, stop: int) -> Batch:
        return Batch(
            **{
                name: value[start:stop] if isinstance(value, torch.Tensor) else value
                for name, value in vars(self).items()
            }
        )


def collate(
    trajectories: list[Trajectory], rewards: list[float], pad_token_id: int, dtype: torch.dtype = torch.float32
) -> Batch:
    """Tensors of a batch; log-probs in ``dtype``, the learner's precision (float32 or float64)."""
    prompt_width = max(len(t.prompt_ids) for t in trajectories)
    response_width = max(1, max(len(t.response_ids) for t in trajectories))
    size = len(trajectories)
    input_ids = torch.full((size, prompt_width + response_width), pad_token_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    behav = torch.zeros((size, response_width), dtype=dtype)
    sum_pi_squared = torch.zeros_like(behav)
    versions = torch.full((size, response_width), -2, dtype=torch.long)
    for row, t in enumerate(trajectories):
        prompt, response = len(t.prompt_ids), len(t.response_ids)
        input_ids[row, prompt_width - prompt : prompt_width] = torch.tensor(t.prompt_ids)
        input_ids[row, prompt_width : prompt_width + response] = torch.tensor(t.response_ids, dtype=torch.long)
        attention[row, prompt_width - prompt : prompt_width + response] = 1
        behav[row, :response] = torch.tensor(t.behav_log_probs)
        sum_pi_squared[row, :response] = torch.tensor(t.sum_pi_squared)
        versions[row, :response] = torch.tensor(t.versions, dtype=torch.long)
    mask = versions >= 0
    return Batch(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=(attention.cumsum(-1) - 1).clamp_min(0),
        prompt_width=prompt_width,
        response_ids=input_ids[:, prompt_width:],
        mask=mask,
        behav_log_prob=torch.where(mask, behav, 0.0),
        sum_pi_squared=sum_pi_squared,
        versions=versions,
        rewards=torch.tensor(rewards, dtype=dtype),
        groups=torch.tensor([t.group for t in trajectories], dtype=torch.long),
    )


def response_log_probs(model, batch: Batch, temperature: float) -> torch.Tensor:
    """l^θ of every response token, (B, R) in float32 or better, from one forward of the learner."""
    logits = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
    ).logits
    logits = logits[:, batch.prompt_width - 1 : -1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    return torch.where(batch.mask, log_probs, torch.zeros_like(log_probs))


def last_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's token_level_rewards: the sequence reward at its last generated token."""
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    last = torch.where(mask, positions, -1).amax(-1)
    token_rewards = torch.zeros(mask.shape, dtype=torch.float32)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    token_rewards[rows, last[rows]] = rewards[rows].float()
    return token_rewards


def warmup_stable_decay(step: int, total: int, warmup: int, decay: int) -> float:
    """LR multiplier: linear warmup over ``warmup`` steps, constant, linear decay to 0 over the last ``decay``."""
    if step < warmup:
        return (step + 1) / warmup
    if decay and step >= total - decay:
        return max(0.0, (total - step) / decay)
    return 1.0


class Learner:
    """The policy being trained, its optimizer and the method's update rule. ``base_lr`` (the optimizer's rate before
    the schedule and the ESS scale) and ``rule`` (the step rule at the run's rho_on) default to what ``config`` and
    ``method`` give; the trainer hands on its resolved run's (`vcpo.sim.validation.ResolvedRun`)."""

    def __init__(self, model, method: Method, config, *, base_lr: float | None = None, rule: StepRule | None = None,
                 ref_model=None):
        self.model, self.method, self.config, self.ref_model = model, method, config, ref_model
        self.base_lr = config.base_lr if base_lr is None else base_lr
        self.rule = step_rule(method).with_rho_on(config.rho_on) if rule is None else rule
        spec = method.spec
        self.loss_name, self.agg = method.loss_name, spec["loss"]["agg"]
        self.estimator, self.adv_params = spec["advantage"]["estimator"], spec["advantage"]["params"]
        self.kl_beta = spec.get("kl_in_reward_beta")
        self.policy_loss = get_policy_loss_fn(self.loss_name)
        self.needs_prox = getattr(POLICY_LOSSES.get(self.loss_name), "needs_prox", False)
        self.actor_config = self._actor_config()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=self.base_lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay
        )
        self.opob = PerSequenceGradients(model, combination=config.opob_combination) if self.rule.opob else None

    def _actor_config(self) -> FSDPActorConfig:
        if self.loss_name in VERL_POLICY_LOSSES:
            verl_params, policy_loss = self.method.loss_params, PolicyLossConfig(loss_mode=self.loss_name)
        else:
            verl_params = {}
            policy_loss = VcpoPolicyLossConfig(loss_mode=self.loss_name, method=self.method.name)
        return FSDPActorConfig(
            strategy="fsdp",
            rollout_n=self.config.responses_per_prompt,
            ppo_mini_batch_size=self.config.prompts_per_step,
            ppo_micro_batch_size_per_gpu=self.config.micro_batch_size,
            use_dynamic_bsz=False,
            loss_agg_mode=self.agg,
            policy_loss=policy_loss,
            **verl_params,
        )

    # -- rewards and advantages ------------------------------------------------------------------
    @torch.no_grad()
    def shaped_rewards(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """R' = R − β·Σ_t (l^μ − l^ref) with the frozen reference (VCPO App. E.3), else R.

        The KL uses the behaviour log-probs, as verl's in-reward penalty uses the rollout-time
        log-probs (old_log_prob in bypass mode), so the reward is fixed before the update.
        """
        if not self.kl_beta:
            return batch.rewards, {}
        ref = response_log_probs(self.ref_model, batch, self.config.temperature)
        shaped = kl_in_reward(batch.rewards, batch.behav_log_prob, ref, batch.mask, self.kl_beta)
        kl = (shaped - batch.rewards) / -self.kl_beta
        return shaped, {"actor/reward_kl_penalty": float(kl.mean()), "critic/rewards/mean": float(shaped.mean())}

    def advantages(self, batch: Batch, rewards: torch.Tensor) -> torch.Tensor | None:
        """Token-level advantages from verl's estimator; None for OPOB (formed during the backward)."""
        if self.rule.opob:
            return None
        token_rewards = last_token_rewards(rewards, batch.mask)
        index = np.array(batch.groups.tolist())
        estimator = get_adv_estimator_fn(self.estimator)
        if self.estimator == "grpo":
            advantages, _ = estimator(
                token_rewards, batch.mask.float(), index, norm_adv_by_std_in_grpo=self.adv_params["norm_by_std"]
            )
        else:  # optimal_token_baseline: π_t and Σπ² of the behaviour policy, recorded at generation
            advantages, _ = estimator(token_rewards, batch.mask.float(), index, batch.behav_log_prob, batch.sum_pi_squared)
        return advantages

    # -- the update ------------------------------------------------------------------------------
    def update(self, batch: Batch, schedule_factor: float, prox_log_prob: torch.Tensor | None = None,
               step_scale: float | None = None) -> dict[str, float]:
        """One optimizer step on ``batch``; returns its metrics (verl names). ``schedule_factor``: the warm-up and decay
        schedule's multiplier of the base rate at this step; ``step_scale`` replaces the ESS rule's factor (its logged
        ``actor/lr_scale``; a replayed one, ``SimConfig.lr_scale_from``)."""
        timings = {}
        started = time.perf_counter()
        rewards, metrics = self.shaped_rewards(batch)
        advantages = self.advantages(batch, rewards)
        timings["timing_s/advantage"] = time.perf_counter() - started

        valid_rows = batch.mask.any(-1)
        self.actor_config.global_batch_info.update(
            dp_size=1, batch_num_tokens=int(batch.mask.sum()), global_batch_size=int(valid_rows.sum())
        )
        if self.opob is not None:
            log_prob, loss_metrics = self._opob_backward(batch, rewards, timings)
        else:
            log_prob, loss_metrics = self._loss_backward(batch, advantages, prox_log_prob, timings)

        started = time.perf_counter()
        r = token_log_ratio(log_prob, batch.behav_log_prob, batch.mask)
        seq_log_weights = sequence_log_ratio(r, batch.mask)
        ess = float(ess_ratio(seq_log_weights, valid_rows))
        scale = self.rule.lr_scale(ess) if step_scale is None else step_scale
        for group in self.optimizer.param_groups:
            group["lr"] = self.base_lr * schedule_factor
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.config.grad_clip))
        if math.isfinite(grad_norm):
            with scaled_learning_rate(self.optimizer, scale):
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        timings["timing_s/optimizer"] = time.perf_counter() - started

        advantage_mean = loss_metrics.pop("_adv_mean", 0.0)
        diagnostics = offpolicy_diagnostics(log_prob, batch.behav_log_prob, r, batch.mask)
        metrics.update({name: float(value) for name, value in diagnostics.items()})
        metrics.update(loss_metrics)
        metrics.update(timings)
        metrics.update(
            {
                "actor/grad_norm": grad_norm,
                "actor/grad_norm_finite": float(math.isfinite(grad_norm)),
                "actor/lr": self.base_lr * schedule_factor,
                LR_SCALE: scale,
                EFFECTIVE_LR: self.base_lr * schedule_factor * scale,
                "critic/score/mean": float(batch.rewards.mean()),
                "critic/advantages/mean": advantage_mean,
            }
        )
        metrics.setdefault("critic/rewards/mean", float(rewards.mean()))
        return metrics

    def _micro_batches(self, batch: Batch):
        """(first row, micro-batch) of consecutive rows; micro_batch_size holds whole groups."""
        size = self.config.micro_batch_size
        for start in range(0, batch.size, size):
            yield start, batch.rows(start, min(start + size, batch.size))

    def _loss_backward(self, batch, advantages, prox_log_prob, timings):
        forward = backward = 0.0
        log_probs, metric_sums, count = [], {}, 0
        for start, mb in self._micro_batches(batch):
            stop = start + mb.size
            started = time.perf_counter()
            log_prob = response_log_probs(self.model, mb, self.config.temperature)
            loss, metrics = self._call_loss(mb, log_prob, advantages[start:stop], None if prox_log_prob is None else prox_log_prob[start:stop])
            forward += time.perf_counter() - started
            started = time.perf_counter()
            loss.backward()
            backward += time.perf_counter() - started
            log_probs.append(log_prob.detach())
            for name, value in metrics.items():
                metric_sums[name] = metric_sums.get(name, 0.0) + float(value)
            count += 1
        timings["timing_s/forward"], timings["timing_s/backward"] = forward, backward
        metrics = {name: value / count for name, value in metric_sums.items()}
        metrics["_adv_mean"] = float(advantages[batch.mask].mean()) if batch.mask.any() else 0.0
        return torch.cat(log_probs), metrics

    def _call_loss(self, mb: Batch, log_prob, advantages, prox_log_prob):
        with step_rule_applied():  # this learner applies the preset's ESS step size and OPOB in `update`
            return self._policy_loss(mb, log_prob, advantages, prox_log_prob)

    def _policy_loss(self, mb: Batch, log_prob, advantages, prox_log_prob):
        if self.needs_prox:
            # decoupled convention of the plugin: old = proximal, rollout_is_weights = π_prox / π_b untruncated
            prox = log_prob.detach() if prox_log_prob is None else prox_log_prob
            weights = torch.exp(torch.where(mb.mask, prox - mb.behav_log_prob, 0.0))
            return self.policy_loss(
                old_log_prob=prox, log_prob=log_prob, advantages=advantages, response_mask=mb.mask,
                loss_agg_mode=self.agg, config=self.actor_config, rollout_is_weights=weights,
            )
        return self.policy_loss(
            old_log_prob=mb.behav_log_prob, log_prob=log_prob, advantages=advantages, response_mask=mb.mask,
            loss_agg_mode=self.agg, config=self.actor_config,
        )

    def _opob_backward(self, batch: Batch, rewards: torch.Tensor, timings):
        """OPOB with one backward: G_R and G_S accumulate per micro-batch, the baseline comes after."""
        rule = self.rule
        scope_group = rule.scope == "group"
        normaliser = opob_normaliser(rule.agg, int(batch.mask.sum()), int(batch.mask.any(-1).sum()))
        std = rule.reward_std(rewards, batch.groups)
        forward = backward = 0.0
        log_probs, norms, baselines = [], [], []
        for start, mb in self._micro_batches(batch):
            stop = start + mb.size
            zeros = torch.zeros(mb.size, dtype=torch.float64)
            with self.opob.micro_batch(zeros, zeros, groups=mb.groups if scope_group else None):
                started = time.perf_counter()
                log_prob = response_log_probs(self.model, mb, self.config.temperature)
                coefficients = rule.coefficients(
                    log_prob, mb.behav_log_prob, mb.mask, rewards[start:stop], std[start:stop], normaliser
                )
                self.opob.set_coefficients(coefficients.reward, coefficients.score)
                scores = opob_sequence_scores(log_prob, mb.mask, self.agg)
                forward += time.perf_counter() - started
                started = time.perf_counter()
                scores.sum().backward()
                backward += time.perf_counter() - started
            sq_norms = self.opob.sq_norms
            if scope_group:
                seq_log_weights = sequence_log_ratio(coefficients.log_ratio, mb.mask)
                baseline = rule.baseline(rewards[start:stop], sq_norms, seq_log_weights, mb.groups, mb.mask.sum(-1))
                self.opob.combine(baseline)
                baselines.append(baseline)
            log_probs.append(log_prob.detach())
            norms.append(sq_norms)
        log_prob = torch.cat(log_probs)
        sq_norms = torch.cat(norms)
        if not scope_group:
            r = token_log_ratio(log_prob, batch.behav_log_prob, batch.mask)
            baseline = rule.baseline(rewards, sq_norms, sequence_log_ratio(r, batch.mask), None, batch.mask.sum(-1))
            self.opob.combine(baseline)
            baselines.append(baseline)
        baseline = torch.cat(baselines)
        timings["timing_s/forward"], timings["timing_s/backward"] = forward, backward
        # The registry loss on the same log-probs with A_i = (R_i − b)/σ: its value and metrics.
        advantages = ((rewards.double() - baseline) / std).to(log_prob.dtype).unsqueeze(-1) * batch.mask
        _, metrics = self._call_loss(batch, log_prob, advantages, None)
        metrics = {name: float(value) for name, value in metrics.items()}
        metrics["_adv_mean"] = float(advantages[batch.mask].mean()) if batch.mask.any() else 0.0
        metrics["actor/opob_baseline"] = float(baseline.mean())
        metrics["actor/seq_grad_norm_mean"] = float(sq_norms.sqrt().mean())
        metrics["actor/seq_grad_norm_max"] = float(sq_norms.sqrt().max())
        return log_prob, metrics


def token_lags(batch: Batch, step: int) -> torch.Tensor:
    """step − version of every generated token (tool and padding tokens excluded)."""
    return step - batch.versions[batch.versions >= 0]


__all__ = ["TOOL_TOKEN", "Batch", "Learner", "collate", "response_log_probs", "token_lags", "warmup_stable_decay"]
