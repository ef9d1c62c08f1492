"""The memory model of an actor step (vcpo.actor_memory) and the launcher's projection of it.

The model's numbers against hand counts and against the real modules' parameter counts; its decisions against
the rule it states; the launcher's projection of every paper recipe against its goal (OPOB's peak per GPU
at most 1.25x the plain step's and within the task's GPU). The docs' tables and numbers of the model and of its
measurement (benchmarks/opob_memory.py) are checked with the other docs checks (tests/test_docs.py).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from vcpo.actor_memory import (
    CUDA_OVERHEAD_BYTES,
    SINGLE_MODE_ALLOWANCE,
    Layout,
    ModelShape,
    StepShape,
    activation_bytes,
    activation_phases,
    choose_mode,
    hf_attention,
    logits_bytes,
    megatron_layer_bytes,
    megatron_recompute,
    norm_hook_bytes,
    split_buffers,
    step_memory,
    verl_log_probs,
)
from vcpo.local_models import random_qwen2

SHAPE = ModelShape(hidden=64, intermediate=128, layers=2, vocab=100, heads=4, kv_heads=2, tied=True)
CPU = Layout(device="cpu")  # no CUDA context, no fragmentation margin: the step's own terms
CONTEXT = "CUDA context, cuBLAS workspaces and NCCL buffers (bound)"
OPTIMIZER = "optimizer step: foreach AdamW's square roots (a copy of the local shard)"


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
    """P = 80,704 parameters on 4 ranks, float32 weights and bf16 compute, 1,000 tokens, no checkpointing, verl's
    log-softmax path (two bf16 copies of the logits)."""
    P = SHAPE.parameters
    assert P == 6400 + 2 * 37120 + 64  # tied embedding, two layers, the final norm
    layout = replace(CPU, data_parallel=4, param_bytes=4, compute_bytes=2, gradient_checkpointing=False)
    memory = step_memory(SHAPE, layout, StepShape(tokens_per_micro_batch=1000, buffers=6, block_bytes=1 << 10))
    assert memory.persistent == {"parameters (sharded)": P, "Adam moments (sharded)": 2 * P}
    per_token_layer = (12 * 64 + 4 * 128 + 3 * 32) * 2  # bytes
    activations = 1000 * per_token_layer * 2 + 2 * 1000 * 100 * 2
    largest_unit = max(SHAPE.layer_parameters, SHAPE.embedding_parameters) * 2
    assert memory.step("plain") == P + 2 * largest_unit + activations
    # single (split: G_R is its first buffer): the model unsharded (bf16) and the 6 buffers beside the activations
    # (all open before the last micro-batch, by default); at combine the buffers and the bf16 combined gradient; at
    # the all-reduce the gradient, its float32 copies and the flat float32 buffer
    assert memory.step("single") == 2 * P + max(6 * 4 * P + activations, 6 * 4 * P + 2 * P, 2 * P + 4 * P + 4 * P)
    # two_pass: the plain step, plus what the norms pass (activations, two blocks and three float32 copies of the
    # micro-batch's hidden states, and no gradient) needs beyond it
    scratch = 2 * 1024 + 3 * 1000 * 64 * 4
    assert memory.step("two_pass") == memory.step("plain") + max(0, scratch - (P + 2 * largest_unit))
    assert memory.peak("plain") == memory.allocated("plain") == 3 * P + memory.step("plain")  # on CPU nothing else


def test_the_norms_scratch_takes_the_engines_block_on_the_layouts_device():
    """Without a block size, the two-pass step's norms scratch counts two blocks of the size the engine picks on
    the layout's device (vcpo.core.per_sequence_grads.reductions.DEFAULT_BLOCK_BYTES): 2 MiB on a CPU, 128 MiB on a
    GPU (a CPU projection once counted a GPU's blocks: 3.5x the measured step)."""
    layout = replace(CPU, data_parallel=1, param_bytes=4, compute_bytes=4, gradient_checkpointing=False)
    step = StepShape(tokens_per_micro_batch=100, buffers=2)
    scratch = {}
    for device, block_bytes in (("cpu", 2 << 20), ("cuda", 128 << 20)):
        on_device = replace(layout, device=device)
        memory = step_memory(SHAPE, on_device, step)
        assert memory.two_pass == step_memory(SHAPE, on_device, replace(step, block_bytes=block_bytes)).two_pass
        scratch[device] = memory.two_pass["pass 1 beyond pass 2 (norms scratch)"]
    assert scratch["cpu"] > 0
    assert scratch["cuda"] - scratch["cpu"] == 2 * ((128 << 20) - (2 << 20))


def test_the_logits_by_log_prob_path():
    """1,000 tokens over a vocabulary of 100: flash-attn's cross-entropy keeps the bf16 logits once (its gradient in
    place), verl's log-softmax twice, in float32 (the CPU benchmark) twice at 4 bytes; megatron at TP 2 its half of the
    vocabulary in bf16 and in float32."""
    assert logits_bytes(SHAPE, replace(CPU, log_probs="fused"), 1000) == 1000 * 100 * 2
    assert logits_bytes(SHAPE, replace(CPU, log_probs="log_softmax"), 1000) == 2 * 1000 * 100 * 2
    assert logits_bytes(SHAPE, replace(CPU, compute_bytes=4), 1000) == 2 * 1000 * 100 * 4
    assert logits_bytes(SHAPE, replace(CPU, strategy="megatron", tensor_parallel=2), 1000) == 1000 * 50 * (2 + 4)
    assert verl_log_probs(True, {}) == "fused"
    assert verl_log_probs(True, {"VERL_DISABLE_FLASH_ATTN_CE": "1"}) == verl_log_probs(False, {}) == "log_softmax"
    with pytest.raises(ValueError, match="Layout.log_probs must be one of"):
        Layout(log_probs="chunked")


def test_the_logits_and_a_recomputed_layer_never_coexist():
    """Gradient checkpointing, bf16, fused log-probs, 1,000 tokens: the layers' inputs (1,000 x 64 x 2 bytes x 2
    layers) beside the larger of the logits (1,000 x V x 2 bytes), freed by the output layer's backward, and one
    layer recomputed after it (1,000 x (12·64 + 4·128 + 3·32) x 2 bytes); without checkpointing every layer's
    activations meet the logits."""
    layout = replace(CPU, log_probs="fused", gradient_checkpointing=True)
    inputs, layer = 1000 * 64 * 2 * 2, 1000 * (12 * 64 + 4 * 128 + 3 * 32) * 2
    assert activation_bytes(SHAPE, layout, 1000) == {"activations: layer inputs": inputs, "activations: one recomputed layer": layer}
    wide = replace(SHAPE, vocab=10_000)  # 20 MB of logits against the layer's 2.75 MB
    assert activation_bytes(wide, layout, 1000) == {"activations: layer inputs": inputs, "logits": 1000 * 10_000 * 2}
    assert activation_bytes(SHAPE, replace(layout, gradient_checkpointing=False), 1000) == {"activations": 2 * layer,
                                                                                           "logits": 1000 * 100 * 2}


def test_single_grows_by_one_copy_per_buffer_and_two_pass_not_at_all():
    layout = replace(CPU, data_parallel=2)
    steps = [step_memory(SHAPE, layout, StepShape(tokens_per_micro_batch=64, buffers=b)) for b in (2, 3, 64)]
    assert steps[1].peak("single") - steps[0].peak("single") == 4 * SHAPE.parameters
    assert len({s.peak("two_pass") for s in steps}) == 1


def test_buffers_opened_before_the_last_micro_batch():
    """Two of 8 buffers open in the last micro-batch's backward: only their output layer's part (vocabulary x hidden
    = 6,400 values, float32) meets its activations at their largest (4,000 tokens: the backward's start)."""
    layout = replace(CPU, data_parallel=1, compute_bytes=4, gradient_checkpointing=False)
    late = step_memory(SHAPE, layout, StepShape(tokens_per_micro_batch=4000, buffers=8, buffers_before_last=6))
    early = step_memory(SHAPE, layout, StepShape(tokens_per_micro_batch=4000, buffers=8))
    assert early.step("single") - late.step("single") == 2 * 4 * SHAPE.parameters - 2 * 4 * 100 * 64


def test_fsdp2_single_phases_by_hand():
    """FSDP2 single, bf16 compute on 2 ranks, P = 80,704, 4 buffers, 2 of them open before the last micro-batch
    (benchmarks/memory_model_check.py measured each phase's peak: the last backward, then combine, then the all-reduce;
    `combination="split"` opens no G_R of its own, which the model once counted as a float32 copy, +35% to +46% of the
    measured step):

      last backward  the unsharded model (2P), the 2 earlier buffers (2 x 4P) and the micro-batch's widest backward
                     phase; at its start (the logits alive) the 2 new buffers' output-layer rows (2 x 4 x 100 x 64);
                     at the top layer's backward those and that layer's (2 x 4 x 37,120); at its end the 2 new buffers
                     whole (2 x 4P) beside one layer's activations
      combine        2P + 4 x 4P, and the bf16 gradient written one parameter at a time beside them (2P)
      all-reduce     after the buffers are freed: 2P + the bf16 gradient 2P + its float32 copies 4P + the flat 4P
    The `buffers` combination opens a float32 G_R in the backward besides."""
    from vcpo.actor_memory import fsdp2_single_phases

    P, tokens = SHAPE.parameters, 1000
    layout = replace(CPU, data_parallel=2, param_bytes=4, compute_bytes=2, gradient_checkpointing=False)
    step = StepShape(tokens_per_micro_batch=tokens, buffers=4, buffers_before_last=2)
    phases = activation_phases(SHAPE, layout, tokens)
    layer = tokens * (12 * 64 + 4 * 128 + 3 * 32) * 2
    kept, logits = 2 * layer, 2 * tokens * 100 * 2
    assert sum(phases["backward's start"].values()) == kept + logits
    assert sum(phases["one layer's backward"].values()) == kept
    single = fsdp2_single_phases(SHAPE, layout, step, phases)
    last = 2 * P + 2 * 4 * P + max(kept + logits + 2 * 4 * 6400, kept + 2 * 4 * (6400 + 37120), 2 * 4 * P + layer)
    assert sum(single["last micro-batch's backward"].values()) == last
    assert sum(single["combine"].values()) == 2 * P + 4 * 4 * P + 2 * P
    assert sum(single["all-reduce"].values()) == 2 * P + 2 * P + 4 * P + 4 * P
    assert step_memory(SHAPE, layout, step).step("single") == max(last, 20 * P, 12 * P)
    many = replace(SHAPE, vocab=10)  # the new buffers whole beside one layer: the backward's end is the widest
    wide = fsdp2_single_phases(many, layout, replace(step, tokens_per_micro_batch=10), activation_phases(many, layout, 10))
    assert wide["last micro-batch's backward"]["its new group buffers: every parameter's (float32)"] == 2 * 4 * many.parameters
    buffers = fsdp2_single_phases(SHAPE, layout, replace(step, combination="buffers"), phases)
    assert buffers["combine"]["G_R (float32)"] == buffers["last micro-batch's backward"]["G_R (float32)"] == 4 * P
    one_rank = fsdp2_single_phases(SHAPE, replace(layout, data_parallel=1, compute_bytes=4), step, phases)
    assert "all-reduce" not in one_rank and one_rank["combine"]["combined gradient (compute dtype)"] == 0  # p.grad is a buffer
    with pytest.raises(ValueError, match="combination must be split or buffers"):
        StepShape(tokens_per_micro_batch=1, buffers=1, combination="deferred")


def test_split_buffers_by_hand():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.5])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    # group 0: both outcomes; 1: successes only; 2: failures only; 3: a partial reward opens both
    assert split_buffers(rewards, groups) == 2 + 1 + 1 + 2


