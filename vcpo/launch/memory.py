"""The actor's memory per trainer GPU, projected from a composed verl config before anything starts.

`projection` reads the model's architecture (``recipes/models.yaml``, or a local folder's config.json), the
actor's strategy and layout, its precision, gradient checkpointing, offload, its micro-batch tokens and how many
prompt groups each rank holds, and what shares its GPUs (the nccl weight sync's buckets; at lag 0 the colocated
rollout), and hands them to `vcpo.actor_memory`: the plain step, OPOB's two modes, and the mode the engine's auto
rule will pick (the same `choose_mode`, with the GPU's memory). The dry run prints it; `check_memory` refuses a run
whose step cannot fit the GPU memory it is told, naming the changes under which it would (`remedies`).
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

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
    verl_log_probs,
)
from vcpo.methods import step_rule
from vcpo.recipes import read_yaml, recipes_dir

DEFAULT_GPU_MEMORY_GB = 80.0  # an H100 / A100 80GB, where the task's recipe names no GPU
# memory of the GPUs the task recipes name (paper.gpu), in GB as their makers state it
GPU_MEMORY_GB = {"A100": 80.0, "H100": 80.0, "H200": 141.0, "B200": 180.0}
MIB = 1 << 20
# trainer GPU counts offered to a run that does not fit: these multiples of its own
MORE_GPUS = (2, 4, 8)


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

    def _beside_the_step(self) -> str:
        """What every figure above counts beside the step's tensors: memory outside the caching allocator, the
        fragmentation margin, and (lag 0) the GPU while the rollout generates."""
        memory = self.memory
        outside = [f"{name} {size / GB:.1f} GB" for name, size in memory.outside_allocator.items()]
        line = f"#   each counts {', '.join([*outside, f'a {memory.fragmentation:.0%} fragmentation margin on the allocated peak'])}"
        if memory.between_steps:
            line += f"; between steps, the colocated rollout awake: {sum(memory.between_steps.values()) / GB:.1f} GB"
        return line

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
        lines.append(self._beside_the_step())
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


def offloaded_between_steps(engine) -> frozenset:
    """What verl's engine config moves to the CPU between steps (``param_offload``, ``optimizer_offload``), as
    `Layout.offloaded_between_steps` names it."""
    return frozenset(kind for kind, key in (("parameters", "param_offload"), ("optimizer", "optimizer_offload")) if engine.get(key, False))


def optimizer_cpu_fraction(optim) -> float:
    """The fraction of megatron's optimizer (main parameters, moments, step) on the CPU: its
    ``override_optimizer_config.optimizer_offload_fraction`` where ``optimizer_cpu_offload`` is set, else 0."""
    override = optim.get("override_optimizer_config", None) or {}
    return float(override.get("optimizer_offload_fraction", 0.0)) if override.get("optimizer_cpu_offload", False) else 0.0


def gpu_neighbours(config, capacity_gb: float) -> dict:
    """What shares a trainer GPU with the actor step, as `Layout` fields: the nccl weight sync's bucket (verl's
    ``update_weights_bucket_megabytes``), and at lag 0 (verl's hybrid engine) the colocated rollout's budget
    (``gpu_memory_utilization`` of the GPU) and whether it sleeps while the actor trains (``free_cache_engine``)."""
    rollout = config.actor_rollout_ref.rollout
    sync = rollout.get("checkpoint_engine", None) or {}
    nccl = sync.get("backend", None) == "nccl"
    colocated = bool(config.actor_rollout_ref.get("hybrid_engine", False))
    return {"weight_sync_bucket_bytes": int(sync.get("update_weights_bucket_megabytes", 0)) * MIB if nccl else 0,
            "rollout_budget_bytes": float(rollout.gpu_memory_utilization) * capacity_gb * GB if colocated else 0.0,
            "rollout_frees_cache": bool(rollout.get("free_cache_engine", True))}


def projection(config, capacity_gb: float = DEFAULT_GPU_MEMORY_GB) -> Projection:
    """The composed config's actor step, per trainer GPU (module doc)."""
    actor = config.actor_rollout_ref.actor
    trainer_gpus = config.trainer.nnodes * config.trainer.n_gpus_per_node
    shape = model_shape(str(config.actor_rollout_ref.model.path))
    checkpointing = bool(config.actor_rollout_ref.model.get("enable_gradient_checkpointing", False))
    neighbours = gpu_neighbours(config, capacity_gb)
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
                        sequence_parallel=megatron_sequence_parallel(megatron), attention=attention,
                        optimizer_cpu_fraction=optimizer_cpu_fraction(actor.optim),
                        offloaded_between_steps=offloaded_between_steps(megatron), **neighbours)
    else:
        fsdp = actor.fsdp_config
        param_dtype = str((fsdp.get("mixed_precision") or {}).get("param_dtype", "bf16"))
        # a launch refuses a run whose flash-attn cross-entropy does not import (vcpo.launch.gpu_packages): what runs
        # takes verl's fused path unless the environment turns it off
        log_probs = verl_log_probs(flash_cross_entropy=True, environ=os.environ)
        layout = Layout(strategy="fsdp2", data_parallel=trainer_gpus,
                        param_bytes=2 if str(fsdp.get("model_dtype", "fp32")) in ("bf16", "bfloat16") else 4,
                        compute_bytes=4 if param_dtype in ("fp32", "32", "float32") else 2,
                        gradient_checkpointing=checkpointing, log_probs=log_probs,
                        fsdp_offload_policy=bool(fsdp.get("offload_policy", False)),
                        offloaded_between_steps=offloaded_between_steps(fsdp), **neighbours)
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


