"""Step time of OPOB inside megatron-core layers (`MegatronSequenceNorms`) against a plain backward, in both of its
modes, and its per-sequence norms against one backward per sequence, on one device.

On one random megatron-core GPT with the layers OPOB trains on Megatron (``recipes/megatron.yaml``, ``local_layers``:
the local layer spec, RMSNorm + SwiGLU + rotary, core attention recomputed in the backward; one rank: TP 1, PP 1;
one sequence per micro-batch by default) and one batch, it times round-robin
  plain     the backward of Σ_i l_i over the micro-batches (l_i the sequence's mean token log-prob),
  opob      (single) the same backward inside `MegatronSequenceNorms.step`: every sequence's squared gradient norm
            and the OPOB combination G_R − Σ_γ b_γ G_S^γ, written into the gradients,
  two_pass  a norms-only backward inside `MegatronSequenceNorms.step(None)`, then the plain backward of Σ_i w_i l_i,
and prints the median of each and their ratios over plain (the paper's Megatron implementation: 1.19x; this
project's targets: single <= 1.25x, two_pass <= 1.5x). The norms are checked once against one backward per sequence
in the same dtype.

    python benchmarks/megatron_overhead.py --device cuda --json megatron.json        # one GPU, bf16, 0.5B-like
    python benchmarks/megatron_overhead.py --device cpu --size tiny                  # CPU: gloo and the CPU shims

Needs megatron-core (``pip install megatron-core==0.16.1``; on CPU also what vcpo.verl_plugin.cpu.megatron needs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

SIZES = {  # GPT shapes: layers, hidden, heads, ffn, vocab
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=176, vocab=512),
    "0.5b": dict(num_layers=24, hidden_size=896, num_attention_heads=14, ffn_hidden_size=4864, vocab=151936),
}


def setup(device: str) -> None:
    """One rank: NCCL on a GPU; on the CPU gloo and the shims verl's Megatron engine runs with."""
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", store=store, rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as megatron_random

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    else:
        from vcpo.verl_plugin.cpu.megatron import enable_megatron_on_cpu

        enable_megatron_on_cpu()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    megatron_random.model_parallel_cuda_manual_seed(0)  # attention forks the tracker's model-parallel state


def build(args: argparse.Namespace):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = dict(SIZES[args.size])
    vocab = shape.pop("vocab")
    dtype = getattr(torch, args.dtype)
    config = TransformerConfig(
        **shape, normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=not args.device.startswith("cuda"),
        hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False, bias_activation_fusion=False,
        add_bias_linear=False, recompute_granularity="selective" if args.recompute_attention else None,
    )
    torch.manual_seed(0)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=vocab,
                     max_sequence_length=args.seq_len, position_embedding_type="rope", share_embeddings_and_output_weights=True)
    return model.to(device=args.device, dtype=dtype), vocab


