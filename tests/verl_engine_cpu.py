"""Test seam: verl's FSDP engine with its module left unwrapped, in float64.

verl's FSDP mixed-precision policies know fp32, bf16 and fp16 only, so an engine whose step must match
float64 references keeps its module unwrapped: `build_engine` is `vcpo.verl_plugin.cpu.standalone`'s,
through the CPU platform, with one replacement: ``FSDPEngine._build_fsdp_module`` returns the module
as it is (and fp32 autocast, i.e. none). Tests that need FSDP2 wrap that module with ``fully_shard``
themselves, in float64. Everything else is verl's code.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import torch
from verl.workers.engine.fsdp import transformer_impl

from vcpo.verl_plugin.cpu import standalone
from vcpo.verl_plugin.cpu.standalone import RawBatch, actor_batch, actor_config, save_random_qwen2
from vcpo.verl_plugin.engine.fsdp import VcpoFSDPEngineWithLMHead


def _unwrapped(self, module):
    self._autocast_dtype, self.scaler = torch.float32, None
    return module


def build_engine(
    model_dir: str | Path,
    remove_padding: bool,
    lr: float = 1e-3,
    dtype: torch.dtype = torch.float64,
    mixed_precision: dict | None = None,
) -> VcpoFSDPEngineWithLMHead:
    """`standalone.build_engine` with the module unwrapped, then cast to ``dtype`` in place (the
    optimizer keeps the same Parameters)."""
    with mock.patch.object(transformer_impl.FSDPEngine, "_build_fsdp_module", _unwrapped):
        engine = standalone.build_engine(model_dir, remove_padding, lr=lr, mixed_precision=mixed_precision)
    engine.module.to(dtype)
    return engine


__all__ = ["RawBatch", "actor_batch", "actor_config", "build_engine", "save_random_qwen2"]
