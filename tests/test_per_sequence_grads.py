"""Exactness of `PerSequenceGradients` against a slow loop that backpropagates one sequence at a time.

The reference runs every sequence alone and unpadded through the model, takes g_i with
torch.autograd.grad over all parameters (a tied weight appears once, so autograd sums its two uses),
and forms ||g_i||², the OPOB baseline and Σ_i (c^R_i − b c^S_i) g_i directly.
"""

from __future__ import annotations

import math

import pytest
import torch
from devices import DEVICE, on_device
from torch import nn

from vcpo.core.baselines import opob_baseline
from vcpo.core.per_sequence_grads.gradients import PerSequenceGradients
from vcpo.core.per_sequence_grads.reductions import (
    COMBINATIONS,
    NORMS_ONLY,
    ghost_sq_norms,
    gram,
    per_sample_outer,
    prefers_ghost,
    rows_at_ids,
    rows_per_block,
    sparse_rows_sq_norms,
)
from vcpo.local_models import random_qwen2

transformers = pytest.importorskip("transformers")

VOCAB = 101
LENGTHS = [9, 4, 1, 7, 6]  # a one-token sequence has no target: its gradient is zero
MODELS = ("qwen2_tied", "qwen2", "llama", "gpt2")
TOLERANCE = 1e-5


def tiny_model(kind: str, dtype: torch.dtype = torch.float64, seed: int = 0, **overrides) -> nn.Module:
    torch.manual_seed(seed)
    shapes = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    if kind in ("qwen2", "qwen2_tied"):
        model = random_qwen2(VOCAB, hidden_size=32, intermediate_size=48, max_positions=64, seed=seed,
                           tie_word_embeddings=kind == "qwen2_tied", **overrides)
    elif kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**shapes, **overrides}))
    elif kind == "gpt2":
        shapes = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**shapes, **overrides}))
    else:
        raise ValueError(kind)
    return model.to(DEVICE, dtype).eval()  # eval: no dropout, so the batch and the loop see the same function


def make_batch(seed: int = 0, lengths=LENGTHS, padding: str = "right", aggregation: str = "seq-mean-token-mean",
               rewards: str = "uniform"):
    """Token ids padded to the longest sequence, and per-sequence score scales a_i (u_{i,t} = a_i m_{i,t}).
    Rewards uniform in [0, 1), or "binary": 1, 0, 1, 0, ... (c^R_i = R_i c^S_i)."""
    generator = torch.Generator().manual_seed(seed)
    batch, tokens = len(lengths), max(lengths)
    ids = torch.randint(0, VOCAB, (batch, tokens), generator=generator)
    mask = torch.zeros(batch, tokens, dtype=torch.long)
    for i, length in enumerate(lengths):
        if padding == "right":
            mask[i, :length] = 1
        else:
            mask[i, tokens - length :] = 1
    targets = torch.tensor([max(length - 1, 0) for length in lengths], dtype=torch.float64)
    scale = {
        "seq-mean-token-mean": 1.0 / targets.clamp(min=1.0),
        "token-sum": torch.ones(batch, dtype=torch.float64),
        "token-mean": torch.full((batch,), 1.0 / float(targets.sum()), dtype=torch.float64),
    }[aggregation]
    reward_values = torch.rand(batch, generator=generator, dtype=torch.float64)
    if rewards == "binary":
        reward_values = (torch.arange(batch) % 2 == 0).double()
    seq_log_weights = 0.7 * torch.randn(batch, generator=generator, dtype=torch.float64)
    tis = seq_log_weights.exp().clamp(max=8.0)
    return on_device(
        dict(
            ids=ids,
            mask=mask,
            padding=padding,
            scale=scale,
            rewards=reward_values,
            seq_log_weights=seq_log_weights,
            coef_r=tis / batch * reward_values,
            coef_s=tis / batch,
        )
    )


def batched_scores(model, batch, rows=slice(None)) -> torch.Tensor:
    """l_i = a_i Σ_t log π(y_t | y_<t) over valid targets (a target and its input both valid)."""
    ids, mask = batch["ids"][rows], batch["mask"][rows]
    position_ids = None
    if batch["padding"] == "left":
        position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(ids, attention_mask=mask, position_ids=position_ids).logits[:, :-1]
    log_probs = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    valid = (mask[:, 1:] * mask[:, :-1]).to(log_probs.dtype)
    return batch["scale"][rows].to(log_probs.dtype) * (log_probs * valid).sum(1)


def reference_gradients(model, batch) -> list[list[torch.Tensor]]:
    """g_i for every sequence: the sequence alone, unpadded, one backward each."""
    params = list(model.parameters())
    gradients = []
    for i in range(batch["ids"].shape[0]):
        tokens = batch["ids"][i][batch["mask"][i].bool()].unsqueeze(0)
        logits = model(tokens).logits[0, :-1]
        score = batch["scale"][i].item() * torch.log_softmax(logits, -1).gather(-1, tokens[0, 1:, None]).sum()
        grads = torch.autograd.grad(score, params, allow_unused=True)
        gradients.append([torch.zeros_like(p) if g is None else g for g, p in zip(grads, params, strict=True)])
    return gradients


