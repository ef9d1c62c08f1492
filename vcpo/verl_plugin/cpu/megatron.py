"""verl 0.9.1's Megatron training engine on CPU (gloo), through run-time shims only.

Why it exists: verl's ``MegatronEngineWithLMHead`` (backend ``megatron``) builds a megatron-core
``GPTModel`` through mbridge (``vanilla_mbridge=True``), wraps it in megatron's DDP and
``Float16Module`` (bf16 parameters, fp32 main gradients) and trains it with megatron's optimizer and
pipeline schedules. All of these assume CUDA and Transformer Engine somewhere; nothing in site-packages
is edited here. :func:`enable_megatron_on_cpu` (idempotent) applies every shim below, each with the
CUDA/TE assumption it answers. It is meant for processes on the CPU platform (``VERL_PLATFORM=cpu``),
after ``vcpo.verl_contract.select_cpu_platform``; it changes a few ``torch.cuda`` entry points
process-wide, so call it only in a process that never uses a GPU.

What the engine still needs from its config (``vcpo.verl_plugin.cpu.standalone.build_megatron_engine``
passes these): megatron's local layers as OPOB trains them on GPUs too (``recipes/megatron.yaml``, ``local_layers``:
mbridge with ``transformer_impl="local"``, `vcpo.verl_plugin.engine.layer_spec`; the padded path; no sequence
parallelism), ``dtype="bfloat16"`` (verl's fp16 turns on megatron's precision-aware optimizer, which needs TE),
and in ``override_transformer_config`` :data:`CPU_TRANSFORMER_CONFIG`. Packages: mbridge 0.15.1 (and einops,
which ``import mbridge`` needs).

In verl's trainer (``python -m vcpo.launch.cpu ... -- actor_rollout_ref.actor.strategy=megatron``, whose
overrides are ``vcpo.verl_plugin.cpu.recipe.megatron_engine_overrides``), the CPU plugin calls :func:`install` at
import in every process: the shims are applied by the construction of a Megatron engine on the CPU platform, so
only the trainer's Megatron workers get them (tests/test_verl_megatron_cpu_trainer.py). The rollout replica gets
the weights through the engine's ``get_per_tensor_param`` (mbridge's ``export_weights``, whose names the local
norms are mapped for by `layer_spec`) and the ``ray`` checkpoint engine.

Covered (tests/verl_megatron_worker.py): the padded (bshd) path with tensor, pipeline (1F1B) or data
parallelism, tied or untied embeddings, bf16 parameters with fp32 main parameters and gradients, megatron's
plain (``Float16OptimizerWithFloat16Params``) or distributed optimizer. Not covered: the packed (thd) path,
sequence/context parallelism, fused kernels, fp16.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types

import torch

from vcpo.upstream import require

DEVICE = "cpu"

# megatron TransformerConfig fields the engine needs on CPU, passed through verl's
# ``McoreEngineConfig.override_transformer_config`` (mbridge applies them after its own defaults).
CPU_TRANSFORMER_CONFIG = {
    # explicit rather than required at megatron-core 0.16.1 (defaults already off, or a torch fallback when the CUDA
    # kernel is missing, or the torch.cuda.current_device shim below):
    "use_cpu_initialization": True,  # weights initialised on the host, not torch.cuda.current_device()
    "gradient_accumulation_fusion": False,  # the fused_weight_gradient_mlp_cuda extension
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "apply_rope_fusion": False,
    "persist_layer_norm": False,  # apex's persistent LayerNorm; torch's norms refuse it
}

_ENABLED = False
# what a worker prints once its Megatron engine is constructed on the CPU platform (see `install`)
ENGINE_BUILT = "vcpo cpu megatron engine:"


# --------------------------------------------------------------------------------------------------------
# process-wide torch.cuda entry points
# --------------------------------------------------------------------------------------------------------


def _tensor_cuda_identity(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    return self


def _patch_torch_cuda() -> None:
    # mbridge's get_model moves the model to torch.cuda.current_device(), and megatron allocates there
    # (p2p buffers of the pipeline schedule, DDP grad buffers, local attention's memory buffer): the host.
    torch.cuda.current_device = lambda: torch.device(DEVICE)
    # ... through Module.cuda(device) -> Tensor.cuda, which a CPU build of torch refuses: identity.
    torch.Tensor.cuda = _tensor_cuda_identity
    # megatron's p2p shape exchange (pipeline schedule, variable_seq_lengths) synchronises the stream.
    torch.cuda.synchronize = lambda *args, **kwargs: None


class _CudaLiteralsOnHost(types.ModuleType):
    """``torch`` for one megatron module, with ``device='cuda'`` literals of factory calls sent to the host."""

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like", "empty_like")

    def __init__(self) -> None:
        super().__init__("torch", "torch with 'cuda' factory literals answered on the host")

    def __getattr__(self, name: str):
        value = getattr(torch, name)
        if name in self._FACTORIES:

            @functools.wraps(value)
            def factory(*args, **kwargs):
                device = kwargs.get("device")
                if device is not None and torch.device(device).type == "cuda":
                    kwargs["device"] = DEVICE
                return value(*args, **kwargs)

            return factory
        return value


def _patch_cuda_literals() -> None:
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizer
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.utils as core_utils

    proxy = _CudaLiteralsOnHost()
    # device='cuda' literals: found_inf/scale tensors of the optimizer, the grad-norm reduction of
    # clip_grads and of the local multi-tensor l2 norm (no apex/TE), total_num_tokens in the schedules.
    # (fp16's grad scaler has more; verl's fp16 needs TE's precision-aware optimizer anyway.)
    for module in (optimizer, clip_grads, core_utils, schedules):
        module.torch = proxy


# --------------------------------------------------------------------------------------------------------
# megatron: tensor type names, RNG tracker
# --------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _cuda_type_names():
    """``Tensor.type()`` of host tensors reported as their CUDA names ('torch.cuda.BFloat16Tensor')."""
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        name = original(self, dtype, non_blocking, **kwargs)
        if dtype is None and not self.is_cuda and name.startswith("torch.") and not self.is_sparse:
            return "torch.cuda." + name[len("torch.") :]
        return name

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _with_cuda_type_names(function):
    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        with _cuda_type_names():
            return function(*args, **kwargs)

    wrapped.__vcpo_cpu_shim__ = True
    return wrapped


def _patch_type_checks() -> None:
    import megatron.core.optimizer.clip_grads as clip_grads
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    # megatron sorts parameters into bf16/fp16/fp32 groups by param.type() in
    # ('torch.cuda.BFloat16Tensor', ...) and raises TypeError for host tensors ('torch.BFloat16Tensor').
    Float16OptimizerWithFloat16Params.__init__ = _with_cuda_type_names(Float16OptimizerWithFloat16Params.__init__)
    DistributedOptimizer._build_model_and_main_param_groups = classmethod(
        _with_cuda_type_names(DistributedOptimizer.__dict__["_build_model_and_main_param_groups"].__func__)
    )
    # clip_grad_by_total_norm_fp32 asserts param.grad.type() == 'torch.cuda.FloatTensor'.
    clip_grads.clip_grad_by_total_norm_fp32 = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    import megatron.core.optimizer.optimizer as optimizer_module

    if hasattr(optimizer_module, "clip_grad_by_total_norm_fp32"):
        optimizer_module.clip_grad_by_total_norm_fp32 = clip_grads.clip_grad_by_total_norm_fp32


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as megatron_random

    class HostRNGStatesTracker(megatron_random.CudaRNGStatesTracker):
        """megatron's RNG tracker over the host generator (named states added, forked and restored)."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            original = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(original)

        @contextlib.contextmanager
        def fork(self, name=megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            original = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(original)

    # megatron's activation recompute (tensor_parallel.checkpoint: the selective recompute of core_attn that OPOB's local
    # layers use) saves and restores the CUDA generator's state around the recomputed forward: the host generator's.
    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    megatron_random._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)
    # verl seeds megatron's tracker (model_parallel_cuda_manual_seed) whenever its platform reports a
    # device; the CUDA tracker reads and writes torch.cuda RNG states, which a CPU build of torch lacks.
    # initialize_rng_tracker instantiates the class by this module-level name.
    megatron_random.CudaRNGStatesTracker = HostRNGStatesTracker
    tracker = megatron_random._CUDA_RNG_STATE_TRACKER
    if tracker is not None and not isinstance(tracker, HostRNGStatesTracker):
        megatron_random.initialize_rng_tracker(force_reset=True)


