"""OTB's logit-energy proxy against autograd: Σ_t ||∇_z log softmax(z_t)_{y_t}||² per sequence."""

import math

import torch

from vcpo.core import logit_energy_proxy


def autograd_energy(logits, tokens, mask):
    """Reference: one backward per token, the squared norm of the logit gradient of log π(y_t), float64."""
    out = torch.zeros(logits.shape[0], dtype=torch.float64)
    for i in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            if not mask[i, t]:
                continue
            z = logits[i, t].detach().to(torch.float64).requires_grad_(True)
            (grad,) = torch.autograd.grad(torch.log_softmax(z, -1)[tokens[i, t]], z)
            out[i] += float(mask[i, t]) * float((grad**2).sum())
    return out


def case(seed=0, batch=3, steps=5, vocab=11, scale=3.0):
    generator = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(batch, steps, vocab, generator=generator, dtype=torch.float64)
    tokens = torch.randint(vocab, (batch, steps), generator=generator)
    mask = torch.ones(batch, steps, dtype=torch.bool)
    return logits, tokens, mask


def test_proxy_is_the_squared_logit_gradient_norm():
    logits, tokens, mask = case()
    logits[0, 0, tokens[0, 0]] = 40.0  # π(y) ≈ 1: the closed form must not cancel
    ours = logit_energy_proxy(logits, tokens, mask)
    assert ours.dtype == torch.float64 and ours.shape == (3,)
    torch.testing.assert_close(ours, autograd_energy(logits, tokens, mask), rtol=1e-10, atol=1e-10)
    pi = torch.softmax(logits, -1)
    verl = (1 - 2 * pi.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) + (pi**2).sum(-1)).sum(-1)  # verl's form
    torch.testing.assert_close(ours, verl, rtol=1e-10, atol=1e-10)


def test_masked_positions_add_nothing_whatever_their_logits():
    logits, tokens, mask = case(seed=1)
    mask[0, 3:] = False
    mask[2, :] = False
    padded = logits.clone()
    padded[0, 3:] = -math.inf  # padding rows of all -inf logits
    padded[2] = math.nan
    tokens[0, 4] = -100  # an ignore index at a masked position
    ours = logit_energy_proxy(padded, tokens, mask)
    assert torch.isfinite(ours).all() and ours[2] == 0
    torch.testing.assert_close(ours, autograd_energy(logits, tokens.clamp_min(0), mask), rtol=1e-10, atol=1e-10)
    weights = mask.double() * 0.5
    torch.testing.assert_close(logit_energy_proxy(padded, tokens, weights), ours * 0.5, rtol=1e-12, atol=0)


def test_minus_infinity_logits():
    logits, tokens, mask = case(seed=2)
    logits[0, :, 0] = -math.inf  # a banned token, never chosen: π = 0
    tokens[0] = torch.where(tokens[0] == 0, 1, tokens[0])
    logits[1, 2, tokens[1, 2]] = -math.inf  # the chosen token has π = 0: energy 1 + Σ π²
    ours = logit_energy_proxy(logits, tokens, mask)
    assert torch.isfinite(ours).all()
    finite = torch.where(torch.isinf(logits), -1e4, logits)  # same distribution to float64 precision
    torch.testing.assert_close(ours, autograd_energy(finite, tokens, mask), rtol=1e-10, atol=1e-10)
    pi = torch.softmax(logits[1, 2], -1)
    single = logit_energy_proxy(logits[1:2, 2:3], tokens[1:2, 2:3], mask[1:2, 2:3])
    torch.testing.assert_close(single, (1 + (pi**2).sum()).reshape(1), rtol=1e-12, atol=0)


def test_float32_logits_agree_with_float64():
    logits, tokens, mask = case(seed=3, vocab=1000)
    ours = logit_energy_proxy(logits.float(), tokens, mask)
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, logit_energy_proxy(logits, tokens, mask), rtol=1e-5, atol=1e-6)
