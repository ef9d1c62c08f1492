"""The CPU recipe: data, reward and the exact Hydra overrides of ``verl.trainer.main_ppo``.

Why it exists: one place that says how verl 0.9.1's real trainer is run on a 2-core CPU machine
(a small random ``vcpo.local_models`` model, 4 prompts x 2 responses, 16-token responses), so that the slow test, the
launcher ``python -m vcpo.launch.cpu`` share one list. It is applied on top of a ``vcpo.launch`` run
(task x method x lag), so what runs on CPU is the production recipe with its sizes, model, rollout server
and device replaced. Every override is explained next to it in :func:`cpu_overrides`.

The actor runs FSDP2 in float32 by default; a run that asks for ``actor_rollout_ref.actor.strategy=megatron`` gets
verl's Megatron engine in bf16 on the padded path instead (:func:`megatron_engine_overrides`, the shims of
:mod:`.megatron`), with one trainer slot per rank of its TP x PP x CP layout (:func:`megatron_layout`).

Environment every verl process needs (see :data:`ENV`): ``VERL_PLATFORM=cpu`` selects the CPU
platform, ``VERL_USE_EXTERNAL_MODULES=vcpo.verl_plugin.cpu`` makes ``import verl`` register it (and the
``hf`` rollout, the cpu engines and the ``ray`` checkpoint engine) in the driver and in every Ray worker.

Reward: :func:`shaped_reward` is ``vcpo.rewards.compute_score`` plus a small dense term (the fraction of
digit characters in the response). A randomly initialised model never answers correctly, so with the
verifiable reward alone every GRPO advantage is 0 and the loss, the gradient and the weight update are
exactly zero; the dense term makes the 2-3 optimizer steps of the smoke run move the policy.
"""

from __future__ import annotations

import math
import os
import random
from pathlib import Path
from typing import Any

from vcpo.recipes import hydra_value, megatron_local_layer_overrides
from vcpo.resident_memory import CACHING_ENV
from vcpo.rewards import compute_score
from vcpo.runs import METRICS_FILE
from vcpo.verl_contract import (
    CPU_PLATFORM_ENV,
    END_AWARE_REWARD_MANAGER,
    EXTERNAL_MODULES,
    FP32_MIXED_PRECISION_HYDRA,
    MIXED_PRECISION_KEY,
    TRAINER_THREADS_ENV,
    last_override,
)

ENV = {
    **CPU_PLATFORM_ENV,
    # one BLAS thread per process: the trainer, the rollout server and the reward worker share 2 cores
    "OMP_NUM_THREADS": "1",
    "TQ_NUM_THREADS": "1",  # TransferQueue's default 8 exceeds a small machine's cores (it warns at every transfer)
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_DEDUP_LOGS": "0",
}



def shaped_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs: Any):
    """``vcpo.rewards.compute_score`` + 0.1 x (digit fraction of the response); keeps its extra keys."""
    result = dict(compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs))
    digits = sum(ch.isdigit() for ch in solution_str)
    result["dense"] = digits / max(1, len(solution_str))
    result["score"] = float(result["score"]) + 0.1 * result["dense"]
    return result


def data_paths(out_dir: str | os.PathLike) -> dict[str, Path]:
    """Where ``write_data`` puts the train and validation prompts."""
    return {"train": Path(out_dir) / "train.parquet", "val": Path(out_dir) / "val.parquet"}


def write_data(out_dir: str | os.PathLike, train_rows: int = 16, val_rows: int = 4, seed: int = 0) -> dict[str, Path]:
    """Short GSM8K-schema prompts ("What is 3 + 4?") as verl parquet: ``train.parquet``, ``val.parquet``."""
    import pandas as pd

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def rows(split: str, count: int, split_seed: int) -> pd.DataFrame:
        rng = random.Random(split_seed)
        records = []
        for index in range(count):
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            records.append(
                {
                    "data_source": "gsm8k",
                    "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
                    "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                    "extra_info": {"split": split, "index": index},
                }
            )
        return pd.DataFrame(records)

    paths = data_paths(out)
    rows("train", train_rows, seed).to_parquet(paths["train"])
    rows("val", val_rows, seed + 1).to_parquet(paths["val"])
    return paths