def test_auto_mode_follows_its_rule():
    layout = replace(CPU, data_parallel=4)
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
    megatron = step_memory(SHAPE, replace(CPU, strategy="megatron", tensor_parallel=2), StepShape(tokens_per_micro_batch=100, buffers=64))
    assert choose_mode(megatron)[0] == "two_pass"


MEGATRON = replace(CPU, strategy="megatron", tensor_parallel=2, gradient_checkpointing=False, sequence_parallel=False,
                   attention="local_recomputed")


def test_megatron_layer_bytes_by_hand():
    """One megatron local-spec layer per token on a rank, bf16, TP 2, h = 64, I = 128, 4 heads of 16, 2 key/value
    heads (kv = 32), as autograd saves it (megatron-core 0.16.1): each RMSNorm's float32 input copy and normalised
    values, its reciprocal root and its bf16 output; cos and sin for q and k; core attention's inputs and output;
    the MLP's five I-wide tensors. The same count gives the saved tensors measured on a CPU layer of h = 256, I = 512,
    8 heads of 32, 2 key/value heads (saved_tensors_hooks, 128 tokens): 12,424 bytes per token with core attention
    recomputed and 12,552 kept unfused (beside its 6 bytes a score)."""
    norms = 2 * (4 * 64 + 4 * 64 + 4 + 2 * 64)
    rotary = 4 * 16 * 2
    mlp = (2 * 128 + 128 + 128 + 128) * 2 / 2  # fc1's output, SiLU's, the linear half plus the offset, the product
    recomputed = (64 + 32 + (64 + 2 * 32) + 64) * 2 / 2  # rotated q and k, the fused qkv output (v a view), the output
    kept = (64 + 64 + 64 + 64) * 2 / 2  # q, k and v repeated to the 4 heads, the output
    assert megatron_layer_bytes(SHAPE, MEGATRON) == norms + rotary + recomputed + mlp
    assert megatron_layer_bytes(SHAPE, replace(MEGATRON, attention="fused")) == norms + rotary + recomputed + mlp
    assert megatron_layer_bytes(SHAPE, replace(MEGATRON, attention="local")) == norms + rotary + kept + mlp
    assert megatron_layer_bytes(SHAPE, replace(MEGATRON, sequence_parallel=True)) == norms / 2 + rotary + recomputed + mlp
    heads = replace(SHAPE, kv_heads=4)  # no grouped queries: k itself and the fused qkv output (3h) stay
    assert megatron_layer_bytes(heads, replace(MEGATRON, attention="local")) == norms + rotary + (64 + 64 + 3 * 64 + 64) * 2 / 2 + mlp
    measured = ModelShape(hidden=256, intermediate=512, layers=1, vocab=1024, heads=8, kv_heads=2, tied=False)
    alone = replace(MEGATRON, tensor_parallel=1)
    assert megatron_layer_bytes(measured, alone) == 12_424
    assert megatron_layer_bytes(measured, replace(alone, attention="local")) == 12_552


