"""Batch and data-parallel helpers of the engine: padded views of verl's packed tensors, prompt-group
labels, log-probs and sequence log-weights of a micro-batch, rewards, and gathers across ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import no_padding_2_padding

from vcpo.core import sequence_log_ratio, token_log_ratio
from vcpo.core.per_sequence_grads.reductions import widened


def all_reduce_gradients(params: list[torch.Tensor], group) -> None:
    """Sum p.grad over the group with ONE all-reduce of a flat buffer (VCPO App. C)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    # summed in float32 when the gradients are bf16 / fp16 (FSDP2's reduce dtype), written back in theirs
    flat = torch.cat([widened(g.reshape(-1)) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def padded(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_padded_tensor(0.0) if getattr(tensor, "is_nested", False) else tensor


def sequence_labels(data: TensorDict) -> list:
    """Prompt-group label per sequence: verl's ``uid`` (non-tensor), or a ``uid`` tensor."""
    if "uid" not in data.keys():
        raise KeyError("OPOB with scope 'group' needs the prompt-group labels 'uid' in the actor's batch")
    uid = data["uid"] if isinstance(data.get("uid"), torch.Tensor) else tu.get(data, "uid")
    if isinstance(uid, torch.Tensor):
        return uid.tolist()
    if hasattr(uid, "tolist"):
        return list(uid.tolist())
    return list(uid)


def response_log_probs(model_output: dict, data: TensorDict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(l^θ with grad, l^μ, mask) on the response tokens, (B, R) padded, as verl's ppo_loss slices them."""
    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    selected = data.select("response_mask", "old_log_probs").to_padded_tensor()
    mask = selected["response_mask"].to(torch.bool)
    return log_prob, selected["old_log_probs"], mask


def sequence_log_weights(log_prob: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r = token_log_ratio(log_prob, behav, mask)
    return sequence_log_ratio(r, mask).to(torch.float64)


def reward_key(data: TensorDict) -> str:
    """The per-token reward field OPOB sums: verl's V1 trainer writes ``token_level_rewards`` back only with a
    KL-in-reward penalty; otherwise they equal the reward loop's ``rm_scores``."""
    for key in ("token_level_rewards", "rm_scores"):
        if key in data.keys():
            return key
    raise KeyError(f"OPOB needs the per-token rewards (token_level_rewards or rm_scores); the batch has {sorted(data.keys())}")
