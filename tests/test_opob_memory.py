"""The memory model of an actor step (vcpo.actor_memory) and the launcher's projection of it.

The model's numbers against hand counts and against the real modules' parameter counts; its decisions against
the rule it states; the launcher's projection of every paper recipe against its goal (OPOB's peak per GPU
at most 1.25x the plain step's and within the task's GPU). The docs' tables and numbers of the model and of its
measurement (benchmarks/opob_memory.py) are checked with the other docs checks (tests/test_docs.py).
"""

from __future__ import annotations

import pytest
import torch

from vcpo.actor_memory import (
    SINGLE_MODE_ALLOWANCE,
    Layout,
    ModelShape,
    StepShape,
    choose_mode,
    hf_attention,
    split_buffers,
    step_memory,
)
from vcpo.local_models import random_qwen2

SHAPE = ModelShape(hidden=64, intermediate=128, layers=2, vocab=100, heads=4, kv_heads=2, tied=True)


@pytest.mark.parametrize("tied", [True, False])
def test_the_parameter_count_is_the_real_models(tied):
    model = random_qwen2(100, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                         tie_word_embeddings=tied)
    shape = ModelShape.from_config(model.config)
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    assert shape.kv_width == 32


def test_the_paper_models_have_their_published_sizes():
    from vcpo.launch.memory import model_shape

    assert model_shape("Qwen/Qwen2.5-7B").parameters == 7_615_616_512  # "7.61B" on its model card
    assert model_shape("Qwen/Qwen2-1.5B").parameters == 1_543_714_304  # "1.54B"
    with pytest.raises(KeyError, match="recipes/models.yaml"):
        model_shape("org/unknown-model")


def test_fsdp2_terms_by_hand():
    """P = 80,704 parameters on 4 ranks, float32 weights and bf16 compute, 1,000 tokens, no checkpointing."""
    P = SHAPE.parameters
    assert P == 6400 + 2 * 37120 + 64  # tied embedding, two layers, the final norm
    layout = Layout(strategy="fsdp2", data_parallel=4, param_bytes=4, compute_bytes=2, gradient_checkpointing=False)
    memory = step_memory(SHAPE, layout, StepShape(tokens_per_micro_batch=1000, buffers=6, block_bytes=1 << 10))
    assert memory.persistent == {"parameters (sharded)": P, "Adam moments (sharded)": 2 * P}
    per_token_layer = (12 * 64 + 4 * 128 + 3 * 32) * 2  # bytes
    activations = 1000 * per_token_layer * 2 + 2 * 1000 * 100 * 4
    largest_unit = max(SHAPE.layer_parameters, SHAPE.embedding_parameters) * 2
    assert memory.step("plain") == P + 2 * largest_unit + activations
    # single: the model unsharded (bf16), a float32 G_R, and the 6 buffers beside the activations (all open at once
    # by default), or at combine with the flat all-reduce copy and the shard
    assert memory.step("single") == 2 * P + 4 * P + max(6 * 4 * P + activations, 6 * 4 * P + 4 * P + P)
    # two_pass: the plain step, plus what the norms pass (activations, two blocks and three float32 copies of the
    # micro-batch's hidden states, and no gradient) needs beyond it
    scratch = 2 * 1024 + 3 * 1000 * 64 * 4
    assert memory.step("two_pass") == memory.step("plain") + max(0, scratch - (P + 2 * largest_unit))


def test_single_grows_by_one_copy_per_buffer_and_two_pass_not_at_all():
    layout = Layout(strategy="fsdp2", data_parallel=2)
    steps = [step_memory(SHAPE, layout, StepShape(tokens_per_micro_batch=64, buffers=b)) for b in (2, 3, 64)]
    assert steps[1].peak("single") - steps[0].peak("single") == 4 * SHAPE.parameters
    assert len({s.peak("two_pass") for s in steps}) == 1


def test_buffers_opened_before_the_last_micro_batch():
    layout = Layout(strategy="fsdp2", data_parallel=1, compute_bytes=4, gradient_checkpointing=False)
    late = step_memory(SHAPE, layout, StepShape(tokens_per_micro_batch=4000, buffers=8, buffers_before_last=6))
    early = step_memory(SHAPE, layout, StepShape(tokens_per_micro_batch=4000, buffers=8))
    assert early.step("single") - late.step("single") == 2 * 4 * SHAPE.parameters