def test_megatron_score_matrices_by_hand():
    """Two sequences of 100 tokens, 4 heads over TP 2: S = 2 x 2 x 100² scores per layer, 2 x 100² mask entries.
    Kept unfused: every layer 6 bytes a score and a mask byte, the layer in its backward 12 a score (its own 6
    included). Recomputed: that layer's 12 and its mask only. Megatron's persistent bf16 buffer: 2 bytes a score."""
    scores, squares = 2 * 2 * 100**2, 2 * 100**2
    kept = activation_phases(SHAPE, replace(MEGATRON, attention="local"), 200, 100)
    assert kept["backward's start"]["local attention scores and masks, every layer"] == 2 * (6 * scores + squares)
    assert kept["one layer's backward"]["local attention's softmax backward (one layer)"] == (12 - 6) * scores
    recomputed = activation_phases(SHAPE, MEGATRON, 200, 100)
    assert recomputed["one layer's backward"]["local attention scores and mask (one layer, recomputed) in its softmax backward"] == (
        12 * scores + squares)
    assert not [name for name in recomputed["backward's start"] if "attention" in name]
    memory = step_memory(SHAPE, MEGATRON, StepShape(tokens_per_micro_batch=200, buffers=1, sequence_length=100))
    assert memory.persistent["megatron's attention score buffer (bf16, one layer)"] == 2 * scores
    fused = step_memory(SHAPE, replace(MEGATRON, attention="fused"), StepShape(tokens_per_micro_batch=200, buffers=1, sequence_length=100))
    assert not [name for kind in ("persistent", "plain", "two_pass") for name in getattr(fused, kind) if "attention" in name]


