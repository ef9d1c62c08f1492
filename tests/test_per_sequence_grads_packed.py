"""`PerSequenceGradients` on packed ("remove padding") micro-batches: B sequences in ONE row, cu_seqlens offsets.

The reference runs every sequence alone through the model and takes g_i = ∇ l_i with an ordinary
autograd backward, then forms ||g_i||², G_R = Σ c^R_i g_i and Σ_i (c^R_i − b c^S_i) g_i directly. The
packed row uses position_ids restarting at 0 per sequence with attention_mask=None and use_cache=False:
transformers 5 then builds a block-diagonal causal mask (`masking_utils.find_packed_sequence_indices`),
which `test_packed_logits_equal_per_sequence_logits` checks first. With the model's default
use_cache=True in eval mode the packed detection is skipped and attention crosses sequences.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from devices import on_device
from torch import nn

import vcpo.core.per_sequence_grads.sites as per_sequence_sites
from vcpo.core.baselines import opob_baseline
from vcpo.core.per_sequence_grads.gradients import PerSequenceGradients
from vcpo.core.per_sequence_grads.reductions import NORMS_ONLY, PackedSegments, check_cu_seqlens

from test_per_sequence_grads import VOCAB
from test_per_sequence_grads import tiny_model as padded_tiny_model

transformers = pytest.importorskip("transformers")

LENGTHS = [9, 4, 1, 7, 6]  # the one-token sequence has no target: its gradient is zero
PROMPTS = [3, 2, 1, 2, 4]  # u_{i,t} = 0 on the prompt, 1 / #response tokens on the response
MODELS = ("qwen2_tied", "qwen2", "gpt2")
# Relative tolerance in float64. Measured errors are ~3e-16 for every model and mode (HF's RMSNorm
# normalises in float32, but per token and identically in the packed, padded and reference runs).
TOLERANCE = 1e-9


def tiny_model(kind: str, attn: str = "sdpa", seed: int = 0) -> nn.Module:
    """The padded tests' float64 model, with the attention implementation under test."""
    model = padded_tiny_model(kind, torch.float64, seed)
    model.config._attn_implementation = attn
    return model


def make_batch(seed: int = 0, lengths=LENGTHS, prompts=PROMPTS, trailing: int = 0, rewards: str = "uniform") -> dict:
    """Sequences, their packed row (plus ``trailing`` padding tokens) and OPOB coefficients; rewards uniform
    in [0, 1), or "binary": 1, 0, 1, 0, ... (c^R_i = R_i c^S_i)."""
    generator = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, VOCAB, (length,), generator=generator) for length in lengths]
    # u over target positions t = 1 .. L-1 of each sequence: the response tokens, mean-aggregated.
    weights = []
    for length, prompt in zip(lengths, prompts, strict=True):
        response = (torch.arange(1, length) >= prompt).double()
        weights.append(response / response.sum().clamp(min=1.0))
    batch = len(lengths)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    pad_ids = torch.randint(0, VOCAB, (trailing,), generator=generator)
    reward_values = torch.rand(batch, generator=generator, dtype=torch.float64)
    if rewards == "binary":
        reward_values = (torch.arange(batch) % 2 == 0).double()
    seq_log_weights = 0.7 * torch.randn(batch, generator=generator, dtype=torch.float64)
    tis = seq_log_weights.exp().clamp(max=8.0)
    return on_device(dict(
        sequences=sequences,
        weights=weights,
        cu_seqlens=cu_seqlens,
        ids=torch.cat([*sequences, pad_ids]).unsqueeze(0),
        position_ids=torch.cat([torch.arange(length) for length in [*lengths, trailing]]).unsqueeze(0),
        rewards=reward_values,
        seq_log_weights=seq_log_weights,
        coef_r=tis / batch * reward_values,
        coef_s=tis / batch,
    ))