# --------------------------------------------------------------------------------------------------------
# registration
# --------------------------------------------------------------------------------------------------------


def register_cpu_megatron_engines(language_model_cls=None, value_model_cls=None) -> None:
    """Register megatron engine classes for the cpu device (verl's own by default); idempotent.

    verl registers ``MegatronEngineWithLMHead`` / ``MegatronEngineWithValueHead`` for cuda and npu only,
    so ``EngineRegistry.get_engine_cls(model_type, "megatron")`` raises on the CPU platform.
    """
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead, MegatronEngineWithValueHead

    require("cpu_engine_registry")
    pairs = (
        ("language_model", language_model_cls or MegatronEngineWithLMHead),
        ("value_model", value_model_cls or MegatronEngineWithValueHead),
    )
    for model_type, engine_cls in pairs:
        registry = EngineRegistry._engines.setdefault(model_type, {})
        if registry.get("megatron", {}).get(DEVICE) is engine_cls:
            continue
        registry.get("megatron", {}).pop(DEVICE, None)
        EngineRegistry.register(model_type=model_type, backend="megatron", device=DEVICE)(engine_cls)


def enable_megatron_on_cpu() -> None:
    """Apply every shim of this module and register the megatron engines for the cpu device; idempotent."""
    global _ENABLED
    if _ENABLED:
        return
    require("megatron_on_cpu")
    _patch_torch_cuda()
    _patch_cuda_literals()
    _patch_type_checks()
    _patch_rng_tracker()
    # mbridge's spec follows transformer_impl="local" (the CPU recipe's, as OPOB's), and megatron's local attention takes
    # verl's padded mask; imported here, at the engine's construction: importing vcpo.verl_plugin.engine while
    # `import verl` loads this plugin would ask for the device
    from vcpo.verl_plugin.engine.layer_spec import honour_transformer_impl

    honour_transformer_impl()
    register_cpu_megatron_engines()
    _ENABLED = True