def with_overrides(config, overrides: tuple[str, ...]):
    """A copy of the composed ``config`` with Hydra-style ``key=value`` overrides set (leading ``+`` ignored)."""
    from omegaconf import OmegaConf  # hydra's, present wherever a config was composed

    changed = copy.deepcopy(config)
    for override in overrides:
        key, value = override.lstrip("+").split("=", 1)
        OmegaConf.update(changed, key, yaml.safe_load(value), force_add=True)
    return changed


def remedies(config, projected: Projection) -> list[tuple[str, ...]]:
    """The changes a run may try when its step does not fit, each a tuple of overrides: OPOB's two_pass for its single
    backward; recompute (gradient checkpointing; megatron's full recompute, which OPOB refuses under pipeline
    parallelism); offload (FSDP2's CPUOffloadPolicy, megatron's optimizer on the CPU; at lag 0, verl's offload of the
    actor's state while the rollout generates); a smaller token budget per micro-batch; more trainer GPUs."""
    actor, layout = config.actor_rollout_ref.actor, projected.layout
    changes = []
    if projected.opob and projected.mode == "single":
        changes.append(("+actor_rollout_ref.actor.policy_loss.opob_mode=two_pass",))
    if layout.strategy == "megatron":
        transformer = "++actor_rollout_ref.actor.megatron.override_transformer_config"
        if not layout.gradient_checkpointing and not (projected.opob and layout.pipeline_parallel > 1):  # megatron_opob_refusals
            changes.append((f"{transformer}.recompute_granularity=full", f"{transformer}.recompute_method=uniform",
                            f"{transformer}.recompute_num_layers=1"))
        if layout.optimizer_cpu_fraction < 1:
            optimizer = "++actor_rollout_ref.actor.optim.override_optimizer_config"
            changes.append((f"{optimizer}.optimizer_cpu_offload=true", f"{optimizer}.optimizer_offload_fraction=1.0"))
        engine = "actor_rollout_ref.actor.megatron"
    else:
        if not layout.gradient_checkpointing:
            changes.append(("actor_rollout_ref.model.enable_gradient_checkpointing=true",))
        if not layout.fsdp_offload_policy:
            changes.append(("actor_rollout_ref.actor.fsdp_config.offload_policy=true",))
        engine = "actor_rollout_ref.actor.fsdp_config"
        sequence = config.data.max_prompt_length + config.data.max_response_length
        budget = actor.ppo_max_token_len_per_gpu // 2
        while actor.use_dynamic_bsz and budget >= sequence:
            changes.append((f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",))
            budget //= 2
    if layout.rollout_budget_bytes and layout.offloaded_between_steps != {"parameters", "optimizer"}:
        changes.append((f"{engine}.param_offload=true", f"{engine}.optimizer_offload=true"))
    changes += [(f"trainer.n_gpus_per_node={config.trainer.n_gpus_per_node * times}",) for times in MORE_GPUS]
    return changes


def fitting(config, capacity_gb: float) -> list[tuple[tuple[str, ...], float]]:
    """The `remedies` under which the run's projected step fits ``capacity_gb``, each alone, with its peak in bytes:
    of the token budgets the largest, of the GPU counts the smallest."""
    projected, found, kinds = projection(config, capacity_gb), [], set()
    for change in remedies(config, projected):
        kind = change[0].split("=", 1)[0]
        if kind in kinds:
            continue
        peak = projection(with_overrides(config, change), capacity_gb).peak()
        if peak <= capacity_gb * GB:
            found.append((change, peak))
            kinds.add(kind)
    return found


def check_memory(config, capacity_gb: float) -> None:
    """Refuse a run whose actor step cannot fit the GPU: a ValueError naming the mode, the numbers, and each change
    under which it fits (`fitting`), or, none alone fitting, what all of them together project."""
    projected = projection(config, capacity_gb)
    peak = projected.peak()
    if peak <= capacity_gb * GB:
        return
    step = f"OPOB {projected.mode} step" if projected.opob else "plain step"
    found = fitting(config, capacity_gb)
    if found:
        way = "it fits with any one of: " + "; ".join(f"{' '.join(change)} ({fits / GB:.1f} GB)" for change, fits in found)
    else:  # applied in order, the smallest token budget and the most GPUs win
        together = tuple(override for change in remedies(config, projected) for override in change)
        combined = projection(with_overrides(config, together), capacity_gb).peak()
        way = (f"no one change fits; all together ({' '.join(together)}) project {combined / GB:.1f} GB"
               + ("" if combined <= capacity_gb * GB else ", still more: a GPU with more memory"))
    raise ValueError(f"the actor's {step} is projected at {peak / GB:.1f} GB per trainer GPU, more than the "
                     f"{capacity_gb:g} GB of --gpu-memory-gb; {way}")


__all__ = ["DEFAULT_GPU_MEMORY_GB", "GB", "GPU_MEMORY_GB", "gpu_memory_gb", "Projection", "check_memory", "fitting",
           "gpu_neighbours", "megatron_sequence_parallel", "model_shape", "offloaded_between_steps", "optimizer_cpu_fraction",
           "projection", "remedies", "with_overrides"]