def write_task_data(task: str, val_rows: list[dict], out_dir: str | os.PathLike, write: bool = True) -> dict[str, Path]:
    """A ``vcpo.data`` task's train split and ``val_rows`` as verl parquet under ``out_dir/task`` (only the paths when
    ``write`` is False)."""
    folder = Path(out_dir) / task
    paths = {"train": folder / "train.parquet", "val": folder / f"val_{len(val_rows)}.parquet"}
    if write:
        import pandas as pd  # the reproduction stack (vcpo[repro])

        from vcpo.data import load_rows  # the data builders: where a task's files are written, not in verl's workers

        folder.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(load_rows(task, "train")).to_parquet(paths["train"])
        pd.DataFrame(val_rows).to_parquet(paths["val"])
    return paths


def pretrained_task_overrides(training: dict, answer_format: str) -> list[str]:
    """A pretrained model trained on a task's own reward: ``training``'s prompts per step, responses per prompt,
    lengths, temperature and validation interval (a training block of recipes/real_model*.yaml), the task's reward in
    ``answer_format``, told whether each response ended (lenient reads a cut one strictly), and greedy validation
    before the first step."""
    rollout = "actor_rollout_ref.rollout"
    return [
        # the task's own reward (the CPU recipe's default adds a dense term for random models)
        "reward.custom_reward_function.path=pkg://vcpo.rewards", "reward.custom_reward_function.name=compute_score",
        f"+reward.custom_reward_function.reward_kwargs.answer_format={answer_format}",
        *END_AWARE_REWARD_MANAGER,
        f"data.train_batch_size={training['prompts_per_step']}", f"{rollout}.n={training['responses_per_prompt']}",
        f"{rollout}.temperature={training['temperature']}",
        f"data.max_response_length={training['max_response_length']}", f"data.max_prompt_length={training['max_prompt_length']}",
        f"trainer.test_freq={training['validation']['every']}", "trainer.val_before_train=true",
    ]


# the Megatron parallel sizes whose product is a trainer's world (one data-parallel rank on CPU)
MEGATRON_WORLD = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")


def megatron_layout(overrides: list[str] | tuple[str, ...]) -> dict[str, int]:
    """The actor's Megatron parallel sizes that ``overrides`` set (the last wins, as in Hydra; 1 when unset)."""
    values = {name: last_override(overrides, f"actor_rollout_ref.actor.megatron.{name}") for name in MEGATRON_WORLD}
    return {name: 1 if value is None else int(value) for name, value in values.items()}


def fsdp_engine_overrides() -> list[str]:
    """FSDP2 in float32 with SDPA attention (no flash-attn, no torch.compile); verl's default remove-padding
    packing stays on (transformers' SDPA separates the packed sequences by position_ids)."""
    actor = "actor_rollout_ref.actor"
    return [
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"{actor}.strategy=fsdp2",
        f"{actor}.fsdp_config.dtype=float32",
        f"++{MIXED_PRECISION_KEY}={FP32_MIXED_PRECISION_HYDRA}",
        f"{actor}.fsdp_config.use_torch_compile=false",
    ]


def megatron_engine_overrides() -> list[str]:
    """verl's Megatron engine as :mod:`.megatron` runs it on CPU (gloo), for the actor (the reference follows).

    The parallel layout (TP/PP from ``recipes/megatron.yaml`` or the user's overrides) is kept; megatron's local
    layers are what OPOB trains with on GPUs (``local_layers``: the local layer spec, the padded path, no sequence
    parallelism), and the rest is what the CPU shims need (the module doc of :mod:`vcpo.verl_plugin.cpu.megatron`)."""
    # megatron-core (optional) only for a Megatron run
    from vcpo.verl_plugin.cpu.megatron import CPU_TRANSFORMER_CONFIG

    megatron = "actor_rollout_ref.actor.megatron"
    return [
        "actor_rollout_ref.actor.strategy=megatron",
        *megatron_local_layer_overrides(),
        # bf16 parameters, fp32 main parameters and gradients: the engine takes bf16/fp16 only, and verl's fp16
        # turns on megatron's precision-aware optimizer, which needs Transformer Engine
        f"{megatron}.dtype=bfloat16",
        *(f"++{megatron}.override_transformer_config.{key}={hydra_value(value)}" for key, value in CPU_TRANSFORMER_CONFIG.items()),
    ]


