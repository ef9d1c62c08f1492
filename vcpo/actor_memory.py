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
memory goes. The activation terms count the tensors a Qwen2/Llama decoder layer keeps for its backward per
token (``ACTIVATION_WIDTHS``) and the (tokens, vocabulary) float32 tensors around the log-softmax
(``LOGIT_COPIES``); no allocator slack is added. `benchmarks/opob_memory.py` measures the step's peak on CPU and
prints it beside these terms (tables/opob_memory/).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from vcpo.core.per_sequence_grads.reductions import DEFAULT_BLOCK_BYTES

GB = 1e9
OPOB_MODES = ("single", "two_pass")
# auto picks single only when its peak is at most this times the plain step's (and fits the GPU)
SINGLE_MODE_ALLOWANCE = 1.25
# values kept per token per decoder layer for its backward, in units of the hidden width h, the MLP width I and
# the key/value width kv: the two RMSNorms (input, float32 copy, normalised input: 3h each, less what autograd
# shares), q/k/v and the rotary embedding (q, rotated q and k, v: 2h + 3kv), the attention output and o_proj's
# input and output (3h), the MLP's gate, up, activation and product (4I) and down's output (h). Counted against the
# tensors autograd saves for HF's Qwen2 (saved_tensors_hooks, 896 tokens): 6,457 and 12,047 values per token and
# layer for the benchmark's two models, which this gives as 6,528 and 12,672.
ACTIVATION_WIDTHS = {"hidden": 12, "intermediate": 4, "kv": 3}
# (tokens, vocabulary) float32 tensors alive at once when the backward starts: the log-softmax's saved output and
# the gradient that reaches the logits
LOGIT_COPIES = 2
# of those widths, what Megatron's sequence parallelism splits over the tensor-parallel ranks and tensor parallelism
# alone keeps whole on every rank: the two norms' inputs and the column-parallel linears' inputs (4h)
SEQUENCE_PARALLEL_WIDTH = 4
# megatron's unfused (local) attention per score of its (heads / TP, s, s) matrix per sequence: what a layer keeps for
# its backward (the float32 softmax output and its bf16 copy), and what its backward adds (the float32 score gradient)
LOCAL_ATTENTION_KEPT_BYTES = 6
LOCAL_ATTENTION_BACKWARD_BYTES = 4
# PyTorch's CPU SDPA given a (T, T) mask (HF's sdpa with packed sequences, as verl runs on CPU) keeps one T² float32
# tensor per layer for its backward, whatever the heads (benchmarks/masked_attention_memory.py)
MASKED_ATTENTION_KEPT_BYTES = 4
# how attention is computed: fused kernels keep no score matrix (flash, SDPA without a mask, Transformer Engine);
# megatron's local attention keeps one per layer, or (selective recompute of core_attn) recomputes it in the backward,
# one layer at a time; masked SDPA on CPU keeps a mask-sized tensor per layer
ATTENTION_KINDS = ("fused", "local", "local_recomputed", "masked")


