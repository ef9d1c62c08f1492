"""VCPO's ESS step size and single-backward OPOB update inside verl 0.9.1's training engines: this package registers
them, its modules hold them (`fsdp`, `megatron`: where the gradients live and how they are reduced; `step`: what both
do per optimizer step; `rule`: the preset's rule from the loss function verl hands the engine; `batch`: the batch's
tensors; `layer_spec`: the local layers OPOB trains on Megatron).

The seam. verl builds the actor's (and reference's) engine with
``EngineRegistry.new(model_type=actor_rollout_ref.model.model_type, backend=<actor strategy>)``
(``verl/workers/engine_workers.py``), and ``HFModelConfig.model_type`` is an ordinary config field. This
package registers ``VcpoFSDPEngineWithLMHead`` (a subclass of verl's ``FSDPEngineWithLMHead``) for the
``fsdp``/``fsdp2`` backends and ``VcpoMegatronEngineWithLMHead`` (of verl's ``MegatronEngineWithLMHead``) for
``megatron`` under the model type ``vcpo_language_model``, so a run selects them with::

    +actor_rollout_ref.model.model_type=vcpo_language_model
    actor_rollout_ref.actor.policy_loss._target_=vcpo.verl_plugin.VcpoPolicyLossConfig
    actor_rollout_ref.actor.policy_loss.loss_mode=seq_tis
    +actor_rollout_ref.actor.policy_loss.method=vcpo     # or tis_ess (ESS only) / tis_opob (OPOB only)
    actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean   # the preset's aggregation (checked)

(``+`` because verl's YAML has no ``model_type`` key). No verl file is edited. The package must be
imported in every worker process before the engine is built: through the ``verl.plugins`` entry point
(``vcpo.verl_plugin`` importing this package), or ``VERL_USE_EXTERNAL_MODULES=vcpo.verl_plugin.engine``.
"""

from __future__ import annotations

from verl.workers.engine.base import BaseEngine, EngineRegistry

from vcpo.verl_contract import ENGINE_MODEL_TYPE
from vcpo.verl_plugin.engine.fsdp import VcpoFSDPEngineWithLMHead

DEVICES = ["cuda", "npu", "cpu"]

EngineRegistry.register(model_type=ENGINE_MODEL_TYPE, backend=["fsdp", "fsdp2"], device=DEVICES)(VcpoFSDPEngineWithLMHead)


try:
    from vcpo.verl_plugin.engine.megatron import VcpoMegatronEngineWithLMHead
except ImportError as missing:  # megatron-core (the `gpu` extra) not installed
    _megatron_missing = missing

    class VcpoMegatronEngineWithLMHead(BaseEngine):
        """Stands in for the Megatron engine where megatron-core cannot be imported: selecting it says why."""

        def __init__(self, *args, **kwargs):
            raise ImportError(f"the vcpo Megatron engine needs megatron-core (pip install 'vcpo[gpu]'): {_megatron_missing}")


EngineRegistry.register(model_type=ENGINE_MODEL_TYPE, backend="megatron", device=DEVICES)(VcpoMegatronEngineWithLMHead)


__all__ = ["VcpoFSDPEngineWithLMHead", "VcpoMegatronEngineWithLMHead"]
