"""The actor's memory per trainer GPU, projected from a composed verl config before anything starts.

`projection` reads the model's architecture (``recipes/models.yaml``, or a local folder's config.json), the
actor's strategy and layout, its precision, gradient checkpointing, its micro-batch tokens and how many prompt
groups each rank holds, and hands them to `vcpo.core.per_sequence_grads.memory`: the plain step, OPOB's two
modes, and the mode the engine's auto rule will pick (the same `choose_mode`, with the GPU's memory). The dry
run prints it; `check_memory` refuses a run whose step cannot fit the GPU memory it is told.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from vcpo.core.per_sequence_grads.memory import (
    GB,
    Layout,
    ModelShape,
    StepMemory,
    OPOB_MODES,
    StepShape,
    choose_mode,
    step_memory,
)
from vcpo.methods import step_rule
from vcpo.recipes import read_yaml, recipes_dir

DEFAULT_GPU_MEMORY_GB = 80.0  # an H100 / A100 80GB, where the task's recipe names no GPU
# memory of the GPUs the task recipes name (paper.gpu), in GB as their makers state it
GPU_MEMORY_GB = {"A100": 80.0, "H100": 80.0, "H200": 141.0, "B200": 180.0}


def gpu_memory_gb(paper: dict, given: float | None = None) -> float:
    """The memory of one trainer GPU: ``given`` (``--gpu-memory-gb``) when set, else the GPU of the task's paper
    layout (``paper.gpu``), else ``DEFAULT_GPU_MEMORY_GB``."""
    if given is not None:
        return given
    gpu = paper.get("gpu")
    if gpu is not None and gpu not in GPU_MEMORY_GB:
        raise ValueError(f"paper.gpu={gpu!r}: its memory is not known (vcpo.launch.memory.GPU_MEMORY_GB); pass --gpu-memory-gb")
    return GPU_MEMORY_GB.get(gpu, DEFAULT_GPU_MEMORY_GB)


@dataclass
class Projection:
    """The projected memory of one run's actor step per trainer GPU, and the OPOB mode auto would run."""

    memory: StepMemory
    layout: Layout
    step: StepShape
    opob: bool
    mode: str | None  # the OPOB mode the engine will run (None: no OPOB)
    why: str

    def peak(self) -> float:
        """Bytes per GPU at the peak of the step the run takes."""
        return self.memory.peak(self.mode or "plain")

    def report(self, capacity_gb: float) -> list[str]:
        """Lines for the dry run (shell comments: the command above them stays pasteable)."""
        memory = self.memory
        lines = [f"# actor memory per trainer GPU, projected (vcpo.launch.memory; {self.layout.strategy}, "
                 f"{self.step.tokens_per_micro_batch} tokens per micro-batch, "
                 f"{'' if self.layout.gradient_checkpointing else 'no '}gradient checkpointing), GPU {capacity_gb:g} GB:",
                 f"#   plain step   {memory.peak('plain') / GB:7.1f} GB"]
        if self.opob:
            plain = memory.peak("plain")
            buffers = {"single": f"; {self.step.buffers} float32 group buffers", "two_pass": ""}
            for mode in OPOB_MODES:
                lines.append(f"#   OPOB {mode:<8}{memory.peak(mode) / GB:7.1f} GB ({memory.peak(mode) / plain:.2f}x plain"
                             f"{buffers[mode]})")
            lines.append(f"#   the engine runs OPOB {self.mode}: {self.why}")
        return lines


def model_shape(path: str) -> ModelShape:
    """The architecture of ``actor_rollout_ref.model.path``: a local folder's config.json, else recipes/models.yaml."""
    folder = Path(os.path.expanduser(path))
    if (folder / "config.json").is_file():
        return ModelShape.from_config(json.loads((folder / "config.json").read_text()))
    models = read_yaml(recipes_dir() / "models.yaml")["models"]
    if path not in models:
        raise KeyError(f"no architecture for model {path!r}: add its config to recipes/models.yaml, or use a local folder")
    return ModelShape.from_config(models[path]["config"])