def test_megatron_single_phases_by_hand():
    """Megatron single at TP 2, 200 tokens (2 sequences of 100), 3 groups on the rank and 1 per micro-batch: G_R and
    the 3 buffers (4 x P / 2 float32) throughout; `MegatronSequenceNorms` forms a micro-batch's k = 1 + 1 combinations
    of each linear (float32 products and their stack: 2k out x in / TP) and of the embedding (a float64 scatter and
    its float32 copy: 12 k V h / TP bytes). The output layer's meet the logits at the backward's start (V h / TP =
    3,200), fc1's (2I x h / TP = 8,192) a layer's backward, the embedding's come last, every activation freed.
    Counting every group in the micro-batch (the model once did, in float64: +28% of the measured 50M step) is the
    bound where the micro-batches are not known."""
    from vcpo.actor_memory import megatron_single_phases

    P, tokens = SHAPE.parameters, 200
    step = StepShape(tokens_per_micro_batch=tokens, buffers=3, sequence_length=100, groups_per_micro_batch=1)
    hooks = {"norm hooks' normalised inputs (every norm)": norm_hook_bytes(SHAPE, MEGATRON, tokens)}
    norms = {"ghost": 1.0}
    buffers = {"G_R and group buffers (float32)": 4 * P / 2 * 4}
    phases = megatron_single_phases(SHAPE, MEGATRON, step, hooks, norms, buffers)
    plain = activation_phases(SHAPE, MEGATRON, tokens, 100, hooks)
    assert sum(phases["backward's start"].values()) == 4 * P / 2 * 4 + sum(plain["backward's start"].values()) + 1 + 2 * 2 * 3200 * 4
    assert sum(phases["one layer's backward"].values()) == 4 * P / 2 * 4 + sum(plain["one layer's backward"].values()) + 1 + 2 * 2 * 8192 * 4
    assert phases["embedding's backward"] == {**buffers, "embedding's k combinations (float64 scatter, float32 copy)": 2 * 3200 * 12}
    every = megatron_single_phases(SHAPE, MEGATRON, replace(step, groups_per_micro_batch=None), hooks, norms, buffers)
    assert every["embedding's backward"]["embedding's k combinations (float64 scatter, float32 copy)"] == 4 * 3200 * 12
    # in the model: the ghost norms' float32 inputs of the widest layer (max(V, I) / TP = 64 wide, and h) and two
    # Gram matrices per 100-token sequence
    ghost = {"float32 ghost-norm inputs (widest layer) and Gram matrices": 200 * (64 + 64) * 4 + 2 * 200 * 100 * 4}
    memory = step_memory(SHAPE, MEGATRON, step)
    assert memory.single == max([*megatron_single_phases(SHAPE, MEGATRON, step, hooks, ghost, buffers).values(), memory.plain],
                                key=lambda phase: sum(phase.values()))


