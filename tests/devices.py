"""The device the exactness tests of PerSequenceGradients run on: CPU, or ``VCPO_TEST_DEVICE`` (e.g.
``cuda``, as benchmarks/gpu_check.py sets it). Models and batches are built on the CPU from seeded
generators, then moved, so every device sees the same numbers."""

import os

import torch

DEVICE = torch.device(os.environ.get("VCPO_TEST_DEVICE", "cpu"))


def on_device(values: dict) -> dict:
    """A batch dict with its tensors (and lists of tensors) on DEVICE."""

    def move(value):
        if isinstance(value, torch.Tensor):
            return value.to(DEVICE)
        if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            return [item.to(DEVICE) for item in value]
        return value

    return {key: move(value) for key, value in values.items()}