def projection(config, capacity_gb: float = DEFAULT_GPU_MEMORY_GB) -> Projection:
    """The composed config's actor step, per trainer GPU (module doc)."""
    actor = config.actor_rollout_ref.actor
    trainer_gpus = config.trainer.nnodes * config.trainer.n_gpus_per_node
    shape = model_shape(str(config.actor_rollout_ref.model.path))
    checkpointing = bool(config.actor_rollout_ref.model.get("enable_gradient_checkpointing", False))
    if actor.strategy == "megatron":
        megatron = actor.megatron
        tp, pp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
        cp = megatron.get("context_parallel_size", 1) or 1
        layout = Layout(strategy="megatron", data_parallel=max(1, trainer_gpus // (tp * pp * cp)), tensor_parallel=tp,
                        pipeline_parallel=pp, compute_bytes=2, gradient_checkpointing=checkpointing,
                        distributed_optimizer=bool(megatron.get("use_distributed_optimizer", True)))
    else:
        fsdp = actor.fsdp_config
        param_dtype = str((fsdp.get("mixed_precision") or {}).get("param_dtype", "bf16"))
        layout = Layout(strategy="fsdp2", data_parallel=trainer_gpus,
                        param_bytes=2 if str(fsdp.get("model_dtype", "fp32")) in ("bf16", "bfloat16") else 4,
                        compute_bytes=4 if param_dtype in ("fp32", "32", "float32") else 2,
                        gradient_checkpointing=checkpointing)
    prompt_tokens = config.data.max_prompt_length + config.data.max_response_length
    if actor.use_dynamic_bsz:
        tokens = max(actor.ppo_max_token_len_per_gpu, prompt_tokens)  # one whole sequence at the least
    else:
        tokens = actor.ppo_micro_batch_size_per_gpu * prompt_tokens
    # verl balances sequences, not prompt groups, over the data-parallel ranks: a rank may hold a sequence of every
    # group of the mini-batch (split: a success and a failure buffer each)
    prompts, samples = actor.ppo_mini_batch_size, config.actor_rollout_ref.rollout.n
    per_rank = math.ceil(prompts * samples / layout.data_parallel)
    method = config.actor_rollout_ref.actor.policy_loss.get("method", None)
    rule = step_rule(method) if method else None
    groups = min(prompts, per_rank) if rule is not None and rule.scope == "group" else 1
    # FSDP2 combines "split" (a success and a failure buffer per group); Megatron keeps G_R and one buffer per group
    step = StepShape(tokens_per_micro_batch=tokens, buffers=groups if layout.strategy == "megatron" else 2 * groups,
                     sequence_length=prompt_tokens)
    memory = step_memory(shape, layout, step)
    if rule is None or not rule.opob:
        return Projection(memory, layout, step, opob=False, mode=None, why="no OPOB")
    requested = config.actor_rollout_ref.actor.policy_loss.get("opob_mode", None) or "auto"
    mode, why = choose_mode(memory, requested, capacity_gb * GB)
    return Projection(memory, layout, step, opob=True, mode=mode, why=why)


def check_memory(projected: Projection, capacity_gb: float) -> None:
    """Refuse a run whose actor step cannot fit the GPU: a ValueError naming the mode, the numbers and the knobs."""
    peak = projected.peak()
    if peak <= capacity_gb * GB:
        return
    step = f"OPOB {projected.mode} step" if projected.opob else "plain step"
    hints = ["more trainer GPUs", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu lower",
             "actor_rollout_ref.model.enable_gradient_checkpointing=true"]
    if projected.opob and projected.mode == "single":
        hints.insert(0, "+actor_rollout_ref.actor.policy_loss.opob_mode=two_pass")
    raise ValueError(f"the actor's {step} is projected at {peak / GB:.1f} GB per trainer GPU, more than the "
                     f"{capacity_gb:g} GB of --gpu-memory-gb; try {', or '.join(hints)}")


__all__ = ["DEFAULT_GPU_MEMORY_GB", "GB", "GPU_MEMORY_GB", "gpu_memory_gb", "Projection", "check_memory", "model_shape", "projection"]