def reference_update(gradients, batch, groups=None):
    """Norms, baseline and Σ_i (c^R_i − b_i c^S_i) g_i from the per-sequence gradients."""
    norms = torch.stack([sum(g.double().pow(2).sum() for g in grads) for grads in gradients])
    baseline = opob_baseline(batch["rewards"], norms, batch["seq_log_weights"], groups)
    weights = batch["coef_r"] - baseline * batch["coef_s"]
    final = [
        sum(w.item() * grads[k] for w, grads in zip(weights, gradients, strict=True)) for k in range(len(gradients[0]))
    ]
    return norms, final


def run_engine(model, batch, micro_batches=(slice(None),), groups=None, combine_each=False, **engine_kwargs):
    """PerSequenceGradients over the given micro-batches; returns all sequences' norms and the final p.grad."""
    per_sequence = PerSequenceGradients(model, **engine_kwargs)
    model.zero_grad(set_to_none=True)
    norms = []
    for rows in micro_batches:
        group_rows = None if groups is None else groups[rows]
        with per_sequence.micro_batch(batch["coef_r"][rows], batch["coef_s"][rows], groups=group_rows):
            batched_scores(model, batch, rows).sum().backward()
        if combine_each:
            norms.append(per_sequence.sq_norms)
            per_sequence.combine(
                opob_baseline(batch["rewards"][rows], per_sequence.sq_norms, batch["seq_log_weights"][rows], per_sequence.groups)
            )
    if not combine_each:
        norms.append(per_sequence.sq_norms)
        per_sequence.combine(opob_baseline(batch["rewards"], per_sequence.sq_norms, batch["seq_log_weights"], per_sequence.groups))
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    return torch.cat(norms), grads