def token_scores(logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_t u_t log π(ids_t | ids_<t) of one sequence: logits (L, V), ids (L,), weights (L - 1,)."""
    log_probs = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None]).squeeze(-1)
    return (weights * log_probs).sum()


def packed_scores(model, batch) -> torch.Tensor:
    """l_i for every packed sequence from ONE forward of the packed row; trailing padding is not scored."""
    logits = model(batch["ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
    offsets = batch["cu_seqlens"].tolist()
    return torch.stack(
        [
            token_scores(logits[start:end], batch["ids"][0, start:end], weights)
            for start, end, weights in zip(offsets[:-1], offsets[1:], batch["weights"], strict=True)
        ]
    )


def padded_scores(model, batch) -> torch.Tensor:
    """The same l_i from one right-padded row per sequence."""
    lengths = [len(s) for s in batch["sequences"]]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long, device=batch["ids"].device)
    mask = torch.zeros_like(ids)
    for i, sequence in enumerate(batch["sequences"]):
        ids[i, : len(sequence)], mask[i, : len(sequence)] = sequence, 1
    logits = model(ids, attention_mask=mask, use_cache=False).logits
    return torch.stack(
        [
            token_scores(logits[i, :length], ids[i, :length], weights)
            for i, (length, weights) in enumerate(zip(lengths, batch["weights"], strict=True))
        ]
    )


def reference_gradients(model, batch) -> list[list[torch.Tensor]]:
    """g_i: each sequence alone, one ordinary backward each (a tied weight appears once, summed by autograd)."""
    params = list(model.parameters())
    gradients = []
    for sequence, weights in zip(batch["sequences"], batch["weights"], strict=True):
        score = token_scores(model(sequence[None], use_cache=False).logits[0], sequence, weights)
        grads = torch.autograd.grad(score, params, allow_unused=True)
        gradients.append([torch.zeros_like(p) if g is None else g for g, p in zip(grads, params, strict=True)])
    return gradients


def weighted_sum(weights: torch.Tensor, gradients) -> list[torch.Tensor]:
    return [
        sum(float(w) * grads[k] for w, grads in zip(weights, gradients, strict=True)) for k in range(len(gradients[0]))
    ]


def run_engine(model, batch, scores, groups=None, packed=True, **engine_kwargs):
    """One micro-batch; returns the norms, p.grad before combine (G_R), the baseline and the final p.grad."""
    per_sequence = PerSequenceGradients(model, **engine_kwargs)
    model.zero_grad(set_to_none=True)
    cu_seqlens = batch["cu_seqlens"] if packed else None
    with per_sequence.micro_batch(batch["coef_r"], batch["coef_s"], groups=groups, cu_seqlens=cu_seqlens):
        scores(model, batch).sum().backward()
    norms = per_sequence.sq_norms
    g_r = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    baseline = opob_baseline(batch["rewards"], norms, batch["seq_log_weights"], per_sequence.groups)
    per_sequence.combine(baseline)
    final = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    return norms, g_r, baseline, final


def relative_error(actual, expected) -> float:
    difference = math.sqrt(sum(float((a - e).pow(2).sum()) for a, e in zip(actual, expected, strict=True)))
    return difference / math.sqrt(sum(float(e.pow(2).sum()) for e in expected))


def assert_norms_close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float) -> None:
    assert actual.shape == expected.shape
    assert float((actual - expected).abs().max()) <= tolerance * float(expected.max())


# ----------------------------------------------------------------------------------------------
# The packed forward itself.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", MODELS)
def test_packed_logits_equal_per_sequence_logits(kind, attn):
    """Packed position_ids give block-diagonal causal attention (attention_mask=None, use_cache=False)."""
    model = tiny_model(kind, attn)
    batch = make_batch(seed=1, trailing=3)
    with torch.no_grad():
        packed = model(batch["ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
        alone = torch.cat([model(s[None], use_cache=False).logits[0] for s in batch["sequences"]])
    assert packed.shape[0] == alone.shape[0] + 3
    # Attention leaking across sequences changes logits by ~0.1; eager's float32 softmax rounds at ~1e-8.
    assert torch.allclose(packed[: alone.shape[0]], alone, rtol=0, atol=1e-12 if attn == "sdpa" else 1e-6)


def test_packed_segments_pad_layout():
    segments = PackedSegments.from_cu_seqlens(torch.tensor([0, 2, 5, 6]))
    assert segments.batch_size == 3 and segments.max_len == 3 and segments.total_tokens == 6
    packed = torch.arange(1, 9).double().unsqueeze(-1)  # 8 tokens: the last two are trailing padding
    expected = torch.tensor([[1, 2, 0], [3, 4, 5], [6, 0, 0]]).double().unsqueeze(-1)
    assert torch.equal(segments.pad(packed), expected)


# ----------------------------------------------------------------------------------------------
# Exactness against one backward per sequence.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "combination"), [("materialize", "buffers"), ("ghost", "buffers"), ("materialize", "deferred")])
@pytest.mark.parametrize("kind", MODELS)
def test_packed_matches_per_sequence_backward(kind, mode, combination):
    model = tiny_model(kind)
    batch = make_batch(seed=2)
    gradients = reference_gradients(model, batch)
    expected_norms = torch.stack([sum(g.pow(2).sum() for g in grads) for grads in gradients])
    assert float(expected_norms[2]) == 0.0 and float(expected_norms.min()) == 0.0 and float(expected_norms.max()) > 0

    norms, g_r, baseline, final = run_engine(model, batch, packed_scores, norm_method=mode, combination=combination)
    assert_norms_close(norms, expected_norms, TOLERANCE)
    if combination == "buffers":  # deferred, nothing reaches p.grad before combine
        assert relative_error(g_r, weighted_sum(batch["coef_r"], gradients)) < TOLERANCE
    expected_final = weighted_sum(batch["coef_r"] - baseline * batch["coef_s"], gradients)
    assert relative_error(final, expected_final) < TOLERANCE


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("mode", ["materialize", "ghost"])
def test_packed_split_with_binary_rewards(mode, grouped):
    """Split's buffers read only their sequences' views of the packed row: 0, 2, 4 (not consecutive: gathered)
    and 1, 3 without groups; one or two consecutive sequences per buffer with groups."""
    model = tiny_model("qwen2_tied")
    batch = make_batch(seed=6, trailing=2, rewards="binary")
    groups = torch.tensor([0, 0, 0, 1, 1]) if grouped else None
    gradients = reference_gradients(model, batch)
    expected_norms = torch.stack([sum(g.pow(2).sum() for g in grads) for grads in gradients])
    norms, _, baseline, final = run_engine(model, batch, packed_scores, groups=groups, norm_method=mode, combination="split")
    assert_norms_close(norms, expected_norms, TOLERANCE)
    expected_final = weighted_sum(batch["coef_r"] - baseline * batch["coef_s"], gradients)
    assert relative_error(final, expected_final) < TOLERANCE


@pytest.mark.parametrize("combination", ["buffers", "deferred"])
@pytest.mark.parametrize("mode", ["materialize", "ghost"])
def test_packed_with_groups(mode, combination):
    """Two baseline groups (three gradient buffers) in one packed micro-batch."""
    model = tiny_model("qwen2_tied")
    lengths, prompts = [9, 4, 7, 6, 5, 8], [3, 2, 2, 4, 1, 3]
    batch = make_batch(seed=3, lengths=lengths, prompts=prompts)
    groups = torch.tensor([4, 9, 4, 9, 9, 4])
    gradients = reference_gradients(model, batch)
    expected_norms = torch.stack([sum(g.pow(2).sum() for g in grads) for grads in gradients])

    norms, _, baseline, final = run_engine(model, batch, packed_scores, groups=groups, norm_method=mode, combination=combination)
    assert_norms_close(norms, expected_norms, TOLERANCE)
    expected_baseline = opob_baseline(batch["rewards"], expected_norms, batch["seq_log_weights"], groups)
    assert torch.allclose(baseline, expected_baseline, rtol=TOLERANCE)
    assert len(set(baseline.tolist())) == 2  # one baseline per group
    expected_final = weighted_sum(batch["coef_r"] - baseline * batch["coef_s"], gradients)
    assert relative_error(final, expected_final) < TOLERANCE


def test_linear_inputs_are_views_of_the_packed_row():
    """A Linear's per-sequence products read each sequence where it lies in the packed row: no copies."""
    packed = torch.randn(1, 23, 5)
    spans = [(0, 6), (6, 15), (15, 18), (18, 21)]  # two trailing padding tokens
    segments = PackedSegments.from_cu_seqlens(torch.tensor([0, 6, 15, 18, 21]))
    micro_batch = per_sequence_sites._MicroBatch(
        owner=types.SimpleNamespace(combination="buffers"), coefficients=torch.ones(2, 4), keys=[None, (None, 0)],
        sq_norms=torch.zeros(4), segments=segments,
    )
    rows = micro_batch.rows(packed)
    assert rows.lengths == [6, 9, 3, 3]
    for sequence, (start, end) in zip(rows.sequences(), spans, strict=True):
        assert sequence.data_ptr() == packed[0, start].data_ptr() and torch.equal(sequence, packed[0, start:end])
    assert torch.equal(rows.tokens(), packed[0, :21])  # the trailing padding is never read
    assert torch.allclose(rows.sums(), torch.stack([packed[0, a:b].sum(0) for a, b in spans]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("reentrant", [True, False])
def test_packed_with_gradient_checkpointing(reentrant):
    """The checkpointed forward is recomputed inside backward; every handler still sees the packed row once."""
    batch = make_batch(seed=9)
    gradients = reference_gradients(tiny_model("qwen2_tied"), batch)
    expected_norms = torch.stack([sum(g.pow(2).sum() for g in grads) for grads in gradients])
    model = tiny_model("qwen2_tied").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    norms, _, baseline, final = run_engine(model, batch, packed_scores)
    assert_norms_close(norms, expected_norms, TOLERANCE)
    assert relative_error(final, weighted_sum(batch["coef_r"] - baseline * batch["coef_s"], gradients)) < TOLERANCE


@pytest.mark.parametrize("mode", ["materialize", "ghost"])
def test_trailing_padding_tokens_are_left_out(mode):
    """Tokens after cu_seqlens[-1] belong to no sequence: same norms and update as without them."""
    model = tiny_model("gpt2")
    batch = make_batch(seed=4, trailing=5)
    gradients = reference_gradients(model, batch)
    expected_norms = torch.stack([sum(g.pow(2).sum() for g in grads) for grads in gradients])
    norms, _, baseline, final = run_engine(model, batch, packed_scores, norm_method=mode)
    assert_norms_close(norms, expected_norms, TOLERANCE)
    assert relative_error(final, weighted_sum(batch["coef_r"] - baseline * batch["coef_s"], gradients)) < TOLERANCE


@pytest.mark.parametrize("kind", MODELS)
def test_packed_equals_padded(kind):
    """The same sequences packed in one row, or one right-padded row each: same norms and update."""
    model = tiny_model(kind)
    batch = make_batch(seed=5)
    for mode in ("materialize", "ghost"):
        packed_norms, _, _, packed_final = run_engine(model, batch, packed_scores, norm_method=mode)
        padded_norms, _, _, padded_final = run_engine(model, batch, padded_scores, packed=False, norm_method=mode)
        assert_norms_close(packed_norms, padded_norms, TOLERANCE)
        assert relative_error(packed_final, padded_final) < TOLERANCE


# ----------------------------------------------------------------------------------------------
# Errors.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cu_seqlens", "message"),
    [
        (torch.tensor([0, 4, 4, 9]), "strictly increasing"),
        (torch.tensor([0, 5, 3, 9]), "strictly increasing"),
        (torch.tensor([0, 4, 9]), r"B \+ 1 = 4 offsets for the 3 sequences"),
        (torch.tensor([0, 2, 4, 6, 9]), r"B \+ 1 = 4 offsets"),
        (torch.tensor([1, 4, 6, 9]), "start at 0"),
        (torch.tensor([[0, 4, 6, 9]]), "1-D"),
        (torch.tensor([0.0, 4.0, 6.0, 9.0]), "integer offsets"),
    ],
)
def test_bad_cu_seqlens_raise(cu_seqlens, message):
    with pytest.raises(ValueError, match=message):
        check_cu_seqlens(cu_seqlens, 3)
    model = tiny_model("qwen2")
    per_sequence = PerSequenceGradients(model)
    with pytest.raises(ValueError, match=message):
        with per_sequence.micro_batch(torch.ones(3), torch.ones(3), cu_seqlens=cu_seqlens):
            pass
    with per_sequence.micro_batch(torch.ones(1), torch.ones(1), groups=torch.tensor([0])):  # nothing was left open
        model(torch.randint(0, VOCAB, (1, 4)), use_cache=False).logits.sum().backward()


def test_last_offset_beyond_the_token_dimension_raises():
    model = tiny_model("qwen2_tied")
    batch = make_batch(seed=6)
    per_sequence = PerSequenceGradients(model)
    total = int(batch["cu_seqlens"][-1])
    too_long = batch["cu_seqlens"].clone()
    too_long[-1] = total + 1
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] = 28 is beyond the token dimension 27"):
        with per_sequence.micro_batch(batch["coef_r"], batch["coef_s"], cu_seqlens=too_long):
            packed_scores(model, batch)


def test_packed_input_with_several_rows_raises():
    model = tiny_model("qwen2")
    per_sequence = PerSequenceGradients(model)
    with pytest.raises(ValueError, match=r"needs ids of shape \(1, tokens\), got \(2, 5\)"):
        with per_sequence.micro_batch(torch.ones(2), torch.ones(2), cu_seqlens=torch.tensor([0, 3, 5])):
            model(torch.randint(0, VOCAB, (2, 5)), use_cache=False)


@pytest.mark.parametrize("mode", ["materialize", "ghost"])
@pytest.mark.parametrize("kind", MODELS)
def test_packed_two_pass_equals_the_single_backward_update(kind, mode):
    """Norms alone from the packed row (groups, trailing padding), then a plain backward of Σ_i (c^R_i − b_i c^S_i) l_i:
    the same norms and update as the per-sequence loop, and as PerSequenceGradients' single backward ("split"), to 1e-9
    where the float64 forward stays float64 (HF's RMSNorm normalises in float32: a plain backward of Σ w_i l_i with
    cancelling w rounds at float32 precision there)."""
    model = tiny_model(kind)
    batch = make_batch(seed=4, trailing=3)
    groups = torch.tensor([4, 9, 4, 9, 9])
    gradients = reference_gradients(model, batch)
    expected_norms = torch.stack([sum(g.pow(2).sum() for g in grads) for grads in gradients])

    per_sequence = PerSequenceGradients(model, norm_method=mode, combination=NORMS_ONLY)
    model.zero_grad(set_to_none=True)
    with per_sequence.micro_batch(batch["coef_r"], batch["coef_s"], groups=groups, cu_seqlens=batch["cu_seqlens"]):
        packed_scores(model, batch).sum().backward()
    norms = per_sequence.sq_norms
    per_sequence.discard()
    assert all(p.grad is None for p in model.parameters())
    baseline = opob_baseline(batch["rewards"], norms, batch["seq_log_weights"], groups)
    ((batch["coef_r"] - baseline * batch["coef_s"]) * packed_scores(model, batch)).sum().backward()
    two_pass = [p.grad.clone() for p in model.parameters()]

    assert_norms_close(norms, expected_norms, TOLERANCE)
    tolerance = TOLERANCE if kind == "gpt2" else 1e-5
    assert relative_error(two_pass, weighted_sum(batch["coef_r"] - baseline * batch["coef_s"], gradients)) < tolerance
    _, _, _, single = run_engine(model, batch, packed_scores, groups=groups, norm_method=mode, combination="split")
    assert relative_error(two_pass, single) < tolerance