def test_split_buffers_by_hand():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.5])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    # group 0: both outcomes; 1: successes only; 2: failures only; 3: a partial reward opens both
    assert split_buffers(rewards, groups) == 2 + 1 + 1 + 2


def test_auto_mode_follows_its_rule():
    layout = Layout(strategy="fsdp2", data_parallel=4)
    few = step_memory(SHAPE, layout, StepShape(tokens_per_micro_batch=100_000, buffers=1))
    many = step_memory(SHAPE, layout, StepShape(tokens_per_micro_batch=1_000, buffers=64))
    assert few.peak("single") <= SINGLE_MODE_ALLOWANCE * few.peak("plain")
    assert choose_mode(few)[0] == "single"
    assert choose_mode(few, capacity=few.peak("single") - 1)[0] == "two_pass"  # the GPU is the other limit
    mode, why = choose_mode(many)
    assert mode == "two_pass" and "> 1.25" in why
    assert choose_mode(many, "single") == ("single", "requested")
    with pytest.raises(ValueError, match="opob_mode must be"):
        choose_mode(many, "fast")
    megatron = step_memory(SHAPE, Layout(strategy="megatron", tensor_parallel=2), StepShape(tokens_per_micro_batch=100, buffers=64))
    assert choose_mode(megatron)[0] == "two_pass"


def test_megatron_without_sequence_parallelism_keeps_the_norm_widths_whole_and_local_attention_its_scores():
    """Hand counts at TP 2, two sequences of 100 tokens in a micro-batch, bf16: without sequence parallelism 4h of the
    12h per token and layer stay whole on each rank; megatron's local attention keeps a (heads / TP, s, s) score matrix
    per sequence: 6 bytes a score in every layer, plus the backward's 4 (recomputed: one layer's 6 + 4)."""
    from vcpo.actor_memory import activation_bytes

    h, i, kv, layers, tokens, length = 64, 128, 32, 2, 200, 100
    split = Layout(strategy="megatron", tensor_parallel=2, gradient_checkpointing=False)
    whole = Layout(strategy="megatron", tensor_parallel=2, gradient_checkpointing=False, sequence_parallel=False)
    assert activation_bytes(SHAPE, split, tokens)["activations"] == tokens * layers * (12 * h + 4 * i + 3 * kv) * 2 / 2
    assert activation_bytes(SHAPE, whole, tokens)["activations"] == tokens * layers * ((8 * h + 4 * i + 3 * kv) * 2 / 2 + 4 * h * 2)
    scores = 2 * (4 / 2) * length**2  # per layer
    kept = activation_bytes(SHAPE, Layout(strategy="megatron", tensor_parallel=2, gradient_checkpointing=False, attention="local"), tokens, length)
    assert kept["local attention scores"] == scores * (6 * layers + 4)
    recomputed = activation_bytes(SHAPE, Layout(strategy="megatron", tensor_parallel=2, gradient_checkpointing=False,
                                                attention="local_recomputed"), tokens, length)
    assert recomputed["local attention scores (one layer, recomputed)"] == scores * (6 + 4)
    assert "local attention scores" not in activation_bytes(SHAPE, split, tokens, length)  # fused attention keeps none
    with pytest.raises(ValueError, match="Layout.attention must be one of"):
        Layout(attention="flash")


def test_masked_sdpa_on_cpu_keeps_one_t_squared_float32_per_layer():
    """Hand counts, two layers: packed (one row of 896 tokens) keeps 2 x 896² x 4 bytes whatever the heads; padded
    (sequences of 100 tokens) one (100, 100) mask per sequence and layer; under gradient checkpointing one layer's."""
    from vcpo.actor_memory import activation_bytes

    key = "masked attention (a T² float32 per layer)"
    masked = Layout(gradient_checkpointing=False, attention="masked")
    assert activation_bytes(SHAPE, masked, 896)[key] == 2 * 896**2 * 4
    assert activation_bytes(SHAPE, masked, 200, 100)[key] == 2 * 2 * 100**2 * 4
    assert activation_bytes(SHAPE, Layout(gradient_checkpointing=True, attention="masked"), 896)[key] == 896**2 * 4
    assert key not in activation_bytes(SHAPE, Layout(gradient_checkpointing=False), 896)
    assert hf_attention("cpu", "sdpa", packed=True) == "masked"
    assert {hf_attention("cuda", "sdpa", True), hf_attention("cpu", "sdpa", False), hf_attention("cuda", "flash_attention_2", True)} == {"fused"}