def test_megatron_norm_hooks_keep_every_normalised_input():
    """OPOB's norm hooks keep each norm's normalised input until its backward: 200 tokens, h = 64, bf16, 2 layers:
    (2 x 2 + the final) norms x 200 x 64 x 2 bytes; under full recompute the recomputed layer's 2 and the final;
    sequence parallelism over TP 2 halves the tokens. The plain step has no hooks."""
    assert norm_hook_bytes(SHAPE, MEGATRON, 200) == 5 * 200 * 64 * 2
    assert norm_hook_bytes(SHAPE, replace(MEGATRON, gradient_checkpointing=True), 200) == 3 * 200 * 64 * 2
    assert norm_hook_bytes(SHAPE, replace(MEGATRON, sequence_parallel=True), 200) == 5 * 200 * 64 * 2 / 2
    memory = step_memory(SHAPE, MEGATRON, StepShape(tokens_per_micro_batch=200, buffers=1, sequence_length=100))
    key = "norm hooks' normalised inputs (every norm)"
    assert memory.two_pass[key] == memory.single[key] == 5 * 200 * 64 * 2 and key not in memory.plain


def test_the_optimizer_step_holds_a_float32_copy_of_its_shard():
    """One token: the optimizer step is the widest phase. FSDP2 on one rank: the float32 gradient (4P) and foreach
    AdamW's square roots (4P). Megatron at TP 2 and DP 2 (distributed optimizer): its shard of P / 2 / 2 float32
    values, 40% of it where megatron keeps 60% of its optimizer on the CPU."""
    P = SHAPE.parameters
    fsdp = step_memory(SHAPE, CPU, StepShape(tokens_per_micro_batch=1, buffers=1))
    assert fsdp.plain == {"gradients (sharded)": 4 * P, OPTIMIZER: 4 * P}
    megatron = replace(MEGATRON, data_parallel=2, optimizer_cpu_fraction=0.6)
    memory = step_memory(SHAPE, megatron, StepShape(tokens_per_micro_batch=1, buffers=1))
    assert memory.plain == {OPTIMIZER: pytest.approx(P / 2 / 2 * 0.4 * 4, rel=1e-12)}
    assert memory.persistent["main parameters and Adam moments (float32)"] == pytest.approx(3 * P / 2 / 2 * 0.4 * 4, rel=1e-12)


