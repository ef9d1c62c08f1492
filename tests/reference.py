"""Slow float64 references for the policy losses, written independently of vcpo.core.

Plain Python loops over sequences and tokens, ratios as explicit products of exp(), and the
gradient w.r.t. every learner log-prob written out analytically (no autograd). Each reference
returns (loss, grad) with grad a nested list shaped like the (B, T) inputs.
"""

from __future__ import annotations

import math

import torch

LENGTHS = [9, 4, 1, 7, 0, 6]  # a one-token and an all-padding sequence included


def random_batch(seed, scale=0.3, lengths=LENGTHS, T=9, dtype=torch.float64):
    """Random learner/behaviour log-probs and per-sequence advantages; padding holds garbage (-inf, 1e4)."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    mask = torch.arange(T).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    behav = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    log_prob = behav + scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    advantages = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()
    log_prob = torch.where(mask, log_prob, -torch.inf).to(dtype).requires_grad_(True)
    behav = torch.where(mask, behav, 1e4).to(dtype)
    advantages = torch.where(mask, advantages, torch.nan).to(dtype)
    return log_prob, behav, advantages, mask


def _rows(tensor):
    return tensor.detach().double().tolist()


class Inputs:
    """(B, T) tensors as float64 lists, with each sequence's valid token positions."""

    def __init__(self, log_prob, behav_log_prob, advantages, mask):
        self.lp, self.mu, self.adv = _rows(log_prob), _rows(behav_log_prob), _rows(advantages)
        self.mask = mask.bool().tolist()
        self.B, self.T = len(self.mask), len(self.mask[0])
        self.valid = [[t for t in range(self.T) if self.mask[i][t]] for i in range(self.B)]

    def r(self, i, t):
        return self.lp[i][t] - self.mu[i][t]

    def seq_ratio(self, i):
        product = 1.0
        for t in self.valid[i]:
            product *= math.exp(self.r(i, t))
        return product

    def geo_ratio(self, i):
        n = len(self.valid[i])
        return self.seq_ratio(i) ** (1.0 / n) if n else 1.0

    def seq_adv(self, i):
        n = len(self.valid[i])
        return sum(self.adv[i][t] for t in self.valid[i]) / n if n else 0.0


def aggregate(terms, grads, kept, mode, T):
    """terms/grads/kept: dict (i, t) -> value for every valid token; returns (loss, grad dict).

    ``kept`` tokens enter the loss; the coefficient of each is that of verl's loss_agg_mode.
    """
    seqs = sorted({i for (i, _t), k in kept.items() if k})
    per_seq = {i: sum(1 for (j, _t), k in kept.items() if k and j == i) for i in seqs}
    n_tokens = sum(per_seq.values())

    def coef(i):
        if mode == "token-mean":
            return 1.0 / n_tokens
        if mode == "token-sum":
            return 1.0
        if mode == "seq-mean-token-sum":
            return 1.0 / len(seqs)
        if mode == "seq-mean-token-mean":
            return 1.0 / (len(seqs) * per_seq[i])
        if mode == "seq-mean-token-sum-norm":
            return 1.0 / (len(seqs) * T)
        raise ValueError(mode)

    loss, grad = 0.0, {}
    for key, is_kept in kept.items():
        c = coef(key[0]) if is_kept else 0.0
        loss += c * terms[key]
        grad[key] = c * grads[key]
    return loss, grad


def _as_matrix(grad, B, T):
    return [[grad.get((i, t), 0.0) for t in range(T)] for i in range(B)]


def _reinforce(x: Inputs, weight, kept, mode):
    """Terms −w·A·l with gradient −w·A, for weight(i, t) and kept(i, t)."""
    keys = [(i, t) for i in range(x.B) for t in x.valid[i]]
    terms = {k: -weight(*k) * x.adv[k[0]][k[1]] * x.lp[k[0]][k[1]] for k in keys}
    grads = {k: -weight(*k) * x.adv[k[0]][k[1]] for k in keys}
    loss, grad = aggregate(terms, grads, {k: kept(*k) for k in keys}, mode, x.T)
    return loss, _as_matrix(grad, x.B, x.T)


def reinforce_is(x: Inputs, *, level, bound, lo, hi, mode, negative_delta=None):
    def ratio(i, t):
        return {"token": lambda: math.exp(x.r(i, t)), "sequence": lambda: x.seq_ratio(i), "geometric": lambda: x.geo_ratio(i)}[level]()

    def in_bounds(i, t):
        return lo <= ratio(i, t) <= hi

    def weight(i, t):
        if bound == "truncate":
            return min(max(ratio(i, t), lo), hi)
        return ratio(i, t) if in_bounds(i, t) else 0.0

    def kept(i, t):
        if bound == "mask" and not in_bounds(i, t):
            return False
        if negative_delta is not None and x.seq_adv(i) < 0:
            mean_reverse = sum(-x.r(i, s) for s in x.valid[i]) / len(x.valid[i])
            return mean_reverse <= negative_delta
        return True

    return _reinforce(x, weight, kept, mode)