def relative_error(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    difference = math.sqrt(
        sum(float((a.double() - e.double()).pow(2).sum()) for a, e in zip(actual, expected, strict=True))
    )
    scale = math.sqrt(sum(float(e.double().pow(2).sum()) for e in expected))
    return difference / scale


def assert_norms_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    assert torch.allclose(actual.double(), expected.double(), rtol=TOLERANCE, atol=TOLERANCE * float(expected.max()))


# ----------------------------------------------------------------------------------------------
# Exactness against the per-sequence loop.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("combination", COMBINATIONS)
@pytest.mark.parametrize("mode", ["materialize", "ghost"])
@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("kind", MODELS)
def test_matches_per_sequence_loop_float64(kind, padding, mode, combination):
    model = tiny_model(kind)
    batch = make_batch(seed=1, padding=padding)
    expected_norms, expected_grads = reference_update(reference_gradients(model, batch), batch)
    norms, grads = run_engine(model, batch, norm_method=mode, combination=combination)
    assert float(expected_norms.min()) == 0.0 and float(expected_norms.max()) > 0.0  # one-token sequence
    assert_norms_close(norms, expected_norms)
    assert relative_error(grads, expected_grads) < TOLERANCE


@pytest.mark.parametrize("combination", COMBINATIONS)
@pytest.mark.parametrize("mode", ["materialize", "ghost"])
@pytest.mark.parametrize("kind", MODELS)
def test_matches_per_sequence_loop_float32(kind, mode, combination):
    model = tiny_model(kind, torch.float32, seed=2)
    batch = make_batch(seed=2, lengths=[12, 5, 9, 3], padding="left")
    expected_norms, expected_grads = reference_update(reference_gradients(model, batch), batch)
    norms, grads = run_engine(model, batch, norm_method=mode, combination=combination)
    assert_norms_close(norms, expected_norms)
    assert relative_error(grads, expected_grads) < TOLERANCE


@pytest.mark.parametrize("aggregation", ["token-sum", "token-mean"])
def test_other_loss_aggregations(aggregation):
    model = tiny_model("qwen2_tied")
    batch = make_batch(seed=3, aggregation=aggregation)
    expected_norms, expected_grads = reference_update(reference_gradients(model, batch), batch)
    norms, grads = run_engine(model, batch)
    assert_norms_close(norms, expected_norms)
    assert relative_error(grads, expected_grads) < TOLERANCE


@pytest.mark.parametrize("kind", ["qwen2_tied", "gpt2"])
def test_many_small_blocks(kind):
    """block_bytes=1: every weight is split into blocks of MIN_BLOCK_ROWS rows."""
    model = tiny_model(kind)
    batch = make_batch(seed=4)
    expected_norms, expected_grads = reference_update(reference_gradients(model, batch), batch)
    norms, grads = run_engine(model, batch, norm_method="materialize", block_bytes=1)
    assert_norms_close(norms, expected_norms)
    assert relative_error(grads, expected_grads) < TOLERANCE


@pytest.mark.parametrize("combination", COMBINATIONS)
def test_blocks_of_a_row_multiple(combination):
    """Blocks of a multiple of 32 rows (block_bytes=1 alone gives MIN_BLOCK_ROWS = 16): the 48-row MLP weights in a
    block of 32 rows and one of 16, as CUDA's row multiple splits them; groups spread over two micro-batches."""
    model = tiny_model("qwen2_tied")
    batch = make_batch(seed=5)
    groups = torch.tensor([0, 1, 0, 1, 1])
    expected_norms, expected_grads = reference_update(reference_gradients(model, batch), batch, groups)
    norms, grads = run_engine(model, batch, micro_batches=(slice(0, 2), slice(2, 5)), groups=groups,
                              norm_method="materialize", combination=combination, block_bytes=1, block_row_multiple=32)
    assert_norms_close(norms, expected_norms)
    assert relative_error(grads, expected_grads) < TOLERANCE


def test_rows_per_block():
    # The GPU check's tied output layer (151,936 x 896, 4 sequences, float32 blocks of 128 MiB): 9,362 rows fit,
    # 9,344 = 146 x 64 are taken, so that every block starts at a multiple of 64 rows.
    assert rows_per_block(151936, 4, 896, 4, 128 << 20, 64) == 9344
    assert rows_per_block(151936, 4, 896, 4, 128 << 20, 1) == 9362
    assert rows_per_block(4864, 4, 896, 4, 128 << 20, 64) == 4864  # the whole weight in one block
    # at least MIN_BLOCK_ROWS (16), and never fewer than one multiple
    assert rows_per_block(1000, 4, 896, 4, 1, 1) == 16
    assert rows_per_block(1000, 4, 896, 4, 1, 64) == 64
    assert rows_per_block(40, 4, 896, 4, 1, 64) == 40


def test_padding_idx_rows_get_no_gradient():
    """Qwen2 with pad_token_id: the embedding's padding row has no gradient, also for in-sequence pads."""
    model = tiny_model("qwen2_tied", pad_token_id=0)
    assert model.model.embed_tokens.padding_idx == 0
    batch = make_batch(seed=5)
    batch["ids"][:, 2] = 0
    expected_norms, expected_grads = reference_update(reference_gradients(model, batch), batch)
    norms, grads = run_engine(model, batch)
    assert_norms_close(norms, expected_norms)
    assert relative_error(grads, expected_grads) < TOLERANCE


@pytest.mark.parametrize("combination", COMBINATIONS)
@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing(reentrant, combination):
    """The checkpointed forward is recomputed inside backward; each handler still runs once."""
    batch = make_batch(seed=6)
    expected_norms, expected_grads = reference_update(reference_gradients(tiny_model("qwen2_tied"), batch), batch)
    model = tiny_model("qwen2_tied").train()
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    norms, grads = run_engine(model, batch, combination=combination)
    assert_norms_close(norms, expected_norms)
    assert relative_error(grads, expected_grads) < TOLERANCE


def test_update_equals_naive_two_backward_method():
    """AdamW after the single-backward update == AdamW after norms, then a second weighted backward.

    GPT-2 because its float64 forward stays in float64: HF's RMSNorm computes in float32, and the
    naive backward of Σ w_i l_i (w of both signs, cancelling) rounds differently from the per-sequence
    gradients, at float32 precision.
    """
    batch = make_batch(seed=7, lengths=[8, 3, 6, 5])
    naive = tiny_model("gpt2", seed=7)
    norms = torch.stack([sum(g.pow(2).sum() for g in grads) for grads in reference_gradients(naive, batch)])
    weights = batch["coef_r"] - opob_baseline(batch["rewards"], norms, batch["seq_log_weights"]) * batch["coef_s"]
    (weights * batched_scores(naive, batch)).sum().backward()
    torch.optim.AdamW(naive.parameters(), lr=1e-2, weight_decay=0.1).step()

    single = tiny_model("gpt2", seed=7)
    run_engine(single, batch)
    torch.optim.AdamW(single.parameters(), lr=1e-2, weight_decay=0.1).step()
    initial = list(tiny_model("gpt2", seed=7).parameters())
    single_update = [p.detach() - p0.detach() for p, p0 in zip(single.parameters(), initial, strict=True)]
    naive_update = [p.detach() - p0.detach() for p, p0 in zip(naive.parameters(), initial, strict=True)]
    assert relative_error(single_update, naive_update) < 1e-9


# ----------------------------------------------------------------------------------------------
# Micro-batches, baseline scopes, coefficients.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("combination", COMBINATIONS)
@pytest.mark.parametrize("mode", ["materialize", "ghost"])
def test_batch_scope_accumulates_across_micro_batches(mode, combination):
    model = tiny_model("gpt2")
    batch = make_batch(seed=8)
    expected_norms, expected_grads = reference_update(reference_gradients(model, batch), batch)
    norms, grads = run_engine(model, batch, micro_batches=(slice(0, 3), slice(3, 5)), norm_method=mode, combination=combination)
    assert_norms_close(norms, expected_norms)
    assert relative_error(grads, expected_grads) < TOLERANCE


@pytest.mark.parametrize("combination", COMBINATIONS)
@pytest.mark.parametrize("mode", ["materialize", "ghost"])
def test_group_scope_with_group_aligned_micro_batches(mode, combination):
    """Two groups per micro-batch (three score buffers), combined after each micro-batch."""
    model = tiny_model("qwen2_tied")
    batch = make_batch(seed=9, lengths=[9, 4, 7, 6, 5, 8, 3, 7])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    expected_norms, expected_grads = reference_update(reference_gradients(model, batch), batch, groups)
    norms, grads = run_engine(model, batch, (slice(0, 4), slice(4, 8)), groups=groups, combine_each=True, norm_method=mode,
                              combination=combination)
    assert_norms_close(norms, expected_norms)
    assert relative_error(grads, expected_grads) < TOLERANCE


@pytest.mark.parametrize("combination", COMBINATIONS)
def test_groups_spanning_micro_batches_keep_a_buffer_per_group(combination):
    model = tiny_model("llama")
    batch = make_batch(seed=10, lengths=[9, 4, 7, 6, 5, 8])
    groups = torch.tensor([5, 7, 5, 7, 7, 5])
    expected_norms, expected_grads = reference_update(reference_gradients(model, batch), batch, groups)
    norms, grads = run_engine(model, batch, (slice(0, 2), slice(2, 6)), groups=groups, combination=combination)
    assert_norms_close(norms, expected_norms)
    assert relative_error(grads, expected_grads) < TOLERANCE


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("mode", ["materialize", "ghost"])
def test_split_reads_each_sequence_of_binary_rewards_for_one_buffer(mode, grouped):
    """Binary rewards: every sequence is in the success or the failure buffer of its group, not both, and a
    sequence with zero coefficients in none; the update is still exact, over micro-batches that share groups."""
    model = tiny_model("qwen2_tied")
    batch = make_batch(seed=12, lengths=[9, 4, 7, 6, 5, 8], rewards="binary")
    batch["coef_r"][2] = batch["coef_s"][2] = 0.0
    groups = torch.tensor([5, 7, 7, 5, 7, 5]) if grouped else None
    expected_norms, expected_grads = reference_update(reference_gradients(model, batch), batch, groups)
    per_sequence = PerSequenceGradients(model, norm_method=mode, combination="split")
    members, norms = [], []
    for rows in (slice(0, 4), slice(4, 6)):
        with per_sequence.micro_batch(batch["coef_r"][rows], batch["coef_s"][rows], None if groups is None else groups[rows]):
            batched_scores(model, batch, rows).sum().backward()
            members.append(sorted(i + rows.start for row in per_sequence._active.members for i in row))
            assert per_sequence._active.combinations_per_sequence == 1
    assert members == [[0, 1, 3], [4, 5]]
    labels = [5, 7] if grouped else [None]
    assert set(per_sequence._score_buffers) == {(label, v) for label in labels for v in (0, 1)}
    norms = per_sequence.sq_norms
    per_sequence.combine(opob_baseline(batch["rewards"], norms, batch["seq_log_weights"], per_sequence.groups))
    assert_norms_close(norms, expected_norms)
    assert relative_error([p.grad for p in model.parameters()], expected_grads) < TOLERANCE


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("mode", ["materialize", "ghost"])
def test_split_with_rewards_of_every_kind(mode, grouped):
    """Rewards 1, 0 and in between: a sequence in between is in both buffers of its group, and the rows of the
    materialised blocks are reordered so that each buffer's sequences are consecutive."""
    model = tiny_model("llama")
    batch = make_batch(seed=13, lengths=[9, 4, 7, 6, 5, 8], rewards="binary")
    batch["rewards"] = torch.tensor([0.5, 1.0, 0.0, 1.0, 0.25, 0.0], dtype=torch.float64, device=batch["rewards"].device)
    batch["coef_r"] = batch["coef_s"] * batch["rewards"]
    groups = torch.tensor([3, 3, 3, 4, 4, 4]) if grouped else None
    expected_norms, expected_grads = reference_update(reference_gradients(model, batch), batch, groups)
    norms, grads = run_engine(model, batch, groups=groups, norm_method=mode, combination="split")
    assert_norms_close(norms, expected_norms)
    assert relative_error(grads, expected_grads) < TOLERANCE


def test_zero_coefficients_keep_exact_norms():
    model = tiny_model("qwen2")
    batch = make_batch(seed=11)
    batch["coef_r"][1] = batch["coef_s"][1] = 0.0
    batch["coef_r"][3] = 0.0
    expected_norms, expected_grads = reference_update(reference_gradients(model, batch), batch)
    norms, grads = run_engine(model, batch)
    assert bool((norms[[1, 3]] > 0).all())
    assert_norms_close(norms, expected_norms)
    assert relative_error(grads, expected_grads) < TOLERANCE


@pytest.mark.parametrize("combination", COMBINATIONS)
@pytest.mark.parametrize("mode", ["materialize", "ghost"])
def test_a_micro_batch_whose_coefficients_are_all_zero_adds_only_its_norms(mode, combination):
    """Every sequence of the second micro-batch has c^R = c^S = 0 (split keeps no row for it): the update is still
    exact and its sequences' norms are counted."""
    model = tiny_model("qwen2")
    batch = make_batch(seed=14)
    batch["coef_r"][3:] = batch["coef_s"][3:] = 0.0
    expected_norms, expected_grads = reference_update(reference_gradients(model, batch), batch)
    norms, grads = run_engine(model, batch, micro_batches=(slice(0, 3), slice(3, 5)), norm_method=mode, combination=combination)
    assert bool((norms[3:] > 0).all())
    assert_norms_close(norms, expected_norms)
    assert relative_error(grads, expected_grads) < TOLERANCE


@pytest.mark.parametrize("mode", ["materialize", "ghost"])
def test_p_grad_holds_exactly_g_r_on_top_of_what_was_there(mode):
    """autograd adds nothing itself: after a micro-batch p.grad = previous + Σ c^R_i g_i."""
    model = tiny_model("gpt2")
    batch = make_batch(seed=12)
    gradients = reference_gradients(model, batch)
    previous = [torch.randn_like(p) for p in model.parameters()]
    for p, g in zip(model.parameters(), previous, strict=True):
        p.grad = g.clone()
    per_sequence = PerSequenceGradients(model, norm_method=mode)
    with per_sequence.micro_batch(batch["coef_r"], batch["coef_s"]):
        batched_scores(model, batch).sum().backward()
    expected = [
        prev + sum(c.item() * grads[k] for c, grads in zip(batch["coef_r"], gradients, strict=True))
        for k, prev in enumerate(previous)
    ]
    assert relative_error([p.grad for p in model.parameters()], expected) < TOLERANCE


def test_deferred_ghost_norms_form_a_shared_inputs_gram_once(monkeypatch):
    """Deferred, q, k and v (and gate and up) read one input: its Gram matrices are formed once, for the first
    of them, and only the last input's are held. Buffers and split form them per weight."""
    from vcpo.core.per_sequence_grads import sites

    model, batch = tiny_model("llama"), make_batch(seed=13)
    formed = []
    monkeypatch.setattr(sites, "gram", lambda values: formed.append(values.shape) or gram(values))
    layers, linears = model.config.num_hidden_layers, sum(isinstance(m, nn.Linear) for m in model.modules())
    counts = {}
    for combination in COMBINATIONS:
        formed.clear()
        run_engine(model, batch, norm_method="ghost", combination=combination)
        counts[combination] = len(formed)
    # every Linear's output-gradient Gram, and the inputs: per layer q/k/v's, o's, gate/up's, down's; the head's
    assert counts == {"buffers": 2 * linears, "deferred": linears + 4 * layers + 1, "split": 2 * linears}


def test_deferred_combination_adds_the_update_to_what_was_there_only_at_combine():
    """Deferred: the backward leaves p.grad untouched; combine adds Σ_i (c^R_i − b c^S_i) g_i to it."""
    model = tiny_model("qwen2_tied")
    batch = make_batch(seed=12)
    norms, update = reference_update(reference_gradients(model, batch), batch)
    previous = [torch.randn_like(p) for p in model.parameters()]
    for p, g in zip(model.parameters(), previous, strict=True):
        p.grad = g.clone()
    per_sequence = PerSequenceGradients(model, combination="deferred")
    with per_sequence.micro_batch(batch["coef_r"], batch["coef_s"]):
        batched_scores(model, batch).sum().backward()
    assert all(torch.equal(p.grad, prev) for p, prev in zip(model.parameters(), previous, strict=True))
    per_sequence.combine(opob_baseline(batch["rewards"], per_sequence.sq_norms, batch["seq_log_weights"]))
    expected = [prev + part for prev, part in zip(previous, update, strict=True)]
    assert not any(p.grad.requires_grad for p in model.parameters())  # no graph through the kept activations
    assert relative_error([p.grad for p in model.parameters()], expected) < TOLERANCE
    with pytest.raises(ValueError, match="combination must be one of"):
        PerSequenceGradients(model, combination="later")


def test_combine_with_a_constant_baseline():
    model = tiny_model("qwen2")
    batch = make_batch(seed=13)
    gradients = reference_gradients(model, batch)
    per_sequence = PerSequenceGradients(model)
    with per_sequence.micro_batch(batch["coef_r"], batch["coef_s"]):
        batched_scores(model, batch).sum().backward()
    per_sequence.combine(0.25)
    weights = batch["coef_r"] - 0.25 * batch["coef_s"]
    expected = [
        sum(w.item() * grads[k] for w, grads in zip(weights, gradients, strict=True)) for k in range(len(gradients[0]))
    ]
    assert relative_error([p.grad for p in model.parameters()], expected) < TOLERANCE
    assert per_sequence._score_buffers == {}


# ----------------------------------------------------------------------------------------------
# The pure functions against dense per-sample computations.
# ----------------------------------------------------------------------------------------------


def test_pure_functions_match_dense_per_sample_gradients():
    generator = torch.Generator().manual_seed(0)
    rows, cols = (
        torch.randn(3, 5, 4, generator=generator, dtype=torch.float64),
        torch.randn(3, 5, 6, generator=generator, dtype=torch.float64),
    )
    dense = torch.stack([sum(torch.outer(rows[i, t], cols[i, t]) for t in range(5)) for i in range(3)])
    assert torch.allclose(per_sample_outer(rows, cols), dense)
    assert torch.allclose(ghost_sq_norms(rows, cols), dense.pow(2).sum((1, 2)))

    ids = torch.tensor([[1, 1, 3, 0, 1], [2, 2, 2, 2, 2], [0, 1, 2, 3, 4]])
    embedding_grads = torch.zeros(3, 7, 6, dtype=torch.float64)
    for i in range(3):
        for t in range(5):
            embedding_grads[i, ids[i, t]] += cols[i, t]
    assert torch.allclose(sparse_rows_sq_norms(ids, cols, 7), embedding_grads.pow(2).sum((1, 2)))

    delta, x = torch.randn(3, 5, 7, generator=generator, dtype=torch.float64), cols
    head_grads = per_sample_outer(delta, x)  # (3, 7, 6)
    expected_rows = torch.stack([head_grads[i, ids[i]] for i in range(3)])
    assert torch.allclose(rows_at_ids(delta, x, ids), expected_rows)


def test_cost_model_prefers_materialising_long_sequences():
    assert not prefers_ghost(lengths=[2048], rows=896, cols=896, num_combinations=2, pass_cost=512.0)
    assert prefers_ghost(lengths=[4], rows=896, cols=896, num_combinations=2, pass_cost=32.0)
    # Exactly at the boundary: ghost = T²(R+C) + (k−1)·T·R·C against pass_cost·R·C.
    tokens, rows, cols = 8, 16, 16
    ghost = tokens**2 * (rows + cols) + tokens * rows * cols
    assert not prefers_ghost([tokens], rows, cols, 2, pass_cost=ghost / (rows * cols))
    assert prefers_ghost([tokens], rows, cols, 2, pass_cost=ghost / (rows * cols) * 1.01)
    assert prefers_ghost([tokens] * 5, rows, cols, 2, pass_cost=ghost / (rows * cols) * 1.01)
    # More score buffers make the ghost route (one matmul per buffer) dearer.
    assert prefers_ghost([12], 64, 64, 2, 20.0) and not prefers_ghost([12], 64, 64, 3, 20.0)
    # Sequences of unequal lengths (packed) are costed together: one long sequence decides for the rest.
    assert prefers_ghost([4, 4], 896, 896, 2, 32.0) and not prefers_ghost([4, 2048], 896, 896, 2, 32.0)
    # Deferred, only the norms are costed: ghost T²(R+C) against materialised (T + pass_cost)·R·C, whatever k.
    # The simulator's MLP at T = 50: 2500·640 against 114·65536 multiply-adds, ghost; at T = 2048 materialised.
    assert prefers_ghost([50], 128, 512, 9, 64.0, deferred=True) and not prefers_ghost([50], 128, 512, 9, 64.0)
    assert not prefers_ghost([2048], 896, 896, 2, 64.0, deferred=True)
    boundary = tokens**2 * (4 + 4) / (4 * 4) - tokens  # 24: ghost 512 = (8 + 24)·16 materialised
    assert not prefers_ghost([tokens], 4, 4, 5, boundary, deferred=True)
    assert prefers_ghost([tokens], 4, 4, 5, boundary * 1.01, deferred=True)


# ----------------------------------------------------------------------------------------------
# Errors instead of silently wrong norms.
# ----------------------------------------------------------------------------------------------


class _WithConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.conv = nn.Conv1d(4, 4, 1)

    def forward(self, ids):
        return self.conv(self.embed(ids).transpose(1, 2)).sum((1, 2))


def test_unsupported_trainable_module_is_rejected_by_name():
    model = _WithConv()
    with pytest.raises(ValueError, match=r"'conv' \(Conv1d\) has trainable parameter 'weight'"):
        PerSequenceGradients(model)
    model.conv.requires_grad_(False)
    PerSequenceGradients(model)  # frozen: left alone


class _FunctionalUse(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)

    def forward(self, ids):
        hidden = self.proj(self.embed(ids))
        return (hidden @ self.proj.weight).sum((1, 2))  # a second use that no handler sees


class _CalledTwice(_FunctionalUse):
    def forward(self, ids):
        return self.proj(self.proj(self.embed(ids))).sum((1, 2))


@pytest.mark.parametrize("model_class", [_FunctionalUse, _CalledTwice])
def test_uses_outside_the_handlers_raise(model_class):
    model = model_class()
    per_sequence = PerSequenceGradients(model)
    ids = torch.randint(0, 10, (2, 3))
    with pytest.raises(RuntimeError, match="per-sequence norm would"):
        with per_sequence.micro_batch(torch.ones(2), torch.ones(2)):
            model(ids).sum().backward()
    with pytest.raises(ValueError, match="no micro-batch"):
        _ = per_sequence.sq_norms  # the failed micro-batch was dropped


def test_weight_shared_between_two_linears_is_rejected():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    model[2].weight = model[1].weight
    with pytest.raises(ValueError, match="parameter shared by"):
        PerSequenceGradients(model)


def test_backward_outside_the_block_raises():
    model = tiny_model("qwen2")
    batch = make_batch(seed=14)
    per_sequence = PerSequenceGradients(model)
    with pytest.raises(RuntimeError, match="backward did not run inside"):
        with per_sequence.micro_batch(batch["coef_r"], batch["coef_s"]):
            scores = batched_scores(model, batch)
    with pytest.raises(RuntimeError, match="outside `micro_batch`"):
        scores.sum().backward()


def test_forward_with_another_batch_size_raises():
    model = tiny_model("llama")
    batch = make_batch(seed=15)
    per_sequence = PerSequenceGradients(model)
    with pytest.raises(ValueError, match="ids must have shape"):
        with per_sequence.micro_batch(batch["coef_r"][:3], batch["coef_s"][:3]):
            batched_scores(model, batch)


def test_argument_validation():
    model = tiny_model("qwen2")
    with pytest.raises(ValueError, match="norm_method"):
        PerSequenceGradients(model, norm_method="fast")
    with pytest.raises(ValueError, match="block_bytes"):
        PerSequenceGradients(model, block_bytes=0)
    per_sequence = PerSequenceGradients(model)
    with pytest.raises(ValueError, match="coef_s"):
        with per_sequence.micro_batch(torch.ones(3), torch.ones(4)):
            pass
    with pytest.raises(ValueError, match="coef_r must be finite"):
        with per_sequence.micro_batch(torch.tensor([1.0, math.nan]), torch.ones(2)):
            pass
    with pytest.raises(ValueError, match="integer labels"):
        with per_sequence.micro_batch(torch.ones(2), torch.ones(2), groups=torch.ones(2)):
            pass
    with pytest.raises(ValueError, match="combine"):
        per_sequence.combine(0.0)


def test_baseline_must_be_constant_within_a_group():
    model = tiny_model("qwen2")
    batch = make_batch(seed=16)
    per_sequence = PerSequenceGradients(model)
    with per_sequence.micro_batch(batch["coef_r"], batch["coef_s"]):
        batched_scores(model, batch).sum().backward()
    with pytest.raises(ValueError, match="constant within a group"):
        per_sequence.combine(torch.arange(5, dtype=torch.float64))
    with pytest.raises(ValueError, match="baseline must be finite"):
        per_sequence.combine(math.inf)


# ----------------------------------------------------------------------------------------------
# Slow: a larger model, and the benchmark end to end.
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["auto", "materialize", "ghost"])
@pytest.mark.parametrize("kind", ["qwen2_tied", "gpt2"])
def test_larger_float32_model_with_groups_and_micro_batches(kind, mode):
    overrides = dict(num_layers=3) if kind != "gpt2" else dict(n_layer=3)
    model = tiny_model(kind, torch.float32, seed=17, **overrides)
    lengths = [40, 23, 31, 12, 38, 27, 35, 19]
    batch = make_batch(seed=17, lengths=lengths, padding="left")
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    expected_norms, expected_grads = reference_update(reference_gradients(model, batch), batch, groups)
    norms, grads = run_engine(
        model, batch, (slice(0, 4), slice(4, 8)), groups=groups, combine_each=True, norm_method=mode, block_bytes=4096
    )
    assert_norms_close(norms, expected_norms)
    assert relative_error(grads, expected_grads) < TOLERANCE


