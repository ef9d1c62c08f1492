"""verl's naive reward manager that tells the reward whether each response ended or was cut at the length limit.

Why: verl decodes a response without its special tokens before calling the reward function, so the function cannot
tell a response that ended (its last token is an end-of-sequence token) from one the length limit cut; the lenient
answer format reads a cut response as strict (``vcpo.rewards.scoring.format_for``). This manager sets
``extra_info["response_ended"]`` and then runs verl's own. Select it with the Hydra overrides
``vcpo.verl_contract.END_AWARE_REWARD_MANAGER``.
"""

from __future__ import annotations

from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager

from vcpo.rewards import RESPONSE_ENDED


def end_token_ids(tokenizer) -> set[int]:
    """The tokenizer's end of sequence and its model's generation config's (where the folder has one)."""
    from transformers import GenerationConfig

    ids = {tokenizer.eos_token_id} - {None}
    try:
        eos = GenerationConfig.from_pretrained(tokenizer.name_or_path).eos_token_id
    except (OSError, ValueError):  # no generation_config.json
        eos = None
    ids |= set(eos if isinstance(eos, list | tuple) else [eos]) - {None}
    return ids


def response_ended(response_ids, attention_mask, end_ids: set[int]) -> bool:
    """Whether the response (right-padded ``response_ids``, the sample's full ``attention_mask``) ends with an end id."""
    length = int(attention_mask[-response_ids.shape[-1]:].sum())
    return length > 0 and int(response_ids[length - 1]) in end_ids


class EndAwareRewardManager(NaiveRewardManager):
    def __init__(self, config, tokenizer, compute_score, **kwargs):
        super().__init__(config, tokenizer, compute_score, **kwargs)
        self.end_ids = end_token_ids(tokenizer)

    async def run_single(self, data) -> dict:
        item = data[-1]  # what verl's manager scores: the last sequence
        info = item.non_tensor_batch.get("extra_info")
        if not isinstance(info, dict):
            raise ValueError("EndAwareRewardManager: the sample has no extra_info dict to carry response_ended")
        info[RESPONSE_ENDED] = response_ended(item.batch["responses"], item.batch["attention_mask"], self.end_ids)
        return await super().run_single(data)
