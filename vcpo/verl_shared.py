"""What verl_plugin's modules and the launcher share, importable without importing verl.

The launcher reads these before any verl import, and the engine imports them while ``import verl`` is
still loading its external modules (where ``vcpo.verl_plugin`` may be half imported), so this module
imports nothing from verl and lives outside ``vcpo.verl_plugin`` (importing it would import verl).
"""

from __future__ import annotations

import torch

# The engine extension (ESS step size, OPOB): its module, and the model type it is registered under.
ENGINE_MODULE = "vcpo.verl_plugin.engine"
ENGINE_MODEL_TYPE = "vcpo_language_model"
# verl imports the modules listed (comma-separated) in this environment variable inside `import verl`.
EXTERNAL_MODULES = "VERL_USE_EXTERNAL_MODULES"
# The CPU platform and rollout of `python -m vcpo.verl_plugin.cpu` (verl on a CPU-only torch).
CPU_PLATFORM_MODULE = "vcpo.verl_plugin.cpu"
# The actor's FSDP mixed-precision setting and its all-fp32 value (the CPU runner; OPOB on verl, whose
# per-sequence gradients do not run under autocast), as a mapping and in Hydra's override grammar.
MIXED_PRECISION_KEY = "actor_rollout_ref.actor.fsdp_config.mixed_precision"
FP32_MIXED_PRECISION = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
FP32_MIXED_PRECISION_HYDRA = "{" + ",".join(f"{key}:{value}" for key, value in FP32_MIXED_PRECISION.items()) + "}"


def metrics_to_floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """One device-to-host copy for all metrics instead of one sync per ``.item()``."""
    if not metrics:
        return {}
    values = torch.stack([value.detach().to(torch.float64).reshape(()) for value in metrics.values()]).tolist()
    return dict(zip(metrics, values, strict=True))