@pytest.mark.slow
def test_benchmark_runs_and_variants_agree(capsys):
    import pathlib
    import runpy

    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "opob_overhead.py"
    benchmark = runpy.run_path(str(script))
    args = [
        "--model",
        "0.1m",
        "--seq-len",
        "32",
        "--batch-size",
        "4",
        "--micro-batch-size",
        "2",
        "--group-size",
        "2",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--device",
        "cpu",
    ]
    timing = benchmark["time_variants"](benchmark["parse_args"](args))
    assert set(timing["step_s"]) == {"plain", "opob", "naive", "two_pass", "per_sequence"}
    assert timing["agreement"]["naive"] < 1e-5 and timing["agreement"]["per_sequence"] < 1e-4
    assert timing["agreement"]["two_pass"] < 1e-5
    peak = benchmark["measure_peak_memory"](benchmark["parse_args"](args), "opob")
    assert peak > 0


@pytest.mark.parametrize("combination", COMBINATIONS)
def test_coefficients_set_after_the_forward_give_the_same_update(combination):
    """set_coefficients between forward and backward = passing the coefficients up front."""
    model, batch = tiny_model("qwen2"), make_batch()
    expected_norms, expected = run_engine(model, batch, combination=combination)
    per_sequence = PerSequenceGradients(model, combination=combination)
    model.zero_grad(set_to_none=True)
    zeros = torch.zeros_like(batch["coef_r"])
    with per_sequence.micro_batch(zeros, zeros):
        scores = batched_scores(model, batch)
        per_sequence.set_coefficients(batch["coef_r"], batch["coef_s"])
        scores.sum().backward()
        with pytest.raises(RuntimeError, match="before the micro-batch's backward"):
            per_sequence.set_coefficients(batch["coef_r"], batch["coef_s"])
    norms = per_sequence.sq_norms
    per_sequence.combine(opob_baseline(batch["rewards"], norms, batch["seq_log_weights"]))
    assert torch.allclose(norms, expected_norms, rtol=1e-12)
    for actual, reference in zip([p.grad for p in model.parameters()], expected, strict=True):
        assert torch.allclose(actual, reference, rtol=1e-12, atol=1e-15)
    with pytest.raises(RuntimeError, match="outside `micro_batch`"):
        per_sequence.set_coefficients(batch["coef_r"], batch["coef_s"])