# a random model needs a large step to move within 3 steps (so lagged steps see ratios != 1); a pretrained one a small
# one: at 1e-3 SmolLM2-135M's first step unlearned it (at step 2 the lag-1 weights fell to 2e-4 on average, ESS 1/8)
RANDOM_MODEL_LR = 1e-3
PRETRAINED_LR = 1e-5


# Over 80 lines as one list: every override a CPU run changes, grouped by the part of verl it sets and explained
# beside it, so that the whole recipe reads in one place.
def cpu_overrides(
    model: str | os.PathLike,
    train_file: str | os.PathLike,
    val_file: str | os.PathLike,
    *,
    steps: int = 3,
    separate: bool = True,
    strategy: str = "fsdp2",
    layout: dict[str, int] | None = None,
    pretrained: bool = False,
    keep_optimizer: bool = False,
) -> list[str]:
    """What a ``vcpo.launch`` run changes to fit one CPU: appended after the run's own overrides (they win).

    The run keeps its method (loss, preset, bypass mode, engine keys), its asynchrony mapping (sync or
    ``separate_async`` with the lag's warm-up batches and off-policy threshold) and Table 2's optimizer;
    this replaces the model, data and sizes (4 prompts x 2 responses, 16-token responses), the rollout
    (the ``hf`` server of :mod:`.rollout`), the device, the weight-sync transport and Ray's resources.
    ``separate``: the run is ``separate_async`` (a logical GPU slot for the rollout replica besides the trainer's).
    ``strategy``: the actor's (``fsdp2`` unless the run asks for ``megatron``, see :func:`megatron_engine_overrides`);
    ``layout``: the Megatron world (:func:`megatron_layout`), which sets the trainer's GPU slots.
    ``pretrained``: the model is a pretrained one (``vcpo.local_models.PACKAGED_MODELS``), trained at `PRETRAINED_LR`.
    ``keep_optimizer``: checkpoints keep the optimizer's state, and a relaunch resumes (else they keep the weights only,
    and the run cannot resume: Adam's two float32 moments are twice the weights, 1.1 GB a checkpoint for SmolLM2).
    """
    if strategy not in ("fsdp", "fsdp2", "megatron"):
        raise ValueError(f"cpu_overrides: the CPU recipe runs the fsdp2 or megatron strategy, not {strategy!r}")
    trainer_slots = 1
    if strategy == "megatron":
        trainer_slots = math.prod((layout or {}).get(key, 1) for key in MEGATRON_WORLD)
    actor, rollout = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    overrides = [
        # --- data: 4 prompts x 2 responses, 16-token responses
        f"data.train_files=[{train_file}]",
        f"data.val_files=[{val_file}]",
        "data.train_batch_size=4",
        "data.max_prompt_length=64",
        "data.max_response_length=16",
        "data.dataloader_num_workers=0",  # default 8 worker processes
        # --- reward: vcpo.rewards (+ a dense term, see shaped_reward) in one reward worker (default 8)
        "reward.custom_reward_function.path=pkg://vcpo.verl_plugin.cpu.recipe",
        "reward.custom_reward_function.name=shaped_reward",
        "reward.num_workers=1",
        # --- model and engine: FSDP2 in float32 (fsdp_engine_overrides) or Megatron in bf16 (megatron_engine_overrides)
        f"actor_rollout_ref.model.path={model}",
        *(megatron_engine_overrides() if strategy == "megatron" else fsdp_engine_overrides()),
        f"{actor}.ppo_mini_batch_size=4",
        f"{actor}.ppo_micro_batch_size_per_gpu=4",
        f"{actor}.optim.lr={PRETRAINED_LR if pretrained else RANDOM_MODEL_LR}",
        f"{actor}.optim.lr_warmup_steps=0",
        f"{actor}.optim.total_training_steps={steps}",
        # --- rollout: the transformers server of vcpo.verl_plugin.cpu.rollout, with per-token log-probs
        f"{rollout}.name=hf",
        f"{rollout}.dtype=float32",
        f"{rollout}.n=2",
        f"{rollout}.tensor_model_parallel_size=1",
        f"{rollout}.log_prob_micro_batch_size_per_gpu=4",
        f"{rollout}.agent.num_workers=1",
        # --- trainer: one CPU "GPU slot" per trainer rank (FSDP: 1; Megatron: TP x PP x CP, data parallel 1),
        # and one for a separate rollout replica
        "trainer.device=cpu",
        f"trainer.n_gpus_per_node={trainer_slots}",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        f"trainer.save_freq={steps}",
        *([] if keep_optimizer else [f"{actor}.checkpoint.save_contents=[model,extra,hf_model]", "trainer.resume_mode=disable"]),
        "trainer.project_name=vcpo_cpu",
        # --- Ray and TransferQueue: logical CPUs are bookkeeping (placement groups reserve 3 per worker
        # bundle, 3 more per extra trainer rank; TransferQueue's controller and storage 1 each), one logical GPU
        # slot per worker
        f"ray_kwargs.ray_init.num_cpus={16 + 3 * (trainer_slots - 1)}",
        f"+ray_kwargs.ray_init.num_gpus={trainer_slots + (1 if separate else 0)}",
        # a weight sync puts the model in the store twice (the checkpoint engine's round, then the server's update):
        # 2 x 538 MB for a pretrained 135M model in float32, which a 512 MiB store would spill to disk every sync
        f"+ray_kwargs.ray_init.object_store_memory={(2048 if pretrained else 512) << 20}",
        "+ray_kwargs.ray_init.include_dashboard=false",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]
    if pretrained:
        # OPOB in one backward: the memory model's rule (two passes above 1.25x a plain step's peak) spares a GPU's
        # memory; on the host single's projected 6.6 GB fits, and it is the faster (docs/verl.md, "The real model's
        # step on CPU")
        overrides.append(f"+{actor}.policy_loss.opob_mode=single")
    if separate:
        # weights reach the standalone replica through the object-store checkpoint engine (checkpoint.py)
        overrides += [f"{rollout}.checkpoint_engine.backend=ray", f"{rollout}.n_gpus_per_node=1"]
    return overrides


