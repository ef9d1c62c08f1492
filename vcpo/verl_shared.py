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


def metrics_to_floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """One device-to-host copy for all metrics instead of one sync per ``.item()``."""
    if not metrics:
        return {}
    values = torch.stack([value.detach().to(torch.float64).reshape(()) for value in metrics.values()]).tolist()
    return dict(zip(metrics, values, strict=True))