def test_modules_wrapped_by_fsdp2_keep_their_handler():
    """fully_shard turns a module's class into FSDP<Class>(FSDPModule, Class) with the class's own forward (verl wraps
    an untied model's embedding so): the handler is the class's. Another subclass may change the forward: none."""
    from torch.distributed.fsdp import FSDPModule

    from vcpo.core.per_sequence_grads.functions import module_kind

    for module, kind in ((nn.Embedding(4, 3), "embedding"), (nn.Linear(3, 2), "linear"), (nn.LayerNorm(3), "layer_norm")):
        module.__class__ = type(f"FSDP{type(module).__name__}", (FSDPModule, type(module)), {})  # as fully_shard does
        assert module_kind(module) == kind

    class ScaledLinear(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    assert module_kind(ScaledLinear(3, 2)) is None


# ----------------------------------------------------------------------------------------------
# Norms only: the first pass of a two-pass OPOB step.
# ----------------------------------------------------------------------------------------------


def run_two_pass(model, batch, micro_batches=(slice(None),), groups=None, **engine_kwargs):
    """Pass 1: the norms alone, micro-batch by micro-batch; pass 2: a plain backward of Σ_i (c^R_i − b_γ(i) c^S_i) l_i.
    Returns the norms, every p.grad after pass 1 (None expected) and the final p.grad."""
    per_sequence = PerSequenceGradients(model, combination=NORMS_ONLY, **engine_kwargs)
    model.zero_grad(set_to_none=True)
    for rows in micro_batches:
        with per_sequence.micro_batch(batch["coef_r"][rows], batch["coef_s"][rows], groups=None if groups is None else groups[rows]):
            batched_scores(model, batch, rows).sum().backward()
    norms, labels = per_sequence.sq_norms, per_sequence.groups
    per_sequence.discard()
    after_norms = [p.grad for p in model.parameters()]
    weights = batch["coef_r"] - opob_baseline(batch["rewards"], norms, batch["seq_log_weights"], labels) * batch["coef_s"]
    for rows in micro_batches:
        (weights[rows] * batched_scores(model, batch, rows)).sum().backward()
    return norms, after_norms, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["materialize", "ghost"])
