"""A CPU platform for verl's platform registry (``verl.plugin.platform``).

Why it exists: verl 0.9.1 resolves every device question (device name, ``torch.<device>`` module,
collective backend, Ray resource) through one platform singleton chosen at first use by
``verl.plugin.platform.platform_manager.get_platform``. It ships CUDA, NPU and ROCm platforms only; on a
machine without an accelerator it falls back to ``nvidia`` and the first ``torch.cuda`` call fails. This
module registers a ``cpu`` platform under verl's own extension point (``PlatformRegistry.register``) so
that verl's FSDP engine, checkpointing and rollout code run on CPU with the ``gloo`` backend, unchanged.

Selection: verl picks a platform from the ``VERL_PLATFORM`` environment variable before any
auto-detection (``platform_manager._detect_platform_name``), so ``VERL_PLATFORM=cpu`` selects this one.
The platform is never auto-detected (``is_platform_available`` is False), so importing this module
changes nothing for a process that does not ask for it. Ray workers inherit the driver's environment,
so the variable reaches every verl process of a local Ray cluster.

Ray resources: verl's resource pools always reserve one ``ray_resource_name()`` unit per worker
(``ResourcePoolManager.create_resource_pool`` passes ``use_gpu=True``) and check the node's ``GPU``
count. The platform keeps the name ``GPU``; the driver declares as many logical GPU slots as workers it
wants (``+ray_kwargs.ray_init.num_gpus=N``). These are plain Ray bookkeeping units, no device is touched:
``torch.cuda`` is never called on this platform.

``device_module`` is :data:`cpu_device_module`, a stand-in for ``torch.cuda`` that answers the calls verl
makes on ``get_torch_device()`` (``empty_cache``, ``synchronize``, memory statistics, RNG state, streams)
with their CPU meaning, and forwards everything else to ``torch.cpu``.
"""

from __future__ import annotations

import os
import sys
import types
from contextlib import contextmanager, nullcontext
from typing import Any

import psutil
import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

from vcpo.verl_contract import CPU_PLATFORM_NAME as PLATFORM_NAME
from vcpo.verl_contract import TRAINER_THREADS_ENV


class _CpuDeviceModule(types.ModuleType):
    """``torch.cuda``-shaped namespace for the host: memory calls are no-ops or host figures."""

    def __init__(self) -> None:
        super().__init__("vcpo.verl_plugin.cpu.device_module", "torch.cuda stand-in for the CPU platform")

    # --- device management -------------------------------------------------------------------
    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    # --- memory -------------------------------------------------------------------------------
    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def ipc_collect() -> None:
        return None

    @staticmethod
    def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
        return None

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return int(psutil.Process().memory_info().rss)

    memory_reserved = memory_allocated
    max_memory_allocated = memory_allocated
    max_memory_reserved = memory_allocated

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    # --- RNG ----------------------------------------------------------------------------------
    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    # --- streams and events: torch.cpu has host versions ---------------------------------------
    Stream = torch.cpu.Stream
    Event = torch.cpu.Event

    @staticmethod
    def current_stream(device: Any = None):
        return torch.cpu.current_stream(device)

    @staticmethod
    def stream(stream: Any = None):
        return nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)


cpu_device_module = _CpuDeviceModule()


@PlatformRegistry.register(platform=PLATFORM_NAME)
class PlatformCPU(PlatformBase):
    """verl platform for CPU-only hosts: device ``cpu``, backend ``gloo``, Ray slots named ``GPU``."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return cpu_device_module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Only ever chosen explicitly (VERL_PLATFORM=cpu), never by auto-detection.
        return False

    def current_device(self) -> str:
        # verl moves tensors with ``.to(get_device_id())``; an int would mean an accelerator index.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        # verl asks for the backend only to build its global process group, as the string
        # f"cpu:gloo,{device_name}:{backend}" (verl/utils/distributed.py:63 and :89), which torch rejects
        # when the device is cpu ("Duplicate device type cpu in backend string"). When that is the caller,
        # create the group here with plain gloo: verl's helper checks ``is_initialized()`` right after
        # building the string and keeps an existing group.
        caller = sys._getframe(2).f_globals.get("__name__") if _stack_depth() > 2 else None
        if caller == "verl.utils.distributed":
            init_gloo_process_group()
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # Ray sets CUDA_VISIBLE_DEVICES for the logical GPU slots; nothing reads it on this platform.
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def rollout_env_vars(self) -> dict[str, str]:
        return {"VERL_PLATFORM": PLATFORM_NAME}

    def cudart(self) -> Any:
        return None


def _stack_depth() -> int:
    depth, frame = 0, sys._getframe(0)
    while frame is not None and depth < 3:
        frame, depth = frame.f_back, depth + 1
    return depth


def init_gloo_process_group() -> None:
    """Create torch's default process group with gloo from verl's worker environment (RANK, WORLD_SIZE, ...).

    Only the trainer's workers build verl's process group, so this is where a trainer process takes the BLAS threads
    ``TRAINER_THREADS_ENV`` gives it (the rollout server and the reward workers keep ``OMP_NUM_THREADS``)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if os.environ.get(TRAINER_THREADS_ENV):
        torch.set_num_threads(int(os.environ[TRAINER_THREADS_ENV]))
    dist.init_process_group(
        backend="gloo",
        rank=int(os.environ.get("RANK", "0")),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        init_method=os.environ.get("DIST_INIT_METHOD", None),
    )
