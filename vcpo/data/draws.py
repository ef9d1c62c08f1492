"""Problems drawn offline from Reasoning Gym: the one place its datasets are created, for the paper's Countdown set
(`vcpo.data.countdown`), the starter tasks (`vcpo.data.generated`) and the simulator's tasks (`vcpo.sim.tasks`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def reasoning_gym_draws(generator: str, config: dict[str, Any], size: int, seed: int) -> Sequence[dict[str, Any]]:
    """``size`` seeded draws of Reasoning Gym's ``generator`` under ``config`` (its keyword arguments). Entry i
    depends on ``seed`` and i alone, so a longer draw begins with a shorter one and chunks can be drawn apart."""
    import reasoning_gym  # imports sympy: only where problems are drawn

    return reasoning_gym.create_dataset(generator, size=size, seed=seed, **config)