def test_a_gpu_adds_its_context_the_weight_sync_and_a_fragmentation_margin():
    """On a GPU, outside the caching allocator: 3 GB of CUDA context, cuBLAS and NCCL (the larger end of 1-3 GB),
    and on trainer rank 0 of an nccl weight sync two 2,048 MiB cupy buckets (4,294,967,296 bytes); the allocator's
    peak raised by 10%. The step's own terms, at one block size for the norms, are the CPU's."""
    step = StepShape(tokens_per_micro_batch=1000, buffers=6, block_bytes=128 << 20)
    cpu = step_memory(SHAPE, replace(CPU, data_parallel=4), step)
    gpu = step_memory(SHAPE, Layout(data_parallel=4, weight_sync_bucket_bytes=2048 * 2**20), step)
    assert gpu.outside_allocator == {CONTEXT: 3e9, "weight-sync send and receive buckets (cupy, trainer rank 0)": 4_294_967_296}
    assert cpu.outside_allocator == {} and cpu.fragmentation == 0
    for kind in ("plain", "single", "two_pass"):
        assert gpu.step(kind) == cpu.step(kind)
        assert gpu.peak(kind) == pytest.approx(cpu.peak(kind) * 1.1 + 3e9 + 4_294_967_296, rel=1e-12)


