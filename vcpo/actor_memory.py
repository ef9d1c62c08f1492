"""Memory of one actor update per GPU: a plain step, and OPOB's two modes, from the model's shape and the layout.

OPOB's modes (docs/per_sequence_gradients.md, "Memory"):

  single     one backward forms the norms and, in float32 buffers, every open group's combinations (split: a
             success and a failure buffer per group; FSDP2: the whole model and its gradient unsharded for the
             step, then one all-reduce of a flat float32 copy). Fastest; its memory grows with the groups.
  two_pass   a norms-only backward (``combination="norms"``: nothing kept), then the plain step of
             Σ_i (c^R_i − b_γ(i) c^S_i) l_i (exact: the coefficients do not change within the step). Its extra memory
             is the per-sequence scratch of one layer of one micro-batch: it neither grows with the groups nor
             unshards the model; it costs a second forward and the norms' input-gradient backward.

Every quantity is in bytes per GPU and named, so that a reader (and the launcher's dry run) sees where the
memory goes. A step holds its persistent state throughout, and on top of it the widest of phases that never
coexist: the backward's start (the logits around the log-probabilities, `logits_bytes`), one layer's backward
(under recomputation that layer recomputed, and unfused attention's softmax backward), which begins after the
output layer's backward has freed the logits, and the optimizer step, after every activation is freed. The
activation terms count the tensors a decoder layer keeps for its backward per token (`hf_layer_bytes`,
`megatron_layer_bytes`). On a GPU, what lives outside PyTorch's caching allocator is added apart
(`outside_allocator`: the CUDA context, cuBLAS and NCCL; the weight-sync buffers; a colocated rollout) and the
allocator's peak is raised by a stated fragmentation margin. Where a term is uncertain, the larger bound is taken
and its comment says so. `benchmarks/opob_memory.py` measures the step's peak on CPU and prints it beside these
terms (tables/opob_memory/).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from vcpo.core.per_sequence_grads.reductions import DEFAULT_BLOCK_BYTES, device_default

GB = 1e9
OPOB_MODES = ("single", "two_pass")
# auto picks single only when its peak is at most this times the plain step's (and fits the GPU)
SINGLE_MODE_ALLOWANCE = 1.25
# values kept per token per decoder layer of HF's Qwen2/Llama (the FSDP engine) for its backward, in units of the
# hidden width h, the MLP width I and the key/value width kv, each of the compute dtype: the two RMSNorms (input,
# float32 copy, normalised input: 3h each, less what autograd shares), q/k/v and the rotary embedding (q, rotated q
# and k, v: 2h + 3kv), the attention output and o_proj's input and output (3h), the MLP's gate, up, activation and
# product (4I) and down's output (h). Counted against the tensors autograd saves for HF's Qwen2 (saved_tensors_hooks,
# 896 tokens, float32): 6,457 and 12,047 values per token and layer for the benchmark's two models, which this gives as
# 6,528 and 12,672. In bf16 with fused attention a layer keeps 20h + 8I + 4kv bytes and 4 per head (the float32
# norm copies, rotated q and k, v, the output and its log-sum-exp); these widths give 24h + 8I + 6kv, the larger,
# which also covers the hidden states' gradient flowing through the layer.
ACTIVATION_WIDTHS = {"hidden": 12, "intermediate": 4, "kv": 3}
# verl's log-probabilities on the FSDP engine keep the (tokens, vocabulary) logits in the compute dtype: flash-attn's
# cross-entropy (`fused`) keeps them once and writes their gradient in place; without it verl's row-by-row
# log-softmax (`log_softmax`) holds its outputs and then the logits' gradient, two copies at the backward's start
LOGIT_COPIES = {"fused": 1, "log_softmax": 2}
# set to 1, verl's FSDP log-probs skip flash-attn's cross-entropy for the log-softmax (verl.utils.torch_functional)
DISABLE_FLASH_CROSS_ENTROPY = "VERL_DISABLE_FLASH_ATTN_CE"
# megatron's vocab-parallel cross-entropy widens its (tokens, vocabulary / TP) logits to a float32 copy, which becomes
# the softmax and then the gradient, and hands the gradient back in the compute dtype: both widths at once, forward
# and backward
VOCAB_PARALLEL_FLOAT32_BYTES = 4
# torch's RMSNorm in the compute dtype (megatron's local layers), per normalised value: the float32 copy of its input
# and the float32 normalised values (PyTorch's composite kernel, which a CPU runs; CUDA's fused kernel keeps the input
# once, less: the larger is taken), and per token its float32 reciprocal root mean square
RMS_NORM_KEPT_BYTES = 8
RMS_NORM_KEPT_BYTES_PER_TOKEN = 4
# megatron's unfused (local) attention per score of its (heads / TP, s, s) matrix per sequence: what a layer keeps for
# its backward (the float32 softmax output and its bf16 copy), and what the layer in its backward holds at once (the
# kept float32 softmax output, the float32 gradient reaching it and the one it returns: its own kept bytes included)
LOCAL_ATTENTION_KEPT_BYTES = 6
LOCAL_ATTENTION_BACKWARD_BYTES = 12
# the boolean (s, s) mask megatron's local attention is given per sequence and keeps for its masked fill
# (vcpo.verl_plugin.engine.layer_spec.square_attention_mask), per layer that keeps its scores
LOCAL_ATTENTION_MASK_BYTES = 1
# megatron's global memory buffer that its local attention's first matmul reads (bf16, one layer's scores, kept for the
# process's life)
LOCAL_ATTENTION_BUFFER_BYTES = 2
# PyTorch's CPU SDPA given a (T, T) mask (HF's sdpa with packed sequences, as verl runs on CPU) keeps one T² float32
# tensor per layer for its backward, whatever the heads (benchmarks/masked_attention_memory.py)
MASKED_ATTENTION_KEPT_BYTES = 4
# how attention is computed: fused kernels keep no score matrix (flash, SDPA without a mask, Transformer Engine);
# megatron's local attention keeps one per layer, or (selective recompute of core_attn) recomputes it in the backward,
# one layer at a time; masked SDPA on CPU keeps a mask-sized tensor per layer
ATTENTION_KINDS = ("fused", "local", "local_recomputed", "masked")
# per GPU process, outside the caching allocator: the CUDA context with its kernels, cuBLAS's workspaces and NCCL's
# communicator buffers, 1-3 GB by GPU, driver and NCCL settings; the larger bound is taken
CUDA_OVERHEAD_BYTES = 3e9
# the caching allocator's reserved memory above its allocated peak (fragmentation), a stated margin on the allocated
# peak: expandable segments, which verl's hybrid trainer turns on for training, keep it below this; the GPU check's
# max_memory_reserved beside max_memory_allocated measures it
FRAGMENTATION_MARGIN = 0.10
# verl's nccl weight sync allocates a send and a receive bucket through cupy on trainer rank 0, whose memory pool keeps
# them after the sync (never returned to the device)
WEIGHT_SYNC_BUFFERS = 2
# a colocated vLLM rollout asleep (free_cache_engine: sleep level 2 discards its weights and KV cache) keeps what its
# sleep allocator does not manage: its own CUDA context, NCCL and CUDA graphs; vLLM's sleep mode docs say sleep frees
# "up to 90%+" of its memory, so the other 10% of its budget is counted, or its CUDA overhead if larger
ROLLOUT_ASLEEP_FRACTION = 0.10


def hf_attention(device_type: str, attn_implementation: str | None, packed: bool) -> str:
    """The ``ATTENTION_KINDS`` entry of an HF model's attention: ``sdpa`` on CPU over packed sequences (one row, a (T, T)
    mask) is masked; flash attention's varlen kernels, and SDPA on a GPU, keep no (T, T) tensor (fused)."""
    return "masked" if device_type == "cpu" and attn_implementation == "sdpa" and packed else "fused"


