"""One rank of tests/test_megatron_per_sequence.py: a small megatron-core GPT split over tensor-parallel ranks
(and two pipeline stages for the ``_pp`` architecture) on gloo (CPU, float64); per-sequence squared norms and
the OPOB update from one backward (MegatronSequenceNorms) against one backward per sequence; for the ``_bf16``
architecture, the same on the weights rounded to bf16, beside the one-per-sequence loop in bf16 (autograd's own error). Run by
`python -m torch.distributed.run --nproc_per_node N THIS ARCH[,ARCH...] OUT`. The stages pass one micro-batch's hidden
states and their gradient point to point (megatron's pipeline schedule allocates on "cuda").

megatron-core assumes CUDA in four places this small model reaches; the process-wide shims below answer
them for the CPU (a device for buffer allocation, `Tensor.cuda` as identity, `synchronize` as a no-op, the
RNG tracker's fork as a no-op: dropout is off). Under sequence parallelism megatron's norms are Transformer
Engine's (GPU only); its torch fallback refuses the setting, so the worker builds torch's norm and marks its
parameters ``sequence_parallel`` as Transformer Engine's norms are marked.
"""

from __future__ import annotations

import contextlib
import json
import sys

import torch
import torch.distributed as dist

torch.cuda.current_device = lambda: torch.device("cpu")
torch.Tensor.cuda = lambda self, *args, **kwargs: self
torch.cuda.synchronize = lambda *args, **kwargs: None

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.tensor_parallel import random as megatron_random  # noqa: E402
from megatron.core.transformer import torch_norm  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from vcpo.core.per_sequence_grads.megatron import MegatronSequenceNorms, is_sharded  # noqa: E402

ARCHITECTURES = {
    # Llama/Qwen-like: RMSNorm, SwiGLU, rotary positions
    "rmsnorm_swiglu_rope": dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                                position_embedding_type="rope"),
    # GPT-2-like: LayerNorm, GELU, learned absolute positions
    "layernorm_gelu_learned": dict(normalization="LayerNorm", gated_linear_unit=False, activation_func=torch.nn.functional.gelu,
                                   position_embedding_type="learned_absolute"),
    # the first with the output layer tied to the input embedding (Qwen2's tie_word_embeddings)
    "rmsnorm_swiglu_rope_tied": dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                                     position_embedding_type="rope", tied=True),
    # sequence parallelism, with either embedding path (reduce-scattering word embeddings; learned positions)
    "rmsnorm_swiglu_rope_sp": dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                                   position_embedding_type="rope", tied=True, sequence_parallel=True),
    "layernorm_gelu_learned_sp": dict(normalization="LayerNorm", gated_linear_unit=False, activation_func=torch.nn.functional.gelu,
                                      position_embedding_type="learned_absolute", sequence_parallel=True),
    # bf16 parameters (verl's Megatron engine trains in bf16): the float64 model's weights rounded
    "rmsnorm_swiglu_rope_bf16": dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                                     position_embedding_type="rope", tied=True, dtype=torch.bfloat16),
    # the layer sets of the model families the launcher's recipes train, as mbridge configures them (grouped queries):
    # Qwen2 / Qwen2.5 (biases on q, k, v only), Llama 3 (no biases), Qwen3 (no biases, a layer norm on each query
    # and key head, whose weight every head of every TP rank shares)
    "qwen2": dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                  position_embedding_type="rope", num_query_groups=2, add_bias_linear=False, add_qkv_bias=True),
    "llama3": dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                   position_embedding_type="rope", num_query_groups=2, add_bias_linear=False),
    "qwen3": dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                  position_embedding_type="rope", num_query_groups=2, add_bias_linear=False, qk_layernorm=True),
    # two pipeline stages (one layer each; the ranks beyond the first two add tensor parallelism)
    "rmsnorm_swiglu_rope_pp": dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                                   position_embedding_type="rope", pipeline=2),
    # the same with the output layer tied to the input embedding across the stages (the first holds E, the last H)
    "rmsnorm_swiglu_rope_pp_tied": dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                                        position_embedding_type="rope", pipeline=2, tied=True),
}
BATCH, TOKENS, VOCAB = 3, 8, 64


def _torch_norm_for_sequence_parallel(cls, config, hidden_size, eps=1e-5, **_):
    norm_cls = torch.nn.LayerNorm if config.normalization == "LayerNorm" else torch.nn.RMSNorm
    norm = norm_cls(normalized_shape=hidden_size, eps=eps)
    for param in norm.parameters():
        param.sequence_parallel = config.sequence_parallel
    return norm


torch_norm.WrappedTorchNorm.__new__ = _torch_norm_for_sequence_parallel