@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("kind", MODELS)
def test_two_pass_matches_per_sequence_loop_float64(kind, padding, mode):
    """Groups spread over micro-batches: the norms pass leaves no gradient, and the second pass is the update (to
    1e-12 where the float64 forward stays float64; HF's RMSNorm normalises in float32, so a plain backward of
    Σ w_i l_i with cancelling w rounds at float32 precision there)."""
    model = tiny_model(kind)
    batch = make_batch(seed=1, lengths=[9, 4, 1, 7, 6, 8], padding=padding)
    groups = torch.tensor([5, 7, 5, 7, 7, 5])
    expected_norms, expected_grads = reference_update(reference_gradients(model, batch), batch, groups)
    norms, after_norms, grads = run_two_pass(model, batch, (slice(0, 2), slice(2, 6)), groups=groups, norm_method=mode)
    assert all(grad is None for grad in after_norms)
    assert_norms_close(norms, expected_norms)
    assert relative_error(grads, expected_grads) < (1e-12 if kind == "gpt2" else TOLERANCE)


def test_norms_only_refuses_combine_and_keeps_nothing():
    model = tiny_model("qwen2_tied")
    batch = make_batch(seed=3)
    per_sequence = PerSequenceGradients(model, combination=NORMS_ONLY)
    with per_sequence.micro_batch(batch["coef_r"], batch["coef_s"]):
        assert per_sequence._active.coefficients.shape == (0, len(LENGTHS))
        batched_scores(model, batch).sum().backward()
    assert per_sequence._score_buffers == {} and per_sequence._reward_buffers == {} and per_sequence._open_micro_batches == []
    with pytest.raises(ValueError, match="forms no gradient"):
        per_sequence.combine(0.0)