def batch(args: argparse.Namespace, vocab: int) -> dict:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=generator)
    lengths = torch.randint(args.seq_len // 2, args.seq_len + 1, (args.batch_size,), generator=generator)
    mask = (torch.arange(args.seq_len)[None] < lengths[:, None]).float()
    rewards = torch.randint(0, 2, (args.batch_size,), generator=generator).double()
    groups = torch.arange(args.batch_size) // args.group_size
    device = args.device
    return {"ids": ids.to(device), "mask": mask.to(device), "rewards": rewards, "groups": groups,
            "positions": torch.arange(args.seq_len, device=device).expand(args.batch_size, -1),
            "causal": torch.triu(torch.ones(args.seq_len, args.seq_len, dtype=torch.bool, device=device), 1)[None, None]}


def scores(model, data: dict, rows) -> torch.Tensor:
    """l_i: each sequence's mean token log-prob of its next tokens (megatron's output layer gives −log p)."""
    ids, mask = data["ids"][rows], data["mask"][rows]
    labels = torch.roll(ids, -1, 1)
    token_loss = model(ids, data["positions"][rows], attention_mask=data["causal"], labels=labels)
    return -(token_loss.float() * mask).sum(1) / mask.sum(1)


def micro_batches(args: argparse.Namespace) -> list[slice]:
    return [slice(start, start + args.micro_batch_size) for start in range(0, args.batch_size, args.micro_batch_size)]


def plain_step(model, data, args, norms) -> None:
    model.zero_grad(set_to_none=True)
    for rows in micro_batches(args):
        scores(model, data, rows).sum().backward()


def opob_step(model, data, args, norms) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    groups = data["groups"]
    with norms.step(num_groups=int(groups.max()) + 1):
        for rows in micro_batches(args):
            size = rows.stop - rows.start
            norms.micro_batch(size, coef_r=data["rewards"][rows], coef_s=torch.ones(size, dtype=torch.float64), groups=groups[rows])
            scores(model, data, rows).sum().backward()
    sq_norms = norms.sq_norms()
    group_mean = torch.zeros(int(groups.max()) + 1, dtype=torch.float64).index_add_(0, groups, data["rewards"]) / args.group_size
    norms.combine(group_mean[groups])  # any baseline constant per group costs the same
    return sq_norms


def two_pass_step(model, data, args, norms) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    with norms.step(None):
        for rows in micro_batches(args):
            norms.micro_batch(rows.stop - rows.start)
            scores(model, data, rows).sum().backward()
    sq_norms = norms.sq_norms()
    model.zero_grad(set_to_none=True)  # pass 1's gradients are dropped
    weights = (data["rewards"] - 0.5).to(args.device)  # any weights cost the same
    for rows in micro_batches(args):
        (weights[rows] * scores(model, data, rows)).sum().backward()
    return sq_norms


def one_backward_per_sequence(model, data, args) -> torch.Tensor:
    norms = []
    for i in range(args.batch_size):
        model.zero_grad(set_to_none=True)
        scores(model, data, slice(i, i + 1)).sum().backward()
        norms.append(sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None))
    return torch.stack(norms).cpu()


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=tuple(SIZES), default=None, help="0.5b on a GPU, tiny on a CPU by default")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=1, help="1: the authors' and the launcher's Megatron runs")
    parser.add_argument("--no-recompute-attention", dest="recompute_attention", action="store_false",
                        help="keep core attention's scores instead of recomputing them (the launcher recomputes them)")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=None, help="2048 on a GPU, 64 on a CPU by default")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    gpu = args.device.startswith("cuda")
    args.size = args.size or ("0.5b" if gpu else "tiny")
    args.seq_len = args.seq_len or (2048 if gpu else 64)
    setup(args.device)
    from vcpo.core.per_sequence_grads.megatron import MegatronSequenceNorms

    model, vocab = build(args)
    data = batch(args, vocab)
    norms = MegatronSequenceNorms(model)
    engine_norms = opob_step(model, data, args, norms)  # warm-up, and the norms checked below
    two_pass_norms = two_pass_step(model, data, args, norms)
    truth = one_backward_per_sequence(model, data, args)
    norm_error = float(max(((found - truth).abs() / truth).max() for found in (engine_norms, two_pass_norms)))
    steps = {"plain": plain_step, "opob": opob_step, "two_pass": two_pass_step}
    times = {name: [] for name in steps}
    plain_step(model, data, args, norms)
    for _ in range(args.repeats):
        for name, step in steps.items():
            synchronize(args.device)
            started = time.perf_counter()
            step(model, data, args, norms)
            synchronize(args.device)
            times[name].append(time.perf_counter() - started)
    median = {name: statistics.median(values) for name, values in times.items()}
    result = {"setting": {k: v for k, v in vars(args).items() if k != "json"}, "step_s": median,
              "opob_over_plain": median["opob"] / median["plain"], "two_pass_over_plain": median["two_pass"] / median["plain"],
              "norm_max_relative_error": norm_error}
    print(f"megatron-core {args.size} on {args.device}, {args.dtype}, {args.batch_size} x {args.seq_len} tokens, "
          f"micro-batches of {args.micro_batch_size}, core attention {'recomputed' if args.recompute_attention else 'kept'}: "
          f"plain {median['plain']:.4f} s, OPOB single {median['opob']:.4f} s ({result['opob_over_plain']:.2f}x), "
          f"two_pass {median['two_pass']:.4f} s ({result['two_pass_over_plain']:.2f}x); norms against one backward per "
          f"sequence: {norm_error:.2e} relative")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