def build(architecture: str, tensor: int, pipeline: int) -> GPTModel:
    settings = dict(ARCHITECTURES[architecture])
    position_embedding_type = settings.pop("position_embedding_type")
    tied = settings.pop("tied", False)
    settings.pop("pipeline", None)
    settings.pop("dtype", None)
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, tensor_model_parallel_size=tensor,
        pipeline_model_parallel_size=pipeline, pipeline_dtype=torch.float64,
        use_cpu_initialization=True, params_dtype=torch.float64, hidden_dropout=0.0, attention_dropout=0.0,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, bias_activation_fusion=False, **{"add_bias_linear": True, **settings},
    )
    torch.manual_seed(0)
    spec = get_gpt_layer_local_spec(normalization=settings["normalization"], qk_layernorm=settings.get("qk_layernorm", False))
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=16,
                     position_embedding_type=position_embedding_type, share_embeddings_and_output_weights=tied,
                     pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage())
    return model.double()


def check(architecture: str) -> dict:
    """One architecture's engine against its reference, on the ranks of the process group."""
    pipeline = ARCHITECTURES[architecture].get("pipeline", 1)
    tensor = dist.get_world_size() // pipeline
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor, pipeline_model_parallel_size=pipeline)
    megatron_random.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    model = build(architecture, tensor, pipeline)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, TOKENS), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, TOKENS), generator=generator)
    loss_mask = torch.ones(BATCH, TOKENS, dtype=torch.float64)
    loss_mask[1, 5:], loss_mask[2, 2:] = 0.0, 0.0  # shorter responses
    positions = torch.arange(TOKENS).expand(BATCH, TOKENS)
    causal = torch.triu(torch.ones(TOKENS, TOKENS, dtype=torch.bool), diagonal=1)[None, None]
    group = parallel_state.get_tensor_model_parallel_group()
    pp_group = parallel_state.get_pipeline_model_parallel_group() if pipeline > 1 else None
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    tied_across_stages = pipeline > 1 and model.share_embeddings_and_output_weights
    embedding_group = parallel_state.get_embedding_group() if tied_across_stages else None
    tied = model.shared_embedding_or_output_weight() if tied_across_stages and (first or last) else None

    def sum_tied_copies(grads: list[torch.Tensor]) -> None:
        """As megatron does after the backward: the tied weight's gradient is E's plus H's, on both stages."""
        if tied is not None:
            dist.all_reduce(grads[[id(p) for p in params].index(id(tied))], group=embedding_group)

    def counted(p: torch.Tensor) -> bool:  # the tied weight counts once, on the first stage
        return not (tied is not None and p is tied and not first)

    def backward_of_scores(micro_batches: list[list[int]], announce=lambda rows: None) -> None:
        """The backward of Σ_i l_i over each micro-batch's rows, through the stages (hidden states forward, their
        gradient back, point to point), every forward before any backward, as a pipeline schedule's warm-up
        interleaves them; ``announce(rows)`` runs before each forward."""
        pending = []
        for rows in micro_batches:
            announce(rows)
            received = None
            if not first:
                received = torch.empty(TOKENS, len(rows), 32, dtype=torch.float64)
                dist.recv(received, src=parallel_state.get_pipeline_model_parallel_prev_rank())
                received.requires_grad_()
                model.set_input_tensor(received)
            if last:
                token_loss = model(ids[rows] if first else None, positions[rows], attention_mask=causal, labels=labels[rows])
                output = -(token_loss * loss_mask[rows]).sum()
            else:
                output = model(ids[rows] if first else None, positions[rows], attention_mask=causal)
                dist.send(output.detach().contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
            pending.append((output, received))
        for output, received in pending:
            if last:
                output.backward()
            else:
                gradient = torch.empty_like(output)
                dist.recv(gradient, src=parallel_state.get_pipeline_model_parallel_next_rank())
                output.backward(gradient)
            if received is not None:
                dist.send(received.grad.contiguous(), dst=parallel_state.get_pipeline_model_parallel_prev_rank())

    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    # each rank's gradient of these is its part (its tokens under sequence parallelism, its query / key heads for a QK
    # layer norm): the whole is their sum over the TP group
    partial = [getattr(p, "sequence_parallel", False) or "q_layernorm" in name or "k_layernorm" in name for name, p in named]

    def one_backward_per_sequence() -> tuple[list[float], list[list[torch.Tensor]]]:
        """Each sequence's gradient (float64 copies) and the full gradient's squared norm by the reduction rule."""
        reference, per_sequence = [], []
        for i in range(BATCH):
            model.zero_grad(set_to_none=True)
            backward_of_scores([[i]])
            grads = [torch.zeros_like(p, dtype=torch.float64) if p.grad is None else p.grad.double() for p in params]
            for is_partial, g in zip(partial, grads):
                if is_partial:
                    dist.all_reduce(g, group=group)
            sum_tied_copies(grads)
            per_sequence.append(grads)
            sharded = sum((g.pow(2).sum() for p, g in zip(params, grads) if is_sharded(p) and counted(p)), torch.zeros((), dtype=torch.float64))
            dist.all_reduce(sharded, group=group)
            total = sharded + sum((g.pow(2).sum() for p, g in zip(params, grads) if not is_sharded(p) and counted(p)),
                                  torch.zeros((), dtype=torch.float64))
            if pp_group is not None:  # every stage holds its own parameters
                dist.all_reduce(total, group=pp_group)
            reference.append(float(total))
        return reference, per_sequence

    # OPOB: Σ_i (c^R_i − b_γ(i) c^S_i) g_i of every local parameter from the same one backward, two baseline groups
    coef_r = torch.tensor([0.7, -1.3, 0.4], dtype=torch.float64)
    coef_s = torch.tensor([0.2, 0.9, -0.5], dtype=torch.float64)
    groups = torch.tensor([7, 3, 7])  # two baseline groups: sequences 0 and 2, and 1
    baseline = torch.tensor([0.35, -0.6, 0.35], dtype=torch.float64)
    weights = coef_r - baseline * coef_s

    def update_error(grads: list[torch.Tensor], per_sequence: list[list[torch.Tensor]]) -> float:
        """The largest relative error over the local parameters of ``grads`` against Σ_i w_i g_i of ``per_sequence``."""
        errors = []
        for j, grad in enumerate(grads):
            expected = sum(weights[i] * per_sequence[i][j] for i in range(BATCH))
            errors.append(float((grad - expected).norm() / expected.norm().clamp_min(1e-300)))
        return max(errors)

    truth, truth_per_sequence = one_backward_per_sequence()  # float64
    result = {"reference": truth}
    dtype = ARCHITECTURES[architecture].get("dtype", torch.float64)
    if dtype != torch.float64:  # autograd's own error in that precision: the same loop on the rounded weights
        model.to(dtype)
        own, own_per_sequence = one_backward_per_sequence()
        result |= {"autograd": own, "autograd_update_error": update_error(
            [sum(weights[i] * own_per_sequence[i][j] for i in range(BATCH)) for j in range(len(params))], truth_per_sequence)}
    norms = MegatronSequenceNorms(model, group, pp_group, embedding_group)

    def engine_update() -> list[torch.Tensor]:
        """`combine`'s gradients, completed as megatron's finalize_model_grads would: a partial parameter's parts
        summed over the TP group, the tied copies summed."""
        norms.combine(baseline)
        update = [p.grad.double() for p in params]
        for is_partial, g in zip(partial, update):
            if is_partial:
                dist.all_reduce(g, group=group)
        sum_tied_copies(update)
        return update

    model.zero_grad(set_to_none=True)
    with norms.recording(BATCH, coef_r, coef_s, groups, ids=ids):
        backward_of_scores([list(range(BATCH))])
    result |= {"engine": norms.sq_norms().tolist(), "update_error": update_error(engine_update(), truth_per_sequence)}
    # a step of two micro-batches, the second's forward before the first's backward; groups labelled 0..G-1 over the step
    step_labels = torch.unique(groups, return_inverse=True)[1]
    model.zero_grad(set_to_none=True)
    with norms.step(num_groups=int(step_labels.max()) + 1):
        backward_of_scores([[0, 1], [2]], lambda rows: norms.micro_batch(len(rows), coef_r[rows], coef_s[rows], step_labels[rows], ids=ids[rows]))
    result |= {"step_engine": norms.sq_norms().tolist(), "step_update_error": update_error(engine_update(), truth_per_sequence),
               "sharded_params": sum(is_sharded(p) for p in model.parameters()),
               "replicated_params": sum(not is_sharded(p) for p in model.parameters()),
               "sequence_parallel": [getattr(m, "sequence_parallel", None) for m in model.modules() if type(m).__name__ == "RowParallelLinear"]}
    parallel_state.destroy_model_parallel()
    return result


def main(architectures: list[str], out: str) -> None:
    """Every architecture in turn on the same ranks (one start-up for all of them); rank 0 writes the results."""
    dist.init_process_group("gloo")
    results = {architecture: check(architecture) for architecture in architectures}
    if dist.get_rank() == 0:
        with open(out, "w") as handle:
            json.dump(results, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1].split(","), sys.argv[2])