def environment(out_dir: str | os.PathLike, run_env: dict[str, str], base: dict[str, str] | None = None, *,
                pretrained: bool = False) -> dict[str, str]:
    """The process environment of a CPU run: ``base`` (this process's), the run's (``vcpo.launch.run_environment``),
    :data:`ENV`, with the modules of ``VERL_USE_EXTERNAL_MODULES`` joined and metrics under ``out_dir``.

    ``pretrained``: a pretrained model's run, whose update dominates the step (benchmarks/real_model_step.py): the
    trainer takes every core (the rollout server's batch of decoding, a few seconds a step, shares one of them), and
    glibc keeps freed memory for reuse (``vcpo.resident_memory.CACHING_ENV``, as CUDA's caching allocator does)
    rather than page-faulting the gradients and OPOB's buffers afresh every step."""
    env = dict(os.environ if base is None else base)
    modules: list[str] = []
    for source in (ENV, env, run_env):  # the CPU platform first: the engine module asks verl for the device
        modules += [m for m in source.get(EXTERNAL_MODULES, "").split(",") if m and m not in modules]
    env.update(run_env)
    env.update(ENV)
    env[EXTERNAL_MODULES] = ",".join(modules)
    env["VERL_FILE_LOGGER_PATH"] = str(Path(out_dir) / METRICS_FILE)
    if pretrained:
        env.update(CACHING_ENV)
        env[TRAINER_THREADS_ENV] = str(os.cpu_count() or 1)
    return env