def install() -> None:
    """What the CPU plugin does at import (``vcpo.verl_plugin.cpu``, in the driver and every Ray worker); idempotent.

    Registers verl's Megatron engines for the cpu device (verl's registry lookup precedes construction) and
    makes the construction of any Megatron engine (verl's ``MegatronEngine.__init__``, which the vcpo engine's
    runs too) apply :func:`enable_megatron_on_cpu` first when verl's device is the cpu. The shims change
    ``torch.cuda`` entry points process-wide, so they are applied only in the workers that build a Megatron
    engine on the CPU platform, never at import: an FSDP run (or a process on a GPU platform) is unchanged.
    Nothing happens where verl's Megatron engine cannot be imported (no megatron-core or mbridge)."""
    try:
        from verl.workers.engine.megatron.transformer_impl import MegatronEngine
    except ImportError:
        return
    register_cpu_megatron_engines()
    init = MegatronEngine.__init__
    if getattr(init, "__vcpo_cpu_shim__", False):
        return
    require("megatron_construction_on_cpu")

    @functools.wraps(init)
    def init_with_cpu_shims(self, *args, **kwargs):
        from verl.utils.device import get_device_name

        if get_device_name() != DEVICE:
            return init(self, *args, **kwargs)
        enable_megatron_on_cpu()
        init(self, *args, **kwargs)
        # one line per rank in the worker's output (Ray forwards it to the driver's log): which engine runs
        config = self.engine_config
        print(
            f"{ENGINE_BUILT} {type(self).__name__} (backend megatron, device {DEVICE}, gloo; "
            f"TP {config.tensor_model_parallel_size}, PP {config.pipeline_model_parallel_size}, "
            f"CP {config.context_parallel_size}, dtype {config.dtype}, rank {torch.distributed.get_rank()})",
            file=sys.stderr,
            flush=True,
        )

    init_with_cpu_shims.__vcpo_cpu_shim__ = True
    MegatronEngine.__init__ = init_with_cpu_shims


__all__ = ["CPU_TRANSFORMER_CONFIG", "ENGINE_BUILT", "enable_megatron_on_cpu", "install", "register_cpu_megatron_engines"]
