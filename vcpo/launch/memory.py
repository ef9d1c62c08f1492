"""The actor's memory per trainer GPU, projected from a composed verl config before anything starts.

`projection` reads the model's architecture (``recipes/models.yaml``, or a local folder's config.json), the
actor's strategy and layout, its precision, gradient checkpointing, its micro-batch tokens and how many prompt
groups each rank holds, and hands them to `vcpo.actor_memory`: the plain step, OPOB's two
modes, and the mode the engine's auto rule will pick (the same `choose_mode`, with the GPU's memory). The dry
run prints it; `check_memory` refuses a run whose step cannot fit the GPU memory it is told.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from vcpo.actor_memory import (
    GB,
    OPOB_MODES,
    Layout,
    ModelShape,
    StepMemory,
    StepShape,
    choose_mode,
    megatron_recompute,
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
    shape: ModelShape
    layout: Layout
    step: StepShape
    opob: bool
    mode: str | None  # the OPOB mode the engine will run (None: no OPOB)
    why: str

    def peak(self) -> float:
        """Bytes per GPU at the peak of the step the run takes."""
        return self.memory.peak(self.mode or "plain")

    def _megatron_layers(self) -> str:
        """How megatron computes the step, where it changes the memory: sequence parallelism and attention."""
        if self.layout.strategy != "megatron":
            return ""
        attention = {"fused": "fused attention", "local": "local attention, its scores kept",
                     "local_recomputed": "local attention, recomputed in the backward"}[self.layout.attention]
        return f", {'' if self.layout.sequence_parallel else 'no '}sequence parallelism, {attention}"

    def local_attention_cost(self) -> float:
        """Matmul FLOPs of a step on megatron's local layers over the same step with fused attention, at the longest
        sequence s: per token, the linears take 6N (forward and backward, N the matmul parameters); a fused causal
        kernel computes half of the s x s scores, 6 s h per layer, where local attention computes them all (12 s h) and,
        recomputed, once more in the backward (16 s h)."""
        shape, length = self.shape, self.step.sequence_length or self.step.tokens_per_micro_batch
        linears = 6 * (shape.layers * shape.layer_parameters + shape.vocab * shape.hidden)
        local = 16 if self.layout.attention == "local_recomputed" else 12
        return (linears + local * length * shape.hidden * shape.layers) / (linears + 6 * length * shape.hidden * shape.layers)

    def report(self, capacity_gb: float) -> list[str]:
        """Lines for the dry run (shell comments: the command above them stays pasteable)."""
        memory = self.memory
        lines = [f"# actor memory per trainer GPU, projected (vcpo.launch.memory; {self.layout.strategy}, "
                 f"{self.step.tokens_per_micro_batch} tokens per micro-batch, "
                 f"{'' if self.layout.gradient_checkpointing else 'no '}gradient checkpointing{self._megatron_layers()}), "
                 f"GPU {capacity_gb:g} GB:",
                 f"#   plain step   {memory.peak('plain') / GB:7.1f} GB"]
        if self.opob:
            plain = memory.peak("plain")
            buffers = {"single": f"; {self.step.buffers} float32 group buffers", "two_pass": ""}
            for mode in OPOB_MODES:
                lines.append(f"#   OPOB {mode:<8}{memory.peak(mode) / GB:7.1f} GB ({memory.peak(mode) / plain:.2f}x plain"
                             f"{buffers[mode]})")
            lines.append(f"#   the engine runs OPOB {self.mode}: {self.why}")
        if self.layout.attention != "fused":
            lines.append(f"# megatron's local layers (recipes/megatron.yaml, local_layers: what OPOB's norms watch): at the longest "
                         f"sequence ({self.step.sequence_length} tokens) {self.local_attention_cost():.2f}x the matmul FLOPs of fused "
                         "attention (unfused scores, recomputed in the backward); no sequence parallelism (its memory is above)")
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


def megatron_sequence_parallel(megatron) -> bool:
    """Whether the actor's megatron model runs sequence parallel: mbridge turns it on whenever TP > 1 and only
    ``override_transformer_config.sequence_parallel`` turns it off (Megatron-Bridge follows the engine's own key)."""
    if not megatron.get("vanilla_mbridge", False):  # verl's McoreEngineConfig turns it off at TP 1
        return bool(megatron.get("sequence_parallel", False)) and megatron.tensor_model_parallel_size > 1
    transformer = megatron.get("override_transformer_config", None) or {}
    return bool(transformer.get("sequence_parallel", megatron.tensor_model_parallel_size > 1))


def projection(config, capacity_gb: float = DEFAULT_GPU_MEMORY_GB) -> Projection:
    """The composed config's actor step, per trainer GPU (module doc)."""
    actor = config.actor_rollout_ref.actor
    trainer_gpus = config.trainer.nnodes * config.trainer.n_gpus_per_node
    shape = model_shape(str(config.actor_rollout_ref.model.path))
    checkpointing = bool(config.actor_rollout_ref.model.get("enable_gradient_checkpointing", False))
    if actor.strategy == "megatron":  # verl's Megatron engine recomputes as its transformer config says, not by the model's flag
        megatron = actor.megatron
        tp, pp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
        cp = megatron.get("context_parallel_size", 1) or 1
        transformer = megatron.get("override_transformer_config", None) or {}
        checkpointing, attention = megatron_recompute(transformer.get("transformer_impl", None), transformer.get("recompute_granularity", None),
                                                      transformer.get("recompute_modules", None))
        layout = Layout(strategy="megatron", data_parallel=max(1, trainer_gpus // (tp * pp * cp)), tensor_parallel=tp,
                        pipeline_parallel=pp, compute_bytes=2, gradient_checkpointing=checkpointing,
                        distributed_optimizer=bool(megatron.get("use_distributed_optimizer", True)),
                        sequence_parallel=megatron_sequence_parallel(megatron), attention=attention)
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
        return Projection(memory, shape, layout, step, opob=False, mode=None, why="no OPOB")
    requested = config.actor_rollout_ref.actor.policy_loss.get("opob_mode", None) or "auto"
    mode, why = choose_mode(memory, requested, capacity_gb * GB)
    return Projection(memory, shape, layout, step, opob=True, mode=mode, why=why)


def check_memory(projected: Projection, capacity_gb: float) -> None:
    """Refuse a run whose actor step cannot fit the GPU: a ValueError naming the mode, the numbers and the knobs."""
    peak = projected.peak()
    if peak <= capacity_gb * GB:
        return
    step = f"OPOB {projected.mode} step" if projected.opob else "plain step"
    if projected.layout.strategy == "megatron":  # verl's Megatron engine recomputes by its transformer config
        transformer = "++actor_rollout_ref.actor.megatron.override_transformer_config"
        hints = ["more trainer GPUs"]
        if not (projected.opob and projected.layout.pipeline_parallel > 1):  # OPOB refuses it there (megatron_opob_refusals)
            hints.append(f"{transformer}.recompute_granularity=full {transformer}.recompute_method=uniform "
                         f"{transformer}.recompute_num_layers=1")
    else:
        hints = ["more trainer GPUs", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu lower",
                 "actor_rollout_ref.model.enable_gradient_checkpointing=true"]
    if projected.opob and projected.mode == "single":
        hints.insert(0, "+actor_rollout_ref.actor.policy_loss.opob_mode=two_pass")
    raise ValueError(f"the actor's {step} is projected at {peak / GB:.1f} GB per trainer GPU, more than the "
                     f"{capacity_gb:g} GB of --gpu-memory-gb; try {', or '.join(hints)}")


__all__ = ["DEFAULT_GPU_MEMORY_GB", "GB", "GPU_MEMORY_GB", "gpu_memory_gb", "Projection", "check_memory", "megatron_sequence_parallel",
           "model_shape", "projection"]