def m2po(x: Inputs, *, threshold, mode):
    remaining = [(i, t) for i in range(x.B) for t in x.valid[i]]
    q = {k: x.r(*k) ** 2 for k in remaining}
    flat_index = {k: n for n, k in enumerate(remaining)}
    while remaining and sum(q[k] for k in remaining) / len(remaining) > threshold:
        # the largest q leaves first; among equal q, the later token
        remaining.remove(max(remaining, key=lambda k: (q[k], flat_index[k])))
    kept_set = set(remaining)
    return _reinforce(x, lambda i, t: math.exp(x.r(i, t)), lambda i, t: (i, t) in kept_set, mode)


def vespo(x: Inputs, *, k_pos, lam_pos, k_neg, lam_neg, mode):
    def weight(i, _t):
        w = x.seq_ratio(i)
        k, lam = (k_pos, lam_pos) if x.seq_adv(i) >= 0 else (k_neg, lam_neg)
        return w**k * math.exp(lam * (1.0 - w))

    return _reinforce(x, weight, lambda i, t: True, mode)


def topr(x: Inputs, *, mode):
    return _reinforce(x, lambda i, _t: 1.0 if x.seq_adv(i) > 0 else min(x.seq_ratio(i), 1.0), lambda i, t: True, mode)


def p3o(x: Inputs, *, mode):
    keys = [(i, t) for i in range(x.B) for t in x.valid[i]]
    rho = {k: math.exp(x.r(*k)) for k in keys}
    ess = sum(rho.values()) ** 2 / (len(keys) * sum(v * v for v in rho.values()))
    terms, grads = {}, {}
    for (i, t) in keys:
        cap, lp, mu, a = min(rho[(i, t)], ess), x.lp[i][t], x.mu[i][t], x.adv[i][t]
        terms[(i, t)] = -cap * a * lp + (1 - ess) * ((lp - mu) + math.exp(mu - lp) - 1)
        grads[(i, t)] = -cap * a + (1 - ess) * (1 - math.exp(mu - lp))
    loss, grad = aggregate(terms, grads, {k: True for k in keys}, mode, x.T)
    return loss, _as_matrix(grad, x.B, x.T), ess


def vaco(x: Inputs, *, delta, mode):
    keys = [(i, t) for i in range(x.B) for t in x.valid[i]]
    rho = {k: math.exp(x.r(*k)) for k in keys}
    tv = sum(abs(v - 1) for v in rho.values()) / (2 * len(keys))
    terms, grads = {}, {}
    for (i, t) in keys:
        a = x.adv[i][t]
        filtered = tv > delta / 2 and a * math.copysign(1.0, rho[(i, t)] - 1) > 0 and rho[(i, t)] != 1
        terms[(i, t)] = -rho[(i, t)] * a
        grads[(i, t)] = 0.0 if filtered else -rho[(i, t)] * a
    loss, grad = aggregate(terms, grads, {k: True for k in keys}, mode, x.T)
    return loss, _as_matrix(grad, x.B, x.T), tv


def _token_ess(ratios):
    return sum(ratios) ** 2 / (len(ratios) * sum(v * v for v in ratios))


def p3o_two_anchor(x: Inputs, prox, *, mode):
    """P3O two-anchor (App. B Eq. 14-15) with the mixture formed from probabilities, not log space.

    ``prox``: proximal log-probs as a nested (B, T) list. Returns (loss, grad, e_mix, e_b, e_prox).
    """
    keys = [(i, t) for i in range(x.B) for t in x.valid[i]]
    rho_b = {k: math.exp(x.r(*k)) for k in keys}
    rho_prox = {(i, t): math.exp(x.lp[i][t] - prox[i][t]) for (i, t) in keys}
    ess_b, ess_prox = _token_ess(list(rho_b.values())), _token_ess(list(rho_prox.values()))
    ess = min(ess_b, ess_prox)
    w_b, w_prox = 1 - ess_b, 1 - ess_prox
    terms, grads = {}, {}
    for (i, t) in keys:
        lp, a = x.lp[i][t], x.adv[i][t]
        if w_b + w_prox > 0:
            mix = math.log((w_b * math.exp(x.mu[i][t]) + w_prox * math.exp(prox[i][t])) / (w_b + w_prox))
        else:
            mix = x.mu[i][t]
        cap = min(rho_b[(i, t)], ess)
        terms[(i, t)] = -cap * a * lp + (1 - ess) * ((lp - mix) + math.exp(mix - lp) - 1)
        grads[(i, t)] = -cap * a + (1 - ess) * (1 - math.exp(mix - lp))
    loss, grad = aggregate(terms, grads, {k: True for k in keys}, mode, x.T)
    return loss, _as_matrix(grad, x.B, x.T), ess, ess_b, ess_prox