def verl_log_probs(flash_cross_entropy: bool, environ) -> str:
    """The `LOGIT_COPIES` path verl's FSDP engine takes for its log-probabilities: flash-attn's fused cross-entropy where
    it imports and ``environ`` does not set `DISABLE_FLASH_CROSS_ENTROPY`, else the row-by-row log-softmax."""
    return "fused" if flash_cross_entropy and environ.get(DISABLE_FLASH_CROSS_ENTROPY, "0") != "1" else "log_softmax"


@dataclass(frozen=True)
class ModelShape:
    """A Qwen2 / Llama-style decoder: what its memory depends on."""

    hidden: int
    intermediate: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    tied: bool
    parameter_count: int | None = None  # the real count, where known; else from the shape
    experts: int = 0  # routed experts of a mixture-of-experts model (0: dense)

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """From a transformers config (object or dict)."""
        get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
        heads = get("num_attention_heads")
        return cls(hidden=get("hidden_size"), intermediate=get("intermediate_size"), layers=get("num_hidden_layers"),
                   vocab=get("vocab_size"), heads=heads, kv_heads=get("num_key_value_heads") or heads,
                   tied=bool(get("tie_word_embeddings", False)),
                   experts=int(get("num_experts", None) or get("num_local_experts", None) or get("n_routed_experts", None) or 0))

    @property
    def head_width(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_width(self) -> int:
        return self.head_width * self.kv_heads

    @property
    def layer_parameters(self) -> int:
        h, kv = self.hidden, self.kv_width
        attention = h * h + h + 2 * (h * kv + kv) + h * h  # q (with bias), k, v (with biases), o
        return attention + 3 * h * self.intermediate + 2 * h

    @property
    def embedding_parameters(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def parameters(self) -> int:
        if self.parameter_count is not None:
            return self.parameter_count
        return self.embedding_parameters + self.layers * self.layer_parameters + self.hidden


@dataclass(frozen=True)
class Layout:
    """How the actor is laid out on its trainer GPUs, its precision, and what shares those GPUs.

    FSDP2 (verl's default): parameters, gradients and Adam's two moments in ``param_bytes`` (fp32), sharded over
    ``data_parallel`` ranks; compute copies in ``compute_bytes`` (bf16) unsharded one FSDP unit at a time.
    Megatron: ``compute_bytes`` parameters, fp32 main gradients and (distributed optimizer: sharded over data
    parallel) fp32 main parameters and moments, each split over tensor x pipeline parallel ranks.

    Offload: ``fsdp_offload_policy`` (FSDP2's CPUOffloadPolicy, verl's ``fsdp_config.offload_policy``) keeps the
    sharded parameters, their gradients and the optimizer on the CPU, the step included; ``optimizer_cpu_fraction``
    (megatron's ``optimizer_cpu_offload`` with ``optimizer_offload_fraction``) moves that fraction of the main
    parameters, the moments and their step to the CPU; ``offloaded_between_steps`` (verl's ``param_offload``,
    ``optimizer_offload``: "parameters", "optimizer") leaves the GPU between steps only, as verl loads them back
    for the step.
    """

    strategy: str = "fsdp2"
    data_parallel: int = 1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    param_bytes: int = 4
    compute_bytes: int = 2
    gradient_checkpointing: bool = True
    distributed_optimizer: bool = True
    sequence_parallel: bool = True  # Megatron with TP > 1: the norms' tokens split over the ranks (`megatron_layer_bytes`)
    attention: str = "fused"  # ATTENTION_KINDS
    log_probs: str = "log_softmax"  # LOGIT_COPIES, the FSDP engine's path (megatron's is vocab-parallel)
    device: str = "cuda"  # "cpu": no CUDA context, no fragmentation margin
    fsdp_offload_policy: bool = False
    optimizer_cpu_fraction: float = 0.0
    offloaded_between_steps: frozenset = frozenset()
    weight_sync_bucket_bytes: int = 0  # verl's nccl weight sync bucket, held twice on trainer rank 0 (0: no nccl sync)
    rollout_budget_bytes: float = 0.0  # lag 0: a vLLM rollout on the same GPU, gpu_memory_utilization x its memory
    rollout_frees_cache: bool = True  # free_cache_engine: the rollout sleeps while the actor trains

    def __post_init__(self):
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"Layout.attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")
        if self.log_probs not in LOGIT_COPIES:
            raise ValueError(f"Layout.log_probs must be one of {tuple(LOGIT_COPIES)}, got {self.log_probs!r}")

    @property
    def model_parallel(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel


@dataclass(frozen=True)
class StepShape:
    """One optimizer step on one rank: its tokens per micro-batch and its OPOB buffers.

    ``buffers``: float32 full-model buffers the single mode keeps until `combine` (split: a success and a
    failure buffer per group present on the rank: at most 2 x groups per rank; the `buffers` combination: one
    per group); ``combination``: the FSDP engine's `PerSequenceGradients` combination, "split" (the engine's: G_R is
    the first buffer `combine` reaches, scaled in place) or "buffers" (G_R opened beside them in the backward, a
    float32 copy of the model); ``block_bytes``: one block of per-sequence gradients (the norms' scratch; None: the
    engine's default on the layout's device)."""

    tokens_per_micro_batch: int
    buffers: int
    block_bytes: int | None = None
    # buffers already open when the last micro-batch's backward starts (its activations at their largest); at most
    # ``buffers``, which is what a step whose first micro-batches touch every group has
    buffers_before_last: int | None = None
    sequence_length: int | None = None  # the longest sequence (Megatron's ghost norms: a T x T Gram matrix per sequence)
    combination: str = "split"
    # Megatron: the most groups one micro-batch holds (its combinations are formed per micro-batch); None: ``buffers``,
    # the larger
    groups_per_micro_batch: int | None = None

    def __post_init__(self):
        if self.combination not in ("split", "buffers"):
            raise ValueError(f"StepShape.combination must be split or buffers, got {self.combination!r}")

    @property
    def combinations_per_micro_batch(self) -> int:
        return self.buffers if self.groups_per_micro_batch is None else min(self.buffers, self.groups_per_micro_batch)

    @property
    def buffers_with_activations(self) -> int:
        return self.buffers if self.buffers_before_last is None else self.buffers_before_last


@dataclass
class StepMemory:
    """Named bytes per GPU: what stays through the step, what each kind of step adds at its peak (the terms of its
    widest phase), what lives outside the caching allocator meanwhile, and (lag 0) what the GPU holds while the
    colocated rollout generates."""

    persistent: dict[str, float]
    plain: dict[str, float]
    single: dict[str, float] = field(default_factory=dict)
    two_pass: dict[str, float] = field(default_factory=dict)
    outside_allocator: dict[str, float] = field(default_factory=dict)
    between_steps: dict[str, float] = field(default_factory=dict)
    fragmentation: float = 0.0  # the allocator's margin, a fraction of its allocated peak

    def peak(self, kind: str) -> float:
        """Bytes per GPU at the peak of a ``kind`` step ("plain" or an OPOB mode): the allocated peak raised by the
        fragmentation margin, with what lives outside the allocator; or, where larger, the GPU between steps."""
        during = self.allocated(kind) * (1 + self.fragmentation) + sum(self.outside_allocator.values())
        return max(during, sum(self.between_steps.values()))

    def allocated(self, kind: str) -> float:
        """What the caching allocator holds at the peak of a ``kind`` step: the persistent state and the step's."""
        return sum(self.persistent.values()) + self.step(kind)

    def step(self, kind: str) -> float:
        """What a ``kind`` step adds to the persistent state at its peak."""
        return sum(getattr(self, kind).values())


def widest(*phases: dict[str, float]) -> dict[str, float]:
    """The phase (named bytes alive at once) with the most bytes: phases that never coexist add up to their widest."""
    return max(phases, key=lambda phase: sum(phase.values()))


def megatron_recompute(transformer_impl: str | None, recompute_granularity: str | None,
                       recompute_modules=None) -> tuple[bool, str]:
    """(gradient checkpointing, `Layout.attention`) of a megatron TransformerConfig's settings: full recompute keeps
    only each layer's input; the local spec's attention is unfused, and selective recompute of core_attn (megatron's
    default module list) recomputes it in the backward."""
    local = transformer_impl == "local"
    modules = ("core_attn",) if recompute_modules is None else recompute_modules
    recomputed = recompute_granularity == "selective" and "core_attn" in modules
    return recompute_granularity == "full", ("local_recomputed" if recomputed else "local") if local else "fused"


def hf_layer_bytes(shape: ModelShape, layout: Layout) -> float:
    """Bytes one HF decoder layer keeps per token for its backward: `ACTIVATION_WIDTHS` values of the compute dtype."""
    widths = ACTIVATION_WIDTHS
    return (widths["hidden"] * shape.hidden + widths["intermediate"] * shape.intermediate
            + widths["kv"] * shape.kv_width) * layout.compute_bytes


def megatron_layer_bytes(shape: ModelShape, layout: Layout) -> float:
    """Bytes one megatron layer (the local spec, as mbridge configures Qwen2: unfused SwiGLU, unfused rotary embedding)
    keeps per token on a rank, counted from the tensors autograd saves (megatron-core 0.16.1), c the compute bytes:

      norms      2 x (8h + 4 + c h): each torch RMSNorm's float32 input copy and normalised values and its reciprocal
                 root (`RMS_NORM_KEPT_BYTES`), and its output, the next linear's input; split over TP only under
                 sequence parallelism, which splits the tokens
      rotary     4 c d (d the head width): cos and sin for the queries and for the keys, never split
      attention  c (3h + 3kv) / TP where core attention is recomputed or fused: its inputs (the rotated q and k, and the
                 fused qkv output that v is a view of) and its output; kept unfused (local), c 4h / TP with grouped
                 queries (q, k and v repeated to every head, the output) or c 6h / TP without (q, k, the fused qkv
                 output, the output)
      MLP        c 5I / TP: fc1's output (2I), SiLU's output, the linear half plus megatron's glu_linear_offset
                 (a new tensor), and their product, fc2's input

    Transformer Engine's layers (fused norm, linear and activation) keep less: this is their upper bound. Score
    matrices are apart (`layer_backward`)."""
    h, kv, c, tp = shape.hidden, shape.kv_width, layout.compute_bytes, layout.tensor_parallel
    norms = 2 * (RMS_NORM_KEPT_BYTES * h + RMS_NORM_KEPT_BYTES_PER_TOKEN + c * h)
    rotary = 4 * shape.head_width * c
    if layout.attention == "local":
        attention = 4 * h if shape.kv_heads < shape.heads else 6 * h
    else:
        attention = 3 * h + 3 * kv
    mlp = 5 * shape.intermediate
    return norms / (tp if layout.sequence_parallel else 1) + rotary + (attention + mlp) * c / tp


def layer_bytes(shape: ModelShape, layout: Layout) -> float:
    """Bytes one decoder layer keeps per token on a rank, by the engine's modules."""
    return megatron_layer_bytes(shape, layout) if layout.strategy == "megatron" else hf_layer_bytes(shape, layout)


def logits_bytes(shape: ModelShape, layout: Layout, tokens: int) -> float:
    """The logits around the log-probabilities at the backward's start, per rank: on megatron the compute-dtype
    logits and their float32 copy (`VOCAB_PARALLEL_FLOAT32_BYTES`) over the vocabulary's TP shard; on the FSDP engine
    `LOGIT_COPIES` of its path in the compute dtype."""
    if layout.strategy == "megatron":
        return tokens * shape.vocab / layout.tensor_parallel * (layout.compute_bytes + VOCAB_PARALLEL_FLOAT32_BYTES)
    return LOGIT_COPIES[layout.log_probs] * tokens * shape.vocab * layout.compute_bytes


def activation_phases(shape: ModelShape, layout: Layout, tokens: int, sequence_length: int | None = None,
                      kept_beside: dict[str, float] | None = None) -> dict[str, dict[str, float]]:
    """What one micro-batch of ``tokens`` (sequences of ``sequence_length``, padded) holds per rank in the backward's
    two phases, which never coexist: its start (what the layers keep, and the logits) and one layer's backward
    (what the layers keep, and that layer's working set: under recomputation the layer recomputed, `layer_backward`),
    which begins after the output layer's backward has freed the logits. Tensor parallelism splits the layers' widths,
    pipeline parallelism the layers; ``kept_beside``: more that the forward keeps until the backward (the norm
    hooks')."""
    layers = math.ceil(shape.layers / layout.pipeline_parallel)
    per_token_layer = layer_bytes(shape, layout)
    if layout.gradient_checkpointing:  # each layer's input, and one layer recomputed in full
        split = layout.tensor_parallel if layout.strategy == "megatron" and layout.sequence_parallel else 1
        kept = {"activations: layer inputs": tokens * shape.hidden * layout.compute_bytes * layers / split}
    else:
        kept = {"activations": tokens * per_token_layer * layers}
    kept.update(kept_scores(shape, layout, tokens, sequence_length, layers))
    kept.update(kept_beside or {})
    return {"backward's start": {**kept, "logits": logits_bytes(shape, layout, tokens)},
            "one layer's backward": {**kept, **layer_backward(shape, layout, tokens, sequence_length)}}


def activation_bytes(shape: ModelShape, layout: Layout, tokens: int, sequence_length: int | None = None,
                     kept_beside: dict[str, float] | None = None) -> dict[str, float]:
    """The named bytes of the micro-batch's widest backward phase (`activation_phases`)."""
    return widest(*activation_phases(shape, layout, tokens, sequence_length, kept_beside).values())


def score_entries(shape: ModelShape, layout: Layout, tokens: int, sequence_length: int | None) -> tuple[float, float]:
    """(entries of one layer's local-attention score matrices on a rank, (T, T) entries of one layer over the
    micro-batch's sequences): heads / TP matrices of s x s per sequence, one (s, s) mask per sequence."""
    length = sequence_length or tokens
    squares = max(1, tokens // length) * length**2
    return squares * shape.heads / layout.tensor_parallel, squares


def kept_scores(shape: ModelShape, layout: Layout, tokens: int, sequence_length: int | None, layers: int) -> dict[str, float]:
    """What attention keeps in every layer from the forward to its backward: megatron's local attention, not
    recomputed, its scores (`LOCAL_ATTENTION_KEPT_BYTES`) and mask; masked SDPA on CPU, a T² float32 per layer."""
    scores, squares = score_entries(shape, layout, tokens, sequence_length)
    if layout.gradient_checkpointing:
        return {}
    if layout.attention == "masked":
        return {"masked attention (a T² float32 per layer)": squares * MASKED_ATTENTION_KEPT_BYTES * layers}
    if layout.attention == "local":
        return {"local attention scores and masks, every layer": (scores * LOCAL_ATTENTION_KEPT_BYTES
                                                                  + squares * LOCAL_ATTENTION_MASK_BYTES) * layers}
    return {}


def layer_backward(shape: ModelShape, layout: Layout, tokens: int, sequence_length: int | None) -> dict[str, float]:
    """One layer's working set in its backward, beyond what the layers keep: the layer recomputed (gradient
    checkpointing), and unfused attention's softmax backward (`LOCAL_ATTENTION_BACKWARD_BYTES`, less what the layer
    keeps already) or, recomputed, its scores and mask anew; masked SDPA's mask, recomputed."""
    scores, squares = score_entries(shape, layout, tokens, sequence_length)
    terms = {"activations: one recomputed layer": tokens * layer_bytes(shape, layout)} if layout.gradient_checkpointing else {}
    if layout.attention == "masked" and layout.gradient_checkpointing:
        terms["masked attention (a T² float32, one layer)"] = squares * MASKED_ATTENTION_KEPT_BYTES
    elif layout.attention == "local" and not layout.gradient_checkpointing:
        terms["local attention's softmax backward (one layer)"] = scores * (LOCAL_ATTENTION_BACKWARD_BYTES - LOCAL_ATTENTION_KEPT_BYTES)
    elif layout.attention != "fused" and layout.attention != "masked":
        terms["local attention scores and mask (one layer, recomputed) in its softmax backward"] = (
            scores * LOCAL_ATTENTION_BACKWARD_BYTES + squares * LOCAL_ATTENTION_MASK_BYTES)
    return terms


def optimizer_temporaries(optimizer_parameters: float, param_bytes: int) -> dict[str, float]:
    """The optimizer step's working set beyond its state: torch's foreach AdamW forms the square root of every second
    moment at once, one copy of the ``optimizer_parameters`` it updates on this GPU (fused Adam kernels, Transformer
    Engine's or apex's, form none: the larger is taken)."""
    return {"optimizer step: foreach AdamW's square roots (a copy of the local shard)": optimizer_parameters * param_bytes}


def outside_allocator(layout: Layout) -> dict[str, float]:
    """GPU memory beside the actor step that PyTorch's caching allocator does not hold: `CUDA_OVERHEAD_BYTES`, the
    weight sync's cupy buckets on trainer rank 0 (`WEIGHT_SYNC_BUFFERS`, the peak rank), and a colocated rollout
    asleep (`rollout_asleep_bytes`); nothing on CPU."""
    if layout.device == "cpu":
        return {}
    terms = {"CUDA context, cuBLAS workspaces and NCCL buffers (bound)": CUDA_OVERHEAD_BYTES}
    if layout.weight_sync_bucket_bytes:
        terms["weight-sync send and receive buckets (cupy, trainer rank 0)"] = WEIGHT_SYNC_BUFFERS * layout.weight_sync_bucket_bytes
    if layout.rollout_budget_bytes:
        terms["colocated rollout, asleep" if layout.rollout_frees_cache else "colocated rollout, awake"] = rollout_asleep_bytes(layout)
    return terms


def rollout_asleep_bytes(layout: Layout) -> float:
    """What a colocated vLLM rollout keeps during the actor step: asleep (``rollout_frees_cache``), the larger of
    `ROLLOUT_ASLEEP_FRACTION` of its budget and a process's CUDA overhead; awake, its whole budget."""
    if not layout.rollout_frees_cache:
        return layout.rollout_budget_bytes
    return max(ROLLOUT_ASLEEP_FRACTION * layout.rollout_budget_bytes, CUDA_OVERHEAD_BYTES)


def between_steps(layout: Layout, state: dict[str, tuple[str, float]]) -> dict[str, float]:
    """At lag 0, while the colocated rollout generates: the actor's ``state`` (name: (what verl offloads it as, bytes))
    that stays on the GPU, the actor's CUDA overhead and the rollout's whole budget (verl empties the actor's cache
    before the rollout wakes: no fragmentation margin). Nothing without a colocated rollout."""
    if not layout.rollout_budget_bytes:
        return {}
    kept = {name: size for name, (kind, size) in state.items() if size and kind not in layout.offloaded_between_steps}
    return {**kept, "CUDA context, cuBLAS workspaces and NCCL buffers (bound)": CUDA_OVERHEAD_BYTES,
            "colocated rollout, awake (its gpu_memory_utilization)": layout.rollout_budget_bytes}


def step_memory(shape: ModelShape, layout: Layout, step: StepShape) -> StepMemory:
    """The plain step and both OPOB modes on ``layout`` (module doc)."""
    if layout.strategy == "megatron":
        return _megatron_memory(shape, layout, step)
    P, N = shape.parameters, layout.data_parallel
    full = P * layout.param_bytes
    unit = max(shape.layer_parameters, shape.embedding_parameters) * layout.compute_bytes  # largest FSDP unit
    on_gpu = 0 if layout.fsdp_offload_policy else 1  # CPUOffloadPolicy: the shards, their gradients and Adam on the CPU
    state = {"parameters (sharded)": ("parameters", on_gpu * full / N), "Adam moments (sharded)": ("optimizer", on_gpu * 2 * full / N)}
    persistent = {name: size for name, (_, size) in state.items() if size}
    gradients = {"gradients (sharded)": full / N} if on_gpu else {}
    optimizer = {**gradients, **(optimizer_temporaries(P / N, layout.param_bytes) if on_gpu else {})}
    phases = activation_phases(shape, layout, step.tokens_per_micro_batch, step.sequence_length)
    # FSDP2 all-gathers into storage of its own (one rank too): two units unsharded at a time in a plain step
    plain = widest(*({**gradients, "unsharded units (two at a time)": 2 * unit, **phase} for phase in phases.values()), optimizer)
    single = widest(*fsdp2_single_phases(shape, layout, step, phases).values(), optimizer)
    backward = sum(widest(*phases.values()).values())
    two_pass = dict(plain)
    norms_pass = backward + norms_scratch(shape, layout, step)  # no gradient exists yet in pass 1
    two_pass["pass 1 beyond pass 2 (norms scratch)"] = max(0.0, norms_pass - sum(plain.values()))
    return StepMemory(persistent, plain, single, two_pass, outside_allocator(layout), between_steps(layout, state),
                      0.0 if layout.device == "cpu" else FRAGMENTATION_MARGIN)


def fsdp2_single_phases(shape: ModelShape, layout: Layout, step: StepShape,
                        phases: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The FSDP2 single step's phases (``phases``: the micro-batch's `activation_phases`), which never coexist. The
    model is held unsharded (compute dtype) from the first forward to the shards of the combined gradient, with G_R
    where the combination opens it in the backward (``buffers``; split's G_R is its first buffer, scaled in place).

      last backward  the buffers opened before the last micro-batch (``buffers_before_last``) beside its activations;
                     its new buffers open as its backward reaches each parameter while the layers above free theirs:
                     at its start the output layer's (vocabulary x hidden, tied or not), at the top layer's backward
                     that layer's too, at its end every parameter's beside one layer's activations (what is alive is
                     linear in the layers reached, so its largest is at one of these ends)
      combine        every buffer, and (compute dtype below float32) the combined gradient written in that dtype, one
                     parameter at a time while the buffers are alive (float32: the first buffer becomes p.grad)
      all-reduce     (more than one rank) after the buffers are freed: the gradient, a float32 copy of each
                     (`widened`, below float32) and the flat float32 buffer they are concatenated into
    """
    P, c = shape.parameters, layout.compute_bytes
    held = {"whole model unsharded": P * c}
    if step.combination == "buffers":
        held["G_R (float32)"] = P * 4
    opened = step.buffers_with_activations
    new = step.buffers - opened
    head, layer_params = shape.vocab * shape.hidden, shape.layer_parameters
    before = {**held, "group buffers opened before the last micro-batch (float32)": opened * P * 4}
    start, top = phases["backward's start"], phases["one layer's backward"]
    last = widest({**start, "its new group buffers: the output layer's (float32)": new * head * 4},
                  {**top, "its new group buffers: the output layer's and the top layer's (float32)": new * (head + layer_params) * 4},
                  {"its new group buffers: every parameter's (float32)": new * P * 4,
                   "activations: one layer": step.tokens_per_micro_batch * layer_bytes(shape, layout)})
    result = {"last micro-batch's backward": {**before, **last},
              "combine": {**held, "group buffers (float32)": step.buffers * P * 4,
                          "combined gradient (compute dtype)": P * c if c < 4 else 0}}
    if layout.data_parallel > 1:
        result["all-reduce"] = {"whole model unsharded": P * c, "combined gradient (compute dtype)": P * c,
                                "flat float32 all-reduce copy, and the float32 copies it is made of": P * 4 * (2 if c < 4 else 1)}
    return result


def norms_scratch(shape: ModelShape, layout: Layout, step: StepShape) -> float:
    """The norms-only backward's working set beyond a plain backward: one block of per-sequence gradients, and
    the float32 (sequences, length, hidden) copies the embedding and norm handlers lay a micro-batch out in."""
    block_bytes = step.block_bytes or device_default(DEFAULT_BLOCK_BYTES, layout.device)
    return 2 * block_bytes + 3 * step.tokens_per_micro_batch * shape.hidden * 4 / layout.tensor_parallel


def norm_hook_bytes(shape: ModelShape, layout: Layout, tokens: int) -> float:
    """The normalised inputs `MegatronSequenceNorms`' forward hooks keep until the backward, one per norm of every layer
    that runs with gradients (both norms of each of the stage's layers, or under full recompute the one recomputed)
    and the final norm, in the compute dtype; under sequence parallelism each rank's tokens."""
    layers = 1 if layout.gradient_checkpointing else math.ceil(shape.layers / layout.pipeline_parallel)
    split = layout.tensor_parallel if layout.sequence_parallel else 1
    return (2 * layers + 1) * tokens * shape.hidden * layout.compute_bytes / split


def _megatron_memory(shape: ModelShape, layout: Layout, step: StepShape) -> StepMemory:
    """Megatron: each rank holds its TP x PP slice; `MegatronSequenceNorms` forms ghost norms in float32 (the
    layer's input and output gradient widened from bf16, and two Gram matrices per sequence) and keeps each norm's
    normalised input (`norm_hook_bytes`), and the single mode's (1 + g) combinations of every local parameter (G_R and
    one buffer per local group) plus, per linear, a float64 (1 + g, out, in) stack of the micro-batch's combinations."""
    local = shape.parameters / layout.model_parallel
    optimizer_shards = layout.data_parallel if layout.distributed_optimizer else 1
    on_gpu = 1 - layout.optimizer_cpu_fraction  # HybridDeviceOptimizer: that fraction's main parameters, moments and step on the CPU
    state = {"parameters (bf16)": ("parameters", local * layout.compute_bytes),
             "main gradients (float32)": ("parameters", local * 4),
             "main parameters and Adam moments (float32)": ("optimizer", 3 * local * 4 / optimizer_shards * on_gpu)}
    tokens, length = step.tokens_per_micro_batch, step.sequence_length or step.tokens_per_micro_batch
    persistent = {name: size for name, (_, size) in state.items() if size}
    if layout.attention in ("local", "local_recomputed"):
        persistent["megatron's attention score buffer (bf16, one layer)"] = (
            score_entries(shape, layout, tokens, length)[0] * LOCAL_ATTENTION_BUFFER_BYTES)
    optimizer = optimizer_temporaries(local / optimizer_shards * on_gpu, 4)
    plain = widest(*activation_phases(shape, layout, tokens, length).values(), optimizer)
    hooks = {"norm hooks' normalised inputs (every norm)": norm_hook_bytes(shape, layout, tokens)}
    activations = activation_bytes(shape, layout, tokens, length, hooks)
    widest_layer = max(shape.vocab, shape.intermediate) / layout.tensor_parallel
    norms = {"float32 ghost-norm inputs (widest layer) and Gram matrices": tokens * (widest_layer + shape.hidden) * 4
             + 2 * tokens * length * 4}
    buffers = {"G_R and group buffers (float32)": (1 + step.buffers) * local * 4}
    single = widest(*megatron_single_phases(shape, layout, step, hooks, norms, buffers).values(), optimizer)
    two_pass = widest({**activations, **norms}, plain)  # the norms pass, then megatron's plain step
    return StepMemory(persistent, plain, single, two_pass, outside_allocator(layout), between_steps(layout, state),
                      0.0 if layout.device == "cpu" else FRAGMENTATION_MARGIN)


def megatron_single_phases(shape: ModelShape, layout: Layout, step: StepShape, hooks: dict[str, float],
                           norms: dict[str, float], buffers: dict[str, float]) -> dict[str, dict[str, float]]:
    """The Megatron single step's phases beside G_R and the group buffers (``buffers``, open from the first micro-batch's
    backward to the step's end): `MegatronSequenceNorms` forms each linear's k = 1 + g combinations of the micro-batch
    (g: its groups, `StepShape.groups_per_micro_batch`) as k float32 (out, in) products and their stack, and the
    embedding's as a float64 (k, vocabulary / TP, hidden) scatter and its float32 copy:

      backward's start   the layers' kept activations, the hooks' inputs and the logits, the ghost norms' float32
                         inputs, and the output layer's combinations (2 k V h / TP float32)
      a layer's backward the layers' kept activations (one recomputed layer's working set) and the ghost norms, and
                         the layer's widest linear's combinations (fc1's 2I x h / TP: 2 k of them, float32)
      the embedding's    last in the backward, every layer's activations freed: its float64 scatter and float32 copy
                         (k V h / TP x 12)

    The wide dtype is float32 for bf16 parameters (`wide_dtype`)."""
    tokens, length = step.tokens_per_micro_batch, step.sequence_length or step.tokens_per_micro_batch
    k = 1 + step.combinations_per_micro_batch
    tp, h = layout.tensor_parallel, shape.hidden
    phases = activation_phases(shape, layout, tokens, length, hooks)
    widest_linear = max(2 * shape.intermediate, h + 2 * shape.kv_width) * h / tp
    return {"backward's start": {**buffers, **phases["backward's start"], **norms,
                                 "output layer's k float32 combinations and their stack": 2 * k * shape.vocab * h / tp * 4},
            "one layer's backward": {**buffers, **phases["one layer's backward"], **norms,
                                     "widest linear's k float32 combinations and their stack": 2 * k * widest_linear * 4},
            "embedding's backward": {**buffers, "embedding's k combinations (float64 scatter, float32 copy)": k * shape.vocab * h / tp * 12}}


def split_buffers(rewards, groups) -> int:
    """Float32 buffers the split combination opens for these sequences: per group, a success buffer when one of
    its rewards is not 0 and a failure buffer when one is not 1 (c^S − c^R = c^S (1 − R))."""
    successes = {int(g) for g, r in zip(groups.tolist(), rewards.tolist(), strict=True) if r != 0}
    failures = {int(g) for g, r in zip(groups.tolist(), rewards.tolist(), strict=True) if r != 1}
    return len(successes) + len(failures)


def choose_mode(memory: StepMemory, requested: str = "auto", capacity: float | None = None,
                allowance: float = SINGLE_MODE_ALLOWANCE) -> tuple[str, str]:
    """The OPOB mode a step runs in, and why: ``requested`` unless "auto", which takes single when its peak is at
    most ``allowance`` x the plain step's and within ``capacity`` bytes (when known), else two_pass."""
    if requested not in ("auto", *OPOB_MODES):
        raise ValueError(f"opob_mode must be auto or one of {OPOB_MODES}, got {requested!r}")
    if requested != "auto":
        return requested, "requested"
    single, plain = memory.peak("single"), memory.peak("plain")
    if single > allowance * plain:
        return "two_pass", f"single's projected peak {single / GB:.1f} GB is {single / plain:.2f}x the plain step's (> {allowance})"
    if capacity is not None and single > capacity:
        return "two_pass", f"single's projected peak {single / GB:.1f} GB exceeds the {capacity / GB:.1f} GB of the GPU"
    return "single", f"single's projected peak {single / GB:.1f} GB is {single / plain:.2f}x the plain step's (<= {allowance})"
