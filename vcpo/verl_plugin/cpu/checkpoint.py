"""A host-memory checkpoint engine for verl, registered as ``actor_rollout_ref.rollout.checkpoint_engine.backend=ray``.

Why it exists: verl's ``separate_async`` trainer (trainer and rollout on separate workers, the off-policy
layout the paper's PipelineRL-k runs use) syncs weights with a *checkpoint engine*
(``verl.checkpoint_engine``): NCCL, HCCL, NIXL, Mooncake, all device transports; the in-process "naive"
engine is refused there (``trainer_separate_async.py``: "please use nccl/nixl/mooncake, etc."). This engine
moves the trainer's full tensors through Ray's object store instead, so the layout runs on CPU. It is
registered with verl's own ``CheckpointEngineRegistry.register``.

Protocol per sync (``CheckpointEngineManager.update_weights``): every actor rank drains its weight generator
(FSDP's full-tensor gather is collective); rank 0 puts the tensors in the object store and hands the
reference to a named mailbox actor under a round number; every rollout worker waits in
``receive_weights`` for that round and yields the tensors to its server adapter (``HFServerAdapter``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterable
from typing import Any

import ray
import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

BACKEND = "ray"
MAILBOX_NAME = "vcpo_cpu_weight_mailbox"


class WeightMailbox:
    """Holds the latest round's object reference; receivers wait for a round newer than theirs."""

    def __init__(self) -> None:
        self.round = 0
        self.refs: list[ray.ObjectRef] = []
        self.global_steps: int | None = None
        self._changed = asyncio.Condition()

    async def put(self, refs: list[ray.ObjectRef], global_steps: int | None) -> int:
        async with self._changed:
            self.round += 1
            self.refs, self.global_steps = refs, global_steps
            self._changed.notify_all()
            return self.round

    async def get(self, after_round: int) -> tuple[int, list[ray.ObjectRef], int | None]:
        async with self._changed:
            await self._changed.wait_for(lambda: self.round > after_round)
            return self.round, self.refs, self.global_steps


_MAILBOX = None


def _mailbox():
    # Kept in a module global: Ray garbage-collects a non-detached named actor once no handle to it is left,
    # which would drop a round between the sender's put and the receivers' get.
    global _MAILBOX
    if _MAILBOX is None:
        _MAILBOX = (
            ray.remote(WeightMailbox)
            .options(name=MAILBOX_NAME, get_if_exists=True, num_cpus=0, max_concurrency=64)
            .remote()
        )
    return _MAILBOX


async def host_named_tensors(weights: Iterable | AsyncGenerator) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a sync or async weight iterator, each tensor whole (DTensors gathered),
    detached and copied to host memory."""

    def host(tensor: torch.Tensor) -> torch.Tensor:
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        return full.detach().to("cpu").clone()

    if hasattr(weights, "__aiter__"):
        return [(name, host(tensor)) async for name, tensor in weights]
    return [(name, host(tensor)) for name, tensor in weights]


@CheckpointEngineRegistry.register(BACKEND)
class RayObjectStoreCheckpointEngine(CheckpointEngine):
    """Trainer -> rollout weight transfer through the Ray object store (host memory, any device)."""

    def __init__(self, bucket_size: int = 0, is_master: bool = False, **_: Any) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.rank = 0
        self.world_size = 1
        self.seen_round = 0

    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        world = actor_wg_world_size + rollout_world_size
        actor = {"rank": list(range(actor_wg_world_size)), "world_size": [world] * actor_wg_world_size}
        rollout = {
            "rank": list(range(actor_wg_world_size, world)),
            "world_size": [world] * rollout_world_size,
        }
        return actor, rollout

    def init_process_group(self, rank: int = 0, world_size: int = 1, **_: Any) -> None:
        self.rank, self.world_size = rank, world_size

    def finalize(self) -> None:
        return None

    async def send_weights(self, weights: Iterable | AsyncGenerator, global_steps: int | None = None):
        named = await host_named_tensors(weights)
        if self.is_master:
            await _mailbox().put.remote([ray.put(named)], global_steps)
        return {}

    async def receive_weights(self, global_steps: int | None = None):
        self.seen_round, refs, _ = await _mailbox().get.remote(self.seen_round)
        for named in await asyncio.gather(*refs):
            for name, tensor in named:
                yield name, tensor