def test_offload_moves_the_state_off_the_gpu():
    """FSDP2's CPUOffloadPolicy: no parameters, moments, gradients or optimizer step on the GPU, the units and the
    activations stay. verl's param and optimizer offload leave the step as it is (verl loads them back for it).
    Megatron's optimizer wholly on the CPU: its bf16 parameters and float32 gradients stay."""
    P, step = SHAPE.parameters, StepShape(tokens_per_micro_batch=1000, buffers=6)
    on = step_memory(SHAPE, replace(CPU, data_parallel=4), step)
    off = step_memory(SHAPE, replace(CPU, data_parallel=4, fsdp_offload_policy=True), step)
    assert off.persistent == {}
    assert off.plain == {name: size for name, size in on.plain.items() if name != "gradients (sharded)"}
    between = replace(CPU, data_parallel=4, offloaded_between_steps=frozenset({"parameters", "optimizer"}))
    assert step_memory(SHAPE, between, step).peak("plain") == on.peak("plain")
    megatron = step_memory(SHAPE, replace(MEGATRON, attention="fused", optimizer_cpu_fraction=1.0), step)
    assert megatron.persistent == {"parameters (bf16)": P / 2 * 2, "main gradients (float32)": P / 2 * 4}


def test_at_lag_0_the_rollout_shares_the_gpu():
    """A colocated vLLM of gpu_memory_utilization 0.5 on an 80 GB GPU: 40 GB. Asleep through the step it keeps 10%
    of that (4 GB, above a CUDA context's 3 GB); not sleeping (free_cache_engine=false) all of it. Between steps, while
    it generates: the actor's parameters and moments (unless offloaded), the actor's 3 GB and the rollout's 40 GB."""
    P, step = SHAPE.parameters, StepShape(tokens_per_micro_batch=1000, buffers=6)
    layout = Layout(data_parallel=4, rollout_budget_bytes=40e9)
    memory = step_memory(SHAPE, layout, step)
    assert memory.outside_allocator == {CONTEXT: 3e9, "colocated rollout, asleep": 4e9}
    awake = "colocated rollout, awake (its gpu_memory_utilization)"
    assert memory.between_steps == {"parameters (sharded)": P, "Adam moments (sharded)": 2 * P, CONTEXT: 3e9, awake: 40e9}
    assert memory.peak("plain") == sum(memory.between_steps.values())  # 43 GB, above the step's 7 GB
    offloaded = step_memory(SHAPE, replace(layout, offloaded_between_steps=frozenset({"parameters", "optimizer"})), step)
    assert offloaded.between_steps == {CONTEXT: 3e9, awake: 40e9}
    assert step_memory(SHAPE, replace(layout, rollout_budget_bytes=10e9), step).outside_allocator["colocated rollout, asleep"] == CUDA_OVERHEAD_BYTES
    assert step_memory(SHAPE, replace(layout, rollout_frees_cache=False), step).outside_allocator["colocated rollout, awake"] == 40e9


def test_masked_sdpa_on_cpu_keeps_one_t_squared_float32_per_layer():
    """Hand counts, two layers: packed (one row of 896 tokens) keeps 2 x 896² x 4 bytes whatever the heads; padded
    (sequences of 100 tokens) one (100, 100) mask per sequence and layer; under gradient checkpointing one layer's,
    recomputed."""
    key = "masked attention (a T² float32 per layer)"
    masked = replace(CPU, gradient_checkpointing=False, attention="masked")
    assert activation_bytes(SHAPE, masked, 896)[key] == 2 * 896**2 * 4
    assert activation_bytes(SHAPE, masked, 200, 100)[key] == 2 * 2 * 100**2 * 4
    recomputed = activation_bytes(SHAPE, replace(masked, gradient_checkpointing=True), 896)
    assert recomputed["masked attention (a T² float32, one layer)"] == 896**2 * 4
    assert key not in activation_bytes(SHAPE, replace(CPU, gradient_checkpointing=False), 896)
    assert hf_attention("cpu", "sdpa", packed=True) == "masked"
    assert {hf_attention("cuda", "sdpa", True), hf_attention("cpu", "sdpa", False), hf_attention("cuda", "flash_attention_2", True)} == {"fused"}
    with pytest.raises(ValueError, match="Layout.attention must be one of"):
        Layout(attention="flash")


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


