"""The ESS step-size rule (VCPO Eq. 5) applied to real optimizer steps.

`scaled_learning_rate` must make the optimizer step with η·scale, where scale comes from
`ess_step_scale(ess_ratio(s))`, and restore η afterwards, also when the step raises.
"""

from __future__ import annotations

import math

import pytest
import torch

from vcpo.core.ess import ess_ratio, ess_step_scale, scaled_learning_rate


def _model_with_grads(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2)).double()
    model(torch.randn(5, 4, dtype=torch.float64)).pow(2).sum().backward()
    return model


def _direct_ess_scale(seq_log_weights: torch.Tensor, rho_on: float) -> float:
    """sqrt(min(1, (Σw)² / (B Σw²) / ρ_on)) from the weights themselves (small log-weights only)."""
    w = [math.exp(s) for s in seq_log_weights.tolist()]
    ratio = sum(w) ** 2 / sum(x * x for x in w) / len(w)
    return math.sqrt(min(1.0, ratio / rho_on))


SEQ_LOG_WEIGHTS = torch.tensor([0.3, -1.2, 2.0, 0.0, -0.4], dtype=torch.float64)


@pytest.mark.parametrize("rho_on", [1.0, 0.55])
def test_sgd_step_uses_the_ess_scaled_learning_rate(rho_on):
    scale = ess_step_scale(ess_ratio(SEQ_LOG_WEIGHTS), rho_on=rho_on)
    assert scale == pytest.approx(_direct_ess_scale(SEQ_LOG_WEIGHTS, rho_on), rel=1e-12)
    assert scale < 1.0
    model = _model_with_grads()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with scaled_learning_rate(optimizer, scale):
        optimizer.step()
    for p, p0 in zip(model.parameters(), before, strict=True):
        assert torch.allclose(p.detach(), p0 - 0.1 * scale * p.grad, rtol=1e-14, atol=1e-15)
    assert optimizer.param_groups[0]["lr"] == 0.1


def test_adamw_step_equals_a_step_at_the_scaled_rate_and_restores_every_group():
    """Two param groups with their own rates; AdamW's decoupled decay also uses the scaled rate."""
    scale = ess_step_scale(ess_ratio(SEQ_LOG_WEIGHTS))
    scaled, reference = _model_with_grads(1), _model_with_grads(1)

    def groups(model, factor):
        return [
            {"params": model[0].parameters(), "lr": 1e-2 * factor},
            {"params": model[2].parameters(), "lr": 3e-3 * factor},
        ]

    optimizer = torch.optim.AdamW(groups(scaled, 1.0), weight_decay=0.1)
    with scaled_learning_rate(optimizer, scale):
        optimizer.step()
    torch.optim.AdamW(groups(reference, scale), weight_decay=0.1).step()
    for p, q in zip(scaled.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-14, atol=1e-16)
    assert [group["lr"] for group in optimizer.param_groups] == [1e-2, 3e-3]
    # The next step (outside the block) is taken at the unscaled rate again.
    optimizer.step()
    assert [group["lr"] for group in optimizer.param_groups] == [1e-2, 3e-3]


def test_learning_rate_is_restored_when_the_step_raises():
    model = _model_with_grads()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with pytest.raises(RuntimeError, match="step failed"):
        with scaled_learning_rate(optimizer, 0.25):
            assert optimizer.param_groups[0]["lr"] == 0.125
            raise RuntimeError("step failed")
    assert optimizer.param_groups[0]["lr"] == 0.5


def test_on_policy_weights_leave_the_step_unchanged():
    assert ess_step_scale(ess_ratio(torch.zeros(6, dtype=torch.float64))) == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize("scale", [-0.1, math.inf, math.nan])
def test_bad_scale_is_rejected_before_touching_the_rate(scale):
    optimizer = torch.optim.SGD(_model_with_grads().parameters(), lr=0.5)
    with pytest.raises(ValueError, match="scale"):
        with scaled_learning_rate(optimizer, scale):
            pass
    assert optimizer.param_groups[0]["lr"] == 0.5
