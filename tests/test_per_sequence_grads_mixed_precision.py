"""`PerSequenceGradients` in mixed precision: under ``torch.autocast`` (bf16, fp16) with fp32 parameters,
and with bf16 parameters (FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)``), padded and packed.

The truth is the float64 per-sequence loop on the same weights. Plain autograd is not exact in low
precision either, so each case first measures autograd's own error: the same per-sequence loop run
under the same precision, against the truth. PerSequenceGradients must then be within a few times that error
(`ERROR_RATIO`), for the norms ||g_i||² and for the OPOB update Σ_i (c^R_i − b c^S_i) g_i, never
against a loosened absolute tolerance. Measured (CPU, these tiny models, all 48 cases): autograd's own
relative error is 0.9e-3 to 4.8e-3 under bf16 autocast, 2.2e-4 to 5.7e-4 under fp16 autocast and
4.5e-3 to 8.4e-3 with bf16 parameters (norms and update alike); PerSequenceGradients' is 0.7-1.4x autograd's,
except the ghost route's update at up to 2.1x (its combinations are one low-precision matmul over the
coefficient-scaled rows of all sequences).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from devices import DEVICE
from test_per_sequence_grads_packed import make_batch, packed_scores, padded_scores, reference_gradients
from test_per_sequence_grads_packed import tiny_model as float64_model

from vcpo.core.baselines import opob_baseline
from vcpo.core.per_sequence_grads.gradients import PerSequenceGradients

from test_per_sequence_grads import reference_update, relative_error

pytest.importorskip("transformers")

MODELS = ("qwen2_tied", "qwen2", "llama", "gpt2")
# precision -> (parameter dtype, autocast dtype or None)
PRECISIONS = {
    "autocast_bf16": (torch.float32, torch.bfloat16),
    "autocast_fp16": (torch.float32, torch.float16),
    "bf16_params": (torch.bfloat16, None),
}
ERROR_RATIO = 4.0  # PerSequenceGradients' error may be this many times autograd's own


def precision_context(precision: str):
    autocast = PRECISIONS[precision][1]
    return torch.autocast(DEVICE.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()


def engine_update(model, batch, layout: str, precision: str, mode: str, combination: str):
    per_sequence = PerSequenceGradients(model, norm_method=mode, combination=combination)
    model.zero_grad(set_to_none=True)
    packed = batch["cu_seqlens"] if layout == "packed" else None
    with per_sequence.micro_batch(batch["coef_r"], batch["coef_s"], cu_seqlens=packed):
        with precision_context(precision):
            scores = packed_scores(model, batch) if layout == "packed" else padded_scores(model, batch)
        scores.float().sum().backward()
    norms = per_sequence.sq_norms
    per_sequence.combine(opob_baseline(batch["rewards"], norms, batch["seq_log_weights"]))
    return norms, [p.grad.clone() for p in model.parameters()]


def norm_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected).abs().max() / expected.max())


# deferred: the norms of either route, then one weight-gradient product per parameter; split: binary rewards,
# so that each buffer reads a subset of the sequences
@pytest.mark.parametrize(("mode", "combination"),
                         [("materialize", "buffers"), ("ghost", "buffers"), ("materialize", "deferred"), ("ghost", "deferred"),
                          ("materialize", "split"), ("ghost", "split")])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("kind", MODELS)
def test_within_a_few_times_autograds_own_error(kind, precision, layout, mode, combination):
    param_dtype = PRECISIONS[precision][0]
    model = float64_model(kind).to(param_dtype)
    truth = copy.deepcopy(model).double()  # the same (rounded) weights, in float64
    batch = make_batch(seed=4, rewards="binary" if combination == "split" else "uniform")
    true_norms, true_update = reference_update(reference_gradients(truth, batch), batch)

    with precision_context(precision):
        autograd_gradients = reference_gradients(model, batch)
    autograd_norms, autograd_update = reference_update(autograd_gradients, batch)
    autograd_norm_error = norm_error(autograd_norms, true_norms)
    autograd_update_error = relative_error(autograd_update, true_update)
    assert autograd_norm_error > 1e-7 and autograd_update_error > 1e-7  # low precision really ran

    norms, update = engine_update(model, batch, layout, precision, mode, combination)
    assert [g.dtype for g in update] == [p.dtype for p in model.parameters()]  # gradients keep the params' dtype
    assert norm_error(norms, true_norms) <= ERROR_RATIO * autograd_norm_error
    assert relative_error(update, true_update) <= ERROR_RATIO * autograd_update_error


@pytest.mark.parametrize("precision", ["autocast_bf16", "bf16_params"])
def test_materialised_blocks_fill_block_bytes_once_widened(monkeypatch, precision):
    """The reductions read each block of per-sequence gradients widened to fp32 (the blocks themselves are
    bf16 here): a widened block fills ``block_bytes``, neither more (bf16 parameters once made it twice
    the budget) nor much less."""
    from vcpo.core.per_sequence_grads import sites

    widened_sizes = []

    def recording_outer(rows, cols):
        block = per_sample_outer(rows, cols)
        assert block.dtype == torch.bfloat16
        widened_sizes.append(block.numel() * torch.float32.itemsize)
        return block

    per_sample_outer = sites.per_sample_outer
    monkeypatch.setattr(sites, "per_sample_outer", recording_outer)
    budget = 16 * 1024
    model = float64_model("qwen2").to(PRECISIONS[precision][0])
    batch = make_batch(seed=4)
    per_sequence = PerSequenceGradients(model, norm_method="materialize", block_bytes=budget)
    with per_sequence.micro_batch(batch["coef_r"], batch["coef_s"]):
        with precision_context(precision):
            padded_scores(model, batch).float().sum().backward()
    assert widened_sizes and 0.75 * budget < max(widened_sizes) <= budget