@pytest.mark.parametrize("impl, granularity, modules, expected", [
    ("local", "selective", ["core_attn"], (False, "local_recomputed")),
    ("local", "selective", None, (False, "local_recomputed")),  # megatron's default module list is core_attn
    ("local", "selective", ["mlp"], (False, "local")),
    ("local", None, None, (False, "local")),
    ("local", "full", None, (True, "local")),
    ("transformer_engine", None, None, (False, "fused")),
    (None, "full", None, (True, "fused")),
])
def test_megatron_recompute_reads_the_transformer_config_as_megatron_does(impl, granularity, modules, expected):
    from vcpo.actor_memory import megatron_recompute

    assert megatron_recompute(impl, granularity, modules) == expected


# ---------------------------------------------------------------------------------------------
# The launcher's projection
# ---------------------------------------------------------------------------------------------

pytest.importorskip("verl")


@pytest.mark.parametrize("task", ["gsm8k", "math", "countdown", "simpletir"])
def test_every_paper_recipe_fits_on_fsdp2(task):
    """The goal: on every paper recipe as composed (FSDP2), the OPOB step the engine runs peaks at most
    1.25x the plain step and within the task's GPU."""
    from vcpo.launch import compose, make_run
    from vcpo.launch.memory import gpu_memory_gb, projection

    run = make_run(task, "vcpo")
    capacity = gpu_memory_gb(run.task.paper)
    projected = projection(compose(run), capacity)
    assert projected.opob and projected.mode == "two_pass"
    assert projected.peak() <= SINGLE_MODE_ALLOWANCE * projected.memory.peak("plain")
    assert projected.peak() <= capacity * 1e9
    # and the single backward would not have fitted 1.25x: every rank holds a buffer pair for every group
    assert projected.memory.peak("single") > SINGLE_MODE_ALLOWANCE * projected.memory.peak("plain")


def test_the_groups_per_rank_of_math():
    """MATH: 32 prompts x 16 samples on 4 trainer GPUs, 128 sequences per rank: every group may be on every rank,
    so 32 groups per rank and 64 split buffers."""
    from vcpo.launch import compose, make_run
    from vcpo.launch.memory import projection

    projected = projection(compose(make_run("math", "vcpo")))
    assert projected.step.buffers == 64 and projected.layout.data_parallel == 4
    assert projected.step.tokens_per_micro_batch == 12288


def test_the_dry_run_prints_the_projection_and_refuses_what_cannot_fit(capsys):
    from vcpo.launch.__main__ import main

    assert main(["--task", "math", "--method", "vcpo", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "#   the engine runs OPOB two_pass" in printed and "GPU 80 GB" in printed
    # the same run told its GPU has 20 GB: refused by name before anything starts
    assert main(["--task", "math", "--method", "vcpo", "--dry-run", "--gpu-memory-gb", "20"]) == 2
    assert "OPOB two_pass step is projected at" in capsys.readouterr().err
    # forcing the single backward on MATH: refused, naming two_pass as the way out
    argv = ["--task", "math", "--method", "vcpo", "--dry-run", "--", "+actor_rollout_ref.actor.policy_loss.opob_mode=single"]
    assert main(argv) == 2
    assert "opob_mode=two_pass" in capsys.readouterr().err


def test_simpletir_is_checked_against_its_b200():
    from vcpo.launch import make_run
    from vcpo.launch.memory import gpu_memory_gb

    assert gpu_memory_gb(make_run("simpletir", "vcpo").task.paper) == 180.0
    assert gpu_memory_gb(make_run("gsm8k", "vcpo").task.paper) == 80.0  # no GPU named: the default
