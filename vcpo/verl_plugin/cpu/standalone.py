"""verl 0.9.1's FSDP actor engine in this process, on CPU through the platform plugin, without Ray or the
trainer: the engine verl's registry builds for the vcpo model type, and actor mini-batches as the trainer
hands them over (the engine tests and benchmarks/opob_engine.py).

Select the platform before anything imports verl (`vcpo.verl_contract.select_cpu_platform`); then
`build_engine` runs verl's own ``initialize()`` (HF load, FSDP2 wrapping on gloo, optimizer) and
``train_batch(data, ppo_loss)`` is verl's step with the vcpo loss and engine.

`build_megatron_engine` does the same for verl's Megatron engine (backend ``megatron``, mbridge, bf16,
padded path) on the ranks of this process group, with the CPU shims of `vcpo.verl_plugin.cpu.megatron`;
`actor_config` given that engine is the actor config verl binds to ``ppo_loss`` for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from verl.trainer.config import CheckpointConfig
from verl.utils import tensordict_utils as tu
from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
from verl.workers.config.actor import FSDPActorConfig, McoreActorConfig
from verl.workers.engine import EngineRegistry
from verl.workers.utils.padding import left_right_2_no_padding

from vcpo.local_models import random_qwen2
from vcpo.recipes import megatron_local_layers
from vcpo.upstream import require
from vcpo.verl_contract import ENGINE_MODEL_TYPE, FP32_MIXED_PRECISION
from vcpo.verl_plugin import VcpoPolicyLossConfig
from vcpo.verl_plugin.engine.fsdp import VcpoFSDPEngineWithLMHead

require("standalone_engines")


def save_random_qwen2(path: str | Path, seed: int = 0, vocab_size: int = 96, **shape) -> Path:
    """``vcpo.local_models.random_qwen2`` (hidden 32 and MLP 64 unless ``shape`` says otherwise) saved for
    ``from_pretrained`` with SDPA attention."""
    model = random_qwen2(vocab_size, seed=seed, **{"hidden_size": 32, "intermediate_size": 64, **shape})
    model.config._attn_implementation = "sdpa"
    model.save_pretrained(path)
    return Path(path)


def build_engine(
    model_dir: str | Path,
    remove_padding: bool,
    lr: float = 1e-3,
    mixed_precision: dict | None = None,
) -> VcpoFSDPEngineWithLMHead:
    """The engine verl's registry returns for ``model_type=vcpo_language_model``, initialised by verl
    (its module wrapped with FSDP2 over this process's group); ``mixed_precision`` (default fp32
    throughout) as verl's fsdp_config gives it."""
    model_config = HFModelConfig(
        path=str(model_dir),
        use_remove_padding=remove_padding,
        enable_gradient_checkpointing=False,
        override_config={"attn_implementation": "sdpa"},
        load_tokenizer=False,
    )
    model_config.model_type = ENGINE_MODEL_TYPE  # what +actor_rollout_ref.model.model_type=vcpo_language_model sets
    cls = EngineRegistry.get_engine_cls(ENGINE_MODEL_TYPE, "fsdp2")
    engine = cls(
        model_config=model_config,
        engine_config=FSDPEngineConfig(
            strategy="fsdp2",
            model_dtype="fp32",
            use_torch_compile=False,
            mixed_precision=mixed_precision or FP32_MIXED_PRECISION,
        ),
        optimizer_config=FSDPOptimizerConfig(lr=lr, clip_grad=1e9, weight_decay=0.0),
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return engine


def actor_config(method: str, batch: int, group: int, micro: int, megatron_engine=None,
                 opob_mode: str = "auto") -> FSDPActorConfig | McoreActorConfig:
    """The actor config verl binds to ``ppo_loss`` (``policy_loss.method`` selects the engine's rule, and
    ``policy_loss.opob_mode`` OPOB's mode): FSDP2's, or for a ``megatron_engine`` (`build_megatron_engine`) verl's
    ``McoreActorConfig`` carrying its engine config."""
    cls, strategy, extra = FSDPActorConfig, "fsdp2", {}
    if megatron_engine is not None:
        cls, strategy, extra = McoreActorConfig, "megatron", {"megatron": megatron_engine.engine_config}
    return cls(
        strategy=strategy,
        rollout_n=group,
        ppo_mini_batch_size=batch // group,
        ppo_micro_batch_size_per_gpu=micro,
        use_dynamic_bsz=False,
        loss_agg_mode="seq-mean-token-mean",
        policy_loss=VcpoPolicyLossConfig(loss_mode="seq_tis", method=method, opob_mode=opob_mode),
        **extra,
    )


def build_megatron_engine(
    model_dir: str | Path,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    lr: float = 1e-3,
    model_type: str = "language_model",
    use_distributed_optimizer: bool = False,
    seed: int = 42,
):
    """The engine verl's registry returns for ``(model_type, "megatron")`` on the cpu device, initialised
    by verl's own ``initialize()`` (mbridge builds the megatron-core GPTModel, loads the HF weights, wraps it
    in megatron's DDP and Float16Module; megatron's optimizer), on the ranks of this process group
    (world size = data x ``tensor_parallel`` x ``pipeline_parallel``). bf16 parameters with fp32 main
    parameters and gradients (the engine accepts bf16/fp16 only, and verl's fp16 turns on megatron's
    precision-aware optimizer, which needs Transformer Engine), megatron's local layers on the padded (bshd)
    path through legacy mbridge (``recipes/megatron.yaml``, ``local_layers``).
    Applies `vcpo.verl_plugin.cpu.megatron.enable_megatron_on_cpu` first."""
    from verl.workers.config import McoreEngineConfig, McoreOptimizerConfig

    # megatron-core (optional) only for a Megatron engine
    from vcpo.verl_plugin.cpu.megatron import CPU_TRANSFORMER_CONFIG, enable_megatron_on_cpu

    enable_megatron_on_cpu()
    model_config = HFModelConfig(
        path=str(model_dir),
        use_remove_padding=False,
        enable_gradient_checkpointing=False,
        load_tokenizer=False,
    )
    # forward_step reads tokenizer.pad_token_id (used only for vision models); the tiny model has no tokenizer
    model_config.tokenizer = SimpleNamespace(pad_token_id=0)
    model_config.model_type = model_type
    cls = EngineRegistry.get_engine_cls(model_type, "megatron")
    engine = cls(
        model_config=model_config,
        engine_config=McoreEngineConfig(
            strategy="megatron",
            dtype="bfloat16",
            tensor_model_parallel_size=tensor_parallel,
            pipeline_model_parallel_size=pipeline_parallel,
            sequence_parallel=False,
            use_distributed_optimizer=use_distributed_optimizer,
            use_remove_padding=False,
            use_dynamic_bsz=False,
            use_fused_kernels=False,
            use_mbridge=True,
            vanilla_mbridge=True,
            seed=seed,
            # megatron's local layers, as OPOB trains them (recipes/megatron.yaml), and what the CPU needs
            override_transformer_config={**megatron_local_layers()["override_transformer_config"], **CPU_TRANSFORMER_CONFIG},
        ),
        optimizer_config=McoreOptimizerConfig(
            lr=lr, clip_grad=1e9, weight_decay=0.0, lr_decay_style="constant", total_training_steps=1000
        ),
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return engine


@dataclass
class RawBatch:
    """The whole batch as padded tensors (prompts left-padded to P, responses right-padded to R)."""

    input_ids: torch.Tensor
    attention: torch.Tensor
    position_ids: torch.Tensor
    prompt_width: int
    response_mask: torch.Tensor  # bool
    old: torch.Tensor  # behaviour log-probs l^μ, 0 at padding
    rewards: torch.Tensor
    groups: torch.Tensor

    def rows(self, index) -> RawBatch:
        return RawBatch(**{k: (v[index] if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()})


def _random_sequences(g: torch.Generator, batch: int, prompt: int, response: int, vocab: int, *, min_prompt: int,
                      min_response: int) -> tuple[torch.Tensor, ...]:
    """Random token ids (3 and up, below ``vocab``) of random lengths, prompts left-padded to ``prompt`` and
    responses right-padded to ``response``: prompts, responses, attention mask, response mask, response lengths."""
    prompt_lens = torch.randint(min_prompt, prompt + 1, (batch,), generator=g)
    response_lens = torch.randint(min_response, response + 1, (batch,), generator=g)
    prompts = torch.zeros(batch, prompt, dtype=torch.long)
    responses = torch.zeros(batch, response, dtype=torch.long)
    attention = torch.zeros(batch, prompt + response, dtype=torch.long)
    response_mask = torch.zeros(batch, response, dtype=torch.long)
    for i in range(batch):
        p, r = int(prompt_lens[i]), int(response_lens[i])
        prompts[i, prompt - p :] = torch.randint(3, vocab, (p,), generator=g)
        responses[i, :r] = torch.randint(3, vocab, (r,), generator=g)
        attention[i, prompt - p : prompt + r] = 1
        response_mask[i, :r] = 1
    return prompts, responses, attention, response_mask, response_lens


def actor_batch(
    batch: int,
    group: int,
    prompt: int,
    response: int,
    vocab: int,
    remove_padding: bool,
    micro: int,
    seed: int = 1,
    rows: slice | None = None,
    dtype: torch.dtype = torch.float64,
    min_response: int = 2,
    behaviour_log_probs: torch.Tensor | None = None,
    min_prompt: int = 2,
):
    """A verl actor mini-batch (as ``RayPPOTrainer._update_actor`` hands it over) and the `RawBatch`.

    Random lengths (prompts in [min_prompt, prompt], responses in [min_response, response]), behaviour log-probs in [-4, -0.1]
    (far off-policy: long responses' sequence weights underflow to 0) unless ``behaviour_log_probs`` (batch,
    response) are given (read at the response tokens), 0/1 rewards at the last response
    token, ``uid`` per prompt group, GRPO-style zero advantages (unused by OPOB). ``rows`` keeps one
    data-parallel rank's share of the TensorDict; the `RawBatch` is always the whole batch.
    """
    g = torch.Generator().manual_seed(seed)
    prompts, responses, attention, response_mask, response_lens = _random_sequences(
        g, batch, prompt, response, vocab, min_prompt=min_prompt, min_response=min_response)
    input_ids = torch.cat([prompts, responses], 1)
    position_ids = (attention.cumsum(-1) - 1).clamp_min(0)
    old = -(torch.rand(batch, response, generator=g, dtype=torch.float64) * 3.9 + 0.1)
    if behaviour_log_probs is not None:
        old = behaviour_log_probs.double()
    old = (old * response_mask).to(dtype)
    rewards = torch.randint(0, 2, (batch,), generator=g).double()
    rewards[: min(4, batch)] = torch.tensor([1.0, 0.0, 0.0, 1.0])[: min(4, batch)]
    token_rewards = torch.zeros(batch, response, dtype=dtype)
    token_rewards[torch.arange(batch), response_lens - 1] = rewards.to(dtype)
    uid = np.array([f"prompt{i // group}" for i in range(batch)], dtype=object)
    keep = slice(None) if rows is None else rows
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": input_ids,
        "attention_mask": attention,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "old_log_probs": old,
        "advantages": torch.zeros(batch, response, dtype=dtype),
        "rm_scores": token_rewards,  # what verl's V1 trainer hands the actor without KL-in-reward
    }
    tensors = {name: value[keep] for name, value in tensors.items()}
    tensors["uid"] = uid[keep]
    td = left_right_2_no_padding(tu.get_tensordict(tensor_dict=tensors, non_tensor_dict={"temperature": 1.0}))
    tu.assign_non_tensor(
        td,
        use_remove_padding=remove_padding,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=micro,
        max_token_len_per_gpu=1 << 20,
        use_fused_kernels=False,
        global_batch_size=batch,
        calculate_entropy=False,
    )
    raw = RawBatch(
        input_ids=input_ids,
        attention=attention,
        position_ids=position_ids,
        prompt_width=prompt,
        response_mask=response_mask.bool(),
        old=old.double(),
        rewards=rewards,
        groups=torch.arange(batch) // group,
    )
    return td, raw


__all__ = [
    "RawBatch",
    "actor_batch",
    "actor_config",
    "build_engine",
    "build_megatron_engine",
    "save_random_qwen2",
]