def test_the_projection_reads_what_shares_the_gpu(monkeypatch):
    """MATH at its lag (10): verl's nccl weight sync with its 2,048 MiB bucket, no colocated rollout, flash-attn's
    cross-entropy (the launch requires it) unless the environment turns it off. At lag 0 the rollout shares every GPU:
    half of the H100's 80 GB (verl's gpu_memory_utilization 0.5), asleep while the actor trains, and no nccl sync."""
    from vcpo.launch import compose, make_run
    from vcpo.launch.memory import gpu_neighbours, projection

    config = compose(make_run("math", "vcpo"))
    assert gpu_neighbours(config, 80.0) == {"weight_sync_bucket_bytes": 2048 * 2**20, "rollout_budget_bytes": 0.0,
                                           "rollout_frees_cache": True}
    assert projection(config, 80.0).layout.log_probs == "fused"
    monkeypatch.setenv("VERL_DISABLE_FLASH_ATTN_CE", "1")
    assert projection(config, 80.0).layout.log_probs == "log_softmax"
    synchronous = compose(make_run("math", "vcpo", 0))
    assert gpu_neighbours(synchronous, 80.0) == {"weight_sync_bucket_bytes": 0, "rollout_budget_bytes": 40e9,
                                                "rollout_frees_cache": True}
    assert projection(synchronous, 80.0).layout.data_parallel == 8  # the sampler's GPUs train too


def test_offload_settings_reach_the_projection():
    from vcpo.launch import compose, make_run
    from vcpo.launch.memory import projection, with_overrides

    fsdp = compose(make_run("math", "vcpo"))
    offloaded = with_overrides(fsdp, ("actor_rollout_ref.actor.fsdp_config.offload_policy=true",
                                      "actor_rollout_ref.actor.fsdp_config.param_offload=true"))
    layout = projection(offloaded).layout
    assert layout.fsdp_offload_policy and layout.offloaded_between_steps == {"parameters"}
    assert projection(offloaded).memory.persistent == {}
    megatron = compose(make_run("math", "vcpo", strategy="megatron"))
    optimizer = "++actor_rollout_ref.actor.optim.override_optimizer_config"
    cpu_optimizer = with_overrides(megatron, (f"{optimizer}.optimizer_cpu_offload=true", f"{optimizer}.optimizer_offload_fraction=0.5"))
    assert projection(megatron).layout.optimizer_cpu_fraction == 0.0
    assert projection(cpu_optimizer).layout.optimizer_cpu_fraction == 0.5


def test_a_refused_run_is_told_what_would_fit():
    """Each change offered alone is projected again, and only those under which the step fits are named: MATH on a
    20 GB GPU fits with FSDP2's CPU offload, not with more GPUs or a smaller token budget (its logits and units
    stay); SimpleTIR on Megatron (TP 2, B200) fits with full recompute, the optimizer on the CPU or 16 trainer GPUs;
    on 5 GB nothing fits, and all of them together are projected."""
    from vcpo.launch import compose, make_run
    from vcpo.launch.memory import check_memory, fitting

    math = compose(make_run("math", "vcpo"))
    with pytest.raises(ValueError, match=r"projected at \d+\.\d GB .* more than the 20 GB") as refused:
        check_memory(math, 20.0)
    assert [change for change, _ in fitting(math, 20.0)] == [("actor_rollout_ref.actor.fsdp_config.offload_policy=true",)]
    assert "offload_policy=true" in str(refused.value)
    simpletir = compose(make_run("simpletir", "vcpo", strategy="megatron"))
    changes = [" ".join(change) for change, _ in fitting(simpletir, 180.0)]
    assert len(changes) == 3 and "recompute_granularity=full" in changes[0] and "optimizer_cpu_offload=true" in changes[1]
    assert changes[2] == "trainer.n_gpus_per_node=16"
    with pytest.raises(ValueError, match=r"no one change fits; all together \(.*\) project \d+\.\d GB, still more"):
        check_memory(math, 5.0)