def hf_attention(device_type: str, attn_implementation: str | None, packed: bool) -> str:
    """The ``ATTENTION_KINDS`` entry of an HF model's attention: ``sdpa`` on CPU over packed sequences (one row, a (T, T)
    mask) is masked; flash attention's varlen kernels, and SDPA on a GPU, keep no (T, T) tensor (fused)."""
    return "masked" if device_type == "cpu" and attn_implementation == "sdpa" and packed else "fused"


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
    def kv_width(self) -> int:
        return self.hidden // self.heads * self.kv_heads

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
    """How the actor is laid out on its trainer GPUs, and its precision.

    FSDP2 (verl's default): parameters, gradients and Adam's two moments in ``param_bytes`` (fp32), sharded over
    ``data_parallel`` ranks; compute copies in ``compute_bytes`` (bf16) unsharded one FSDP unit at a time.
    Megatron: ``compute_bytes`` parameters, fp32 main gradients and (distributed optimizer: sharded over data
    parallel) fp32 main parameters and moments, each split over tensor x pipeline parallel ranks.
    """

    strategy: str = "fsdp2"
    data_parallel: int = 1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    param_bytes: int = 4
    compute_bytes: int = 2
    gradient_checkpointing: bool = True
    distributed_optimizer: bool = True
    sequence_parallel: bool = True  # Megatron with TP > 1: splits SEQUENCE_PARALLEL_WIDTH of the activations over the ranks
    attention: str = "fused"  # ATTENTION_KINDS

    def __post_init__(self):
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"Layout.attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")

    @property
    def model_parallel(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel


@dataclass(frozen=True)
class StepShape:
    """One optimizer step on one rank: its tokens per micro-batch and its OPOB buffers.

    ``buffers``: float32 full-model buffers the single mode keeps until `combine` (split: a success and a
    failure buffer per group present on the rank: at most 2 x groups per rank; the `buffers` combination: one
    per group); ``block_bytes``: one block of per-sequence gradients (the norms' scratch)."""

    tokens_per_micro_batch: int
    buffers: int
    block_bytes: int = DEFAULT_BLOCK_BYTES["cuda"]
    # buffers already open when the last micro-batch's backward starts (its activations at their largest); at most
    # ``buffers``, which is what a step whose first micro-batches touch every group has
    buffers_before_last: int | None = None
    sequence_length: int | None = None  # the longest sequence (Megatron's ghost norms: a T x T Gram matrix per sequence)

    @property
    def buffers_with_activations(self) -> int:
        return self.buffers if self.buffers_before_last is None else self.buffers_before_last


@dataclass
class StepMemory:
    """Named bytes per GPU: what stays between steps, and what each kind of step adds at its peak."""

    persistent: dict[str, float]
    plain: dict[str, float]
    single: dict[str, float] = field(default_factory=dict)
    two_pass: dict[str, float] = field(default_factory=dict)

    def peak(self, kind: str) -> float:
        """Bytes per GPU at the peak of a ``kind`` step ("plain" or an OPOB mode)."""
        return sum(self.persistent.values()) + self.step(kind)

    def step(self, kind: str) -> float:
        """What a ``kind`` step adds to the persistent state at its peak."""
        return sum(getattr(self, kind).values())


def megatron_recompute(transformer_impl: str | None, recompute_granularity: str | None,
                       recompute_modules=None) -> tuple[bool, str]:
    """(gradient checkpointing, `Layout.attention`) of a megatron TransformerConfig's settings: full recompute keeps
    only each layer's input; the local spec's attention is unfused, and selective recompute of core_attn (megatron's
    default module list) recomputes it in the backward."""
    local = transformer_impl == "local"
    modules = ("core_attn",) if recompute_modules is None else recompute_modules
    recomputed = recompute_granularity == "selective" and "core_attn" in modules
    return recompute_granularity == "full", ("local_recomputed" if recomputed else "local") if local else "fused"


def activation_bytes(shape: ModelShape, layout: Layout, tokens: int, sequence_length: int | None = None) -> dict[str, float]:
    """What one micro-batch of ``tokens`` (sequences of ``sequence_length``, padded) keeps for its backward, per rank:
    tensor parallelism splits the layers' widths (sequence parallelism the rest, `SEQUENCE_PARALLEL_WIDTH`), pipeline
    parallelism the layers; the logits around its log-softmax; local attention's score matrices or masked SDPA's
    masks (``layout.attention``)."""
    whole = 0 if layout.sequence_parallel or layout.tensor_parallel == 1 else SEQUENCE_PARALLEL_WIDTH
    per_token_layer = ((ACTIVATION_WIDTHS["hidden"] - whole) * shape.hidden + ACTIVATION_WIDTHS["intermediate"] * shape.intermediate
                       + ACTIVATION_WIDTHS["kv"] * shape.kv_width) * layout.compute_bytes / layout.tensor_parallel
    per_token_layer += whole * shape.hidden * layout.compute_bytes
    layers = math.ceil(shape.layers / layout.pipeline_parallel)
    if layout.gradient_checkpointing:  # each layer's input, and one layer recomputed in full
        kept = {"activations: layer inputs": tokens * shape.hidden * layout.compute_bytes * layers,
                "activations: one recomputed layer": tokens * per_token_layer}
    else:
        kept = {"activations": tokens * per_token_layer * layers}
    length = sequence_length or tokens
    squares = max(1, tokens // length) * length**2  # (T, T) entries of one layer over the micro-batch's rows
    if layout.attention == "masked":
        kept["masked attention (a T² float32 per layer)"] = squares * MASKED_ATTENTION_KEPT_BYTES * (
            1 if layout.gradient_checkpointing else layers)
    elif layout.attention != "fused":
        scores = squares * shape.heads / layout.tensor_parallel  # per layer
        one_layer = layout.attention == "local_recomputed" or layout.gradient_checkpointing
        kept["local attention scores" + (" (one layer, recomputed)" if one_layer else "")] = scores * (
            LOCAL_ATTENTION_KEPT_BYTES * (1 if one_layer else layers) + LOCAL_ATTENTION_BACKWARD_BYTES)
    return {**kept, "logits": LOGIT_COPIES * tokens * shape.vocab * 4 / layout.tensor_parallel}


def step_memory(shape: ModelShape, layout: Layout, step: StepShape) -> StepMemory:
    """The plain step and both OPOB modes on ``layout`` (module doc)."""
    if layout.strategy == "megatron":
        return _megatron_memory(shape, layout, step)
    P, N = shape.parameters, layout.data_parallel
    full, compute = P * layout.param_bytes, P * layout.compute_bytes
    unit = max(shape.layer_parameters, shape.embedding_parameters) * layout.compute_bytes  # largest FSDP unit
    persistent = {"parameters (sharded)": full / N, "Adam moments (sharded)": 2 * full / N}
    activations = activation_bytes(shape, layout, step.tokens_per_micro_batch, step.sequence_length)
    # FSDP2 all-gathers into storage of its own (one rank too): two units unsharded at a time in a plain step
    plain = {"gradients (sharded)": full / N, "unsharded units (two at a time)": 2 * unit, **activations}
    # single: the model is held unsharded from the first forward to `combine`; the buffers open as the backward
    # reaches their groups, so the last micro-batch's activations meet the buffers opened before it, and `combine`
    # all of them (the first becomes p.grad in place), then (more than one rank) the flat float32 all-reduce copy
    # and each rank's shard of the result
    held = {"whole model unsharded": compute, "float32 G_R": P * 4 if layout.compute_bytes < 4 else 0}
    backward = sum(activations.values())
    during_backward = step.buffers_with_activations * P * 4 + backward
    at_combine = step.buffers * P * 4 + ((P * 4 + full / N) if N > 1 else 0)
    single = {**held, "group buffers (float32) with the activations, or at combine": max(during_backward, at_combine)}
    two_pass = dict(plain)
    norms_pass = backward + norms_scratch(shape, layout, step)  # no gradient exists yet in pass 1
    two_pass["pass 1 beyond pass 2 (norms scratch)"] = max(0.0, norms_pass - sum(plain.values()))
    return StepMemory(persistent, plain, single, two_pass)


def norms_scratch(shape: ModelShape, layout: Layout, step: StepShape) -> float:
    """The norms-only backward's working set beyond a plain backward: one block of per-sequence gradients, and
    the float32 (sequences, length, hidden) copies the embedding and norm handlers lay a micro-batch out in."""
    return 2 * step.block_bytes + 3 * step.tokens_per_micro_batch * shape.hidden * 4 / layout.tensor_parallel


def _megatron_memory(shape: ModelShape, layout: Layout, step: StepShape) -> StepMemory:
    """Megatron: each rank holds its TP x PP slice; `MegatronSequenceNorms` forms ghost norms in float32 (the
    layer's input and output gradient widened from bf16, and two Gram matrices per sequence), and the single mode's (1 + g)
    combinations of every local parameter (G_R and one buffer per local group) plus, per linear, a float64
    (1 + g, out, in) stack of the micro-batch's combinations."""
    local = shape.parameters / layout.model_parallel
    optimizer_shards = layout.data_parallel if layout.distributed_optimizer else 1
    persistent = {"parameters (bf16)": local * layout.compute_bytes,
                  "main gradients (float32)": local * 4,
                  "main parameters and Adam moments (float32)": 3 * local * 4 / optimizer_shards}
    activations = activation_bytes(shape, layout, step.tokens_per_micro_batch, step.sequence_length)
    tokens, length = step.tokens_per_micro_batch, step.sequence_length or step.tokens_per_micro_batch
    widest = max(shape.vocab, shape.intermediate) / layout.tensor_parallel
    norms = {"float32 ghost-norm inputs (widest layer) and Gram matrices": tokens * (widest + shape.hidden) * 4
             + 2 * tokens * length * 4}
    largest_linear = max(shape.vocab * shape.hidden, shape.hidden * shape.intermediate) / layout.tensor_parallel
    single = {**activations, **norms,
              "G_R and group buffers (float32)": (1 + step.buffers) * local * 4,
              "per-linear (1 + g, out, in) float64 stack": (1 + step.buffers) * largest_linear * 8}
    return StepMemory(persistent, dict(activations), single, {**activations, **norms})


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

