"""Run verl 0.9.1's real PPO trainer on a CPU-only machine, through verl's extension points only.

Why it exists: the tests and CI of this project have no GPU and no vLLM/SGLang, yet the recipes must be
exercised through verl's own trainer (``verl.trainer.main_ppo`` -> ``TaskRunnerV1`` -> ``trainer.v1``,
its workers, agent loop, rollout replicas and reward loop). Nothing here edits verl; it adds:

* :mod:`.platform`: a ``cpu`` platform in verl's platform registry (device ``cpu``, ``gloo``),
  selected with ``VERL_PLATFORM=cpu``;
* :mod:`.rollout`: a ``transformers`` rollout registered as ``actor_rollout_ref.rollout.name=hf``,
  returning per-token log-probs;
* :mod:`.training`: verl's FSDP engines registered for the ``cpu`` device;
* :mod:`.megatron`: verl's Megatron engines registered for the ``cpu`` device, and the shims that run them on
  gloo, applied when a Megatron engine is constructed on the CPU platform (``megatron.install``; not at import:
  they patch ``torch.cuda`` entry points process-wide, which an FSDP worker must not see);
* :mod:`.checkpoint`: a checkpoint engine over Ray's object store (``checkpoint_engine.backend=ray``) for
  the ``separate_async`` trainer, whose device transports (NCCL, ...) do not exist on CPU;
* :mod:`.recipe`: the Hydra overrides of the CPU recipe and its data, and the launcher
  ``python -m vcpo.launch.cpu``.

Loading: every verl process must import this package before its first device question. verl imports
the modules listed in ``VERL_USE_EXTERNAL_MODULES`` inside ``import verl``, so the launcher sets
``VERL_USE_EXTERNAL_MODULES=vcpo.verl_plugin.cpu`` and ``VERL_PLATFORM=cpu`` in its environment, which
the local Ray cluster's workers inherit. (Importing this package also happens through the ``verl.plugins``
entry point if ``vcpo/verl_plugin/__init__.py`` imports it; both are idempotent.)
"""

from vcpo.verl_plugin.cpu import checkpoint, megatron, platform, rollout, training  # noqa: F401  (registration side effects)
from vcpo.verl_plugin.cpu.platform import PLATFORM_NAME, PlatformCPU
from vcpo.verl_plugin.cpu.rollout import ROLLOUT_NAME, HFReplica, HFRolloutServer, HFServerAdapter

megatron.install()

__all__ = ["PLATFORM_NAME", "ROLLOUT_NAME", "HFReplica", "HFRolloutServer", "HFServerAdapter", "PlatformCPU"]
