"""The packages a composed GPU run imports for its attention, its cross-entropy and its weight sync, checked before a
real launch (not the dry run, which may be on a laptop).

verl fails late or falls back silently where one is missing: a model built with ``flash_attention_2`` fails in a worker
minutes after the start; without flash-attn's cross-entropy verl's log-probs take a log-softmax that holds the logits
twice; megatron's Transformer Engine layers and its flash attention backend, and the nccl weight sync's cupy, fail at
the first step. The ``gpu`` extra installs every one of them.
"""

from __future__ import annotations

from importlib import import_module

from vcpo.launch.run import LaunchError

INSTALL = "pip install -e '.[gpu]'"


def needed_modules(config) -> list[tuple[str, str, str]]:
    """(module, the package that installs it, what the run imports it for) of a composed verl config."""
    actor = config.actor_rollout_ref.actor
    needed = []
    if actor.strategy == "megatron":
        transformer = actor.megatron.get("override_transformer_config", None) or {}
        if transformer.get("transformer_impl", "transformer_engine") != "local":  # megatron's default
            needed.append(("transformer_engine.pytorch", "transformer-engine", "megatron's Transformer Engine layers"))
            if transformer.get("attention_backend", None) == "flash":
                needed.append(("flash_attn", "flash-attn", "Transformer Engine's flash attention backend"))
    else:
        attention = (config.actor_rollout_ref.model.get("override_config", None) or {}).get("attn_implementation",
                                                                                             "flash_attention_2")
        if attention == "flash_attention_2":  # verl's HFModelConfig default
            needed.append(("flash_attn", "flash-attn", "the actor's attention (attn_implementation=flash_attention_2)"))
        needed.append(("flash_attn.ops.triton.cross_entropy", "flash-attn",
                       "verl's log-prob cross-entropy (without it, a log-softmax holding the logits twice)"))
    if config.actor_rollout_ref.rollout.get("checkpoint_engine", {}).get("backend", None) == "nccl":
        needed.append(("cupy", "cupy-cuda13x", "the weight sync to the rollout (checkpoint_engine.backend=nccl)"))
    return needed


def check_gpu_packages(config) -> None:
    """Refuse a launch whose attention, cross-entropy or weight sync cannot be imported: a LaunchError naming the
    package, what needs it and why the import failed."""
    for module, package, needed_for in needed_modules(config):
        try:
            import_module(module)
        except Exception as error:  # a broken build raises OSError or RuntimeError as well as ImportError
            raise LaunchError(f"{package} is not importable ({module}: {type(error).__name__}: {error}), and {needed_for} "
                              f"needs it; {INSTALL}") from None


__all__ = ["check_gpu_packages", "needed_modules"]
