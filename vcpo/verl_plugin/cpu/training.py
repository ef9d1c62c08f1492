"""verl's FSDP training engines, registered for the ``cpu`` device.

Why it exists: verl picks a training engine by (model type, backend, device, vendor) in
``verl.workers.engine.base.EngineRegistry``; its FSDP engines (``FSDPEngineWithLMHead`` for the actor and
reference, ``FSDPEngineWithValueHead`` for a critic) are registered for ``cuda`` and ``npu`` only, so on
the CPU platform ``EngineRegistry.get_engine_cls`` raises ``No engine registered for device='cpu'``.
The engines themselves are device-generic (they go through ``get_device_name()`` / ``get_torch_device()``),
so this module registers the same classes for ``cpu`` with verl's own ``EngineRegistry.register``.

:func:`register_cpu_engines` takes further engine classes (e.g. a vcpo engine extension) so that they
are selectable on CPU too.
"""

from __future__ import annotations

from verl.workers.engine.base import EngineRegistry

from vcpo.upstream import require

DEVICE = "cpu"


def register_cpu_engines(language_model_cls=None, value_model_cls=None, backends=("fsdp", "fsdp2")) -> None:
    """Register FSDP engine classes for the cpu device (verl's own classes by default); idempotent."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    require("cpu_engine_registry")
    pairs = (
        ("language_model", language_model_cls or FSDPEngineWithLMHead),
        ("value_model", value_model_cls or FSDPEngineWithValueHead),
    )
    for model_type, engine_cls in pairs:
        registry = EngineRegistry._engines.setdefault(model_type, {})
        for backend in backends:
            if registry.get(backend, {}).get(DEVICE) is engine_cls:
                continue
            registry.get(backend, {}).pop(DEVICE, None)  # a later registration (an extension) replaces ours
            EngineRegistry.register(model_type=model_type, backend=backend, device=DEVICE)(engine_cls)


register_cpu_engines()
