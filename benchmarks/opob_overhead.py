"""Step time and peak memory of the single-backward OPOB update against its alternatives.

On one random-init Qwen2 model and one batch, in one process, it times one optimizer step of
  plain           one backward of the TIS loss with a fixed (group-mean) baseline: the reference,
  opob            `PerSequenceGradients`: exact ||g_i||² and G_R, G_S in the same single backward,
  naive           two passes: the single backward for the norms (its gradients discarded), a second backward
                  with the OPOB coefficients,
  two_pass        the engines' memory-safe mode: a norms-only backward (``combination="norms"``), then a plain
                  backward of Σ_i (c^R_i − b c^S_i) l_i,
  per_sequence    one trajectory per micro-batch (the authors' release): ||g_i||² read off p.grad,
  norms_pass      two_pass's first pass alone (what two_pass adds to plain),
  input_grads     a forward and a backward that forms input gradients only (no weight gradient, no norm): the
                  least any first pass costs, since every ||g_i||² needs every layer's output gradient,
and prints each variant's median time and peak memory as a ratio to plain. Every step ends with the
ESS-scaled AdamW step (`scaled_learning_rate` + `ess_step_scale`), identical in all variants.

Timing: the variants run round-robin (each repeat runs all of them), so background load slows them
alike; the median over repeats is reported, for the whole step and for forward + backward alone.
``--count-ops`` also counts the ATen operators one step of each variant dispatches (a GPU launches about one
kernel per operator that computes, so where a step is launch-bound this is its cost); ``--cuda-blocks`` gives PerSequenceGradients CUDA's
block size and cost model on any device, so that a CPU counts what a GPU would launch.
Peak memory beyond the model and its optimizer state: on CUDA torch.cuda.max_memory_allocated; on CPU
the resident-set high-water mark (VmHWM) of a fresh subprocess per variant, reset after a warm-up
step and malloc_trim (torch allocates CPU memory with malloc, so RSS tracks live tensors).

    python benchmarks/opob_overhead.py --model 50m --threads 1
    python benchmarks/opob_overhead.py --model 50m --threads 1 --autocast bfloat16   # fp32 params, bf16 compute
    python benchmarks/opob_overhead.py --model 0.5b --device cuda --dtype bfloat16 --seq-len 2048
    python benchmarks/opob_overhead.py --json overhead.json   # also the ratios as JSON (vcpo.reporting fig3)
    python benchmarks/opob_overhead.py --profile opob         # one step's operators by self time
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import statistics
import subprocess
import sys
import time
from typing import NamedTuple

import torch

from vcpo.core.baselines import opob_baseline
from vcpo.core.ess import ess_ratio, ess_step_scale, scaled_learning_rate
from vcpo.core.per_sequence_grads.gradients import PerSequenceGradients
from vcpo.core.per_sequence_grads.reductions import (
    COMBINATIONS,
    DEFAULT_BLOCK_BYTES,
    DEFAULT_BLOCK_ROW_MULTIPLE,
    DEFAULT_PASS_COST,
    NORMS_ONLY,
)
from vcpo.provenance import output_record, utc_now
from vcpo.resident_memory import reset_peak, status_bytes

VARIANTS = ("plain", "opob", "naive", "two_pass", "per_sequence", "norms_pass", "input_grads")
DEFAULT_VARIANTS = VARIANTS[:5]  # the parts of two_pass (norms_pass, input_grads) on request

# Qwen2 shapes; "0.5b" is the Qwen2-0.5B architecture (tied embeddings), with random weights.
MODEL_SHAPES = {
    "0.1m": dict(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ),
    "50m": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=10,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=32000,
    ),
    "0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        rope_theta=1_000_000.0,
    ),
}
TIS_CAP = 8.0
MEMORY_PROBE_TIMEOUT_S = 1800  # one variant's step in a fresh process; a hung one fails the run by name


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**MODEL_SHAPES[args.model], tie_word_embeddings=True, max_position_embeddings=args.seq_len)
    torch.manual_seed(args.seed)
    return Qwen2ForCausalLM(config).to(device=args.device, dtype=getattr(torch, args.dtype)).train()


def build_batch(args: argparse.Namespace, vocab_size: int) -> dict:
    """Right-padded sequences of random lengths in [f·T, T], GRPO-style groups, stale sequence weights."""
    generator = torch.Generator().manual_seed(args.seed + 1)
    batch, tokens = args.batch_size, args.seq_len
    lengths = torch.randint(max(2, int(tokens * args.min_length_fraction)), tokens + 1, (batch,), generator=generator)
    rewards = torch.rand(batch, generator=generator, dtype=torch.float64)  # never all equal: Ĝ ≠ 0
    seq_log_weights = 0.5 * torch.randn(batch, generator=generator, dtype=torch.float64)
    tis = seq_log_weights.exp().clamp(max=TIS_CAP)
    groups = torch.arange(batch) // args.group_size
    group_mean = torch.zeros(batch, dtype=torch.float64).index_add(0, groups, rewards)[groups] / args.group_size
    to = dict(device=args.device)
    return dict(
        input_ids=torch.randint(0, vocab_size, (batch, tokens), generator=generator).to(**to),
        mask=(torch.arange(tokens)[None] < lengths[:, None]).long().to(**to),
        lengths=lengths.tolist(),
        rewards=rewards.to(**to),
        seq_log_weights=seq_log_weights.to(**to),
        coef_r=(tis * rewards / batch).to(**to),
        coef_s=(tis / batch).to(**to),
        group_mean=group_mean.to(**to),
        groups=groups.to(**to) if args.grouped else None,
    )


def sequence_scores(model, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """l_i = mean_t log π(y_t | y_<t) over the valid tokens (seq-mean-token-mean), shape (B,)."""
    logits = model(input_ids, attention_mask=mask).logits[:, :-1].float()
    targets = input_ids[:, 1:]
    token_log_probs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)
    valid = mask[:, 1:].to(token_log_probs.dtype)
    return (token_log_probs * valid).sum(1) / valid.sum(1).clamp_min(1.0)


def micro_batches(args: argparse.Namespace, batch: dict):
    for start in range(0, args.batch_size, args.micro_batch_size):
        yield slice(start, start + args.micro_batch_size)


def weighted_backward(model, batch: dict, args: argparse.Namespace, weights: torch.Tensor) -> None:
    """A plain backward of Σ_i weights_i l_i, micro-batch by micro-batch."""
    for rows in micro_batches(args, batch):
        scores = sequence_scores(model, batch["input_ids"][rows], batch["mask"][rows])
        (weights[rows].to(scores.dtype) * scores).sum().backward()


class SingleAndNormsOnly(NamedTuple):
    """The single backward's PerSequenceGradients (norms and buffers) and the two-pass mode's norms-only one, on one model."""

    opob: PerSequenceGradients
    norms: PerSequenceGradients


def opob_norms_and_buffers(per_sequence, model, batch: dict, args: argparse.Namespace) -> None:
    for rows in micro_batches(args, batch):
        groups = None if batch["groups"] is None else batch["groups"][rows]
        with per_sequence.micro_batch(batch["coef_r"][rows], batch["coef_s"][rows], groups=groups):
            sequence_scores(model, batch["input_ids"][rows], batch["mask"][rows]).sum().backward()


def baseline_from(norms: torch.Tensor, batch: dict) -> torch.Tensor:
    return opob_baseline(batch["rewards"], norms, batch["seq_log_weights"], batch["groups"])


def step_plain(model, engines, batch, args):
    weighted_backward(model, batch, args, batch["coef_r"] - batch["group_mean"] * batch["coef_s"])


def step_opob(model, engines, batch, args):
    opob_norms_and_buffers(engines.opob, model, batch, args)
    engines.opob.combine(baseline_from(engines.opob.sq_norms, batch))


def step_naive(model, engines, batch, args):
    opob_norms_and_buffers(engines.opob, model, batch, args)  # pass 1: the norms (its gradients are discarded)
    norms = engines.opob.sq_norms
    engines.opob.combine(0.0)
    model.zero_grad(set_to_none=True)
    weighted_backward(model, batch, args, batch["coef_r"] - baseline_from(norms, batch) * batch["coef_s"])


def step_two_pass(model, engines, batch, args):
    opob_norms_and_buffers(engines.norms, model, batch, args)  # pass 1: the norms alone, no gradient
    norms = engines.norms.sq_norms
    engines.norms.discard()
    weighted_backward(model, batch, args, batch["coef_r"] - baseline_from(norms, batch) * batch["coef_s"])


def step_norms_pass(model, engines, batch, args):
    opob_norms_and_buffers(engines.norms, model, batch, args)
    engines.norms.discard()


def step_input_grads(model, engines, batch, args):
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    handle = model.get_input_embeddings().register_forward_hook(lambda module, inputs, output: output.requires_grad_())
    try:
        weighted_backward(model, batch, args, batch["coef_s"])
    finally:
        handle.remove()
        for p in params:
            p.requires_grad_(True)


def step_per_sequence(model, engines, batch, args):
    """One unpadded trajectory per micro-batch: g_i = p.grad, folded into G_R and its group's G_S one at a time."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [0] * len(batch["lengths"]) if batch["groups"] is None else batch["groups"].tolist()
    reward_sum = [torch.zeros_like(p) for p in params]
    score_sums = {group: [torch.zeros_like(p) for p in params] for group in dict.fromkeys(groups)}
    norms = []
    for i, length in enumerate(batch["lengths"]):
        ids = batch["input_ids"][i : i + 1, :length]
        sequence_scores(model, ids, torch.ones_like(ids)).sum().backward()
        grads = [p.grad for p in params]
        norms.append(torch.stack(torch._foreach_norm(grads)).double().square().sum())
        torch._foreach_add_(reward_sum, grads, alpha=float(batch["coef_r"][i]))
        torch._foreach_add_(score_sums[groups[i]], grads, alpha=float(batch["coef_s"][i]))
        model.zero_grad(set_to_none=True)
    baselines = baseline_from(torch.stack(norms), batch).tolist()
    for group, score_sum in score_sums.items():
        torch._foreach_add_(reward_sum, score_sum, alpha=-baselines[groups.index(group)])
    for p, g in zip(params, reward_sum, strict=True):
        p.grad = g


STEPS = {"plain": step_plain, "opob": step_opob, "naive": step_naive, "two_pass": step_two_pass,
         "per_sequence": step_per_sequence, "norms_pass": step_norms_pass, "input_grads": step_input_grads}


def optimizer_step(optimizer, batch: dict) -> None:
    scale = ess_step_scale(ess_ratio(batch["seq_log_weights"]))
    with scaled_learning_rate(optimizer, scale):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_step(variant, model, per_sequence, batch, args) -> None:
    """One variant's forward and backward, under ``--autocast`` when given (as verl runs its actor)."""
    if args.autocast is None:
        STEPS[variant](model, per_sequence, batch, args)
        return
    with torch.autocast(torch.device(args.device).type, dtype=getattr(torch, args.autocast)):
        STEPS[variant](model, per_sequence, batch, args)


def timed_step(variant, model, per_sequence, optimizer, batch, args) -> tuple[float, float]:
    """(forward + backward seconds, whole-step seconds) of one step."""
    synchronize(args.device)
    start = time.perf_counter()
    run_step(variant, model, per_sequence, batch, args)
    synchronize(args.device)
    backward_done = time.perf_counter()
    optimizer_step(optimizer, batch)
    synchronize(args.device)
    return backward_done - start, time.perf_counter() - start


def setup_engine_settings(args: argparse.Namespace) -> dict:
    """The engines' settings: the route, CUDA's block settings and cost model with ``--cuda-blocks``, the block size
    and row multiple with ``--block-mb`` and ``--block-row-multiple``; the device's defaults otherwise."""
    settings = dict(norm_method=args.norm_method)
    if args.cuda_blocks:
        settings |= dict(block_bytes=DEFAULT_BLOCK_BYTES["cuda"], pass_cost=DEFAULT_PASS_COST["cuda"],
                         block_row_multiple=DEFAULT_BLOCK_ROW_MULTIPLE["cuda"])
    if args.block_mb is not None:
        settings["block_bytes"] = int(args.block_mb * (1 << 20))
    if args.block_row_multiple is not None:
        settings["block_row_multiple"] = args.block_row_multiple
    return settings


def setup(args: argparse.Namespace):
    model = build_model(args)
    settings = setup_engine_settings(args)
    per_sequence = SingleAndNormsOnly(PerSequenceGradients(model, combination=args.combination, **settings),
                     PerSequenceGradients(model, combination=NORMS_ONLY, **settings))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.1)
    batch = build_batch(args, model.config.vocab_size)
    return model, per_sequence, optimizer, batch


def final_gradients(variant, model, per_sequence, batch, args) -> list[torch.Tensor]:
    run_step(variant, model, per_sequence, batch, args)
    grads = [p.grad.detach().double().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def check_agreement(model, per_sequence, batch, args) -> dict:
    """Relative difference of each variant's final gradient from the single-backward one."""
    reference = final_gradients("opob", model, per_sequence, batch, args)
    reference_norm = torch.stack([g.norm() for g in reference]).norm()
    result = {}
    for variant in ("naive", "two_pass", "per_sequence"):
        grads = final_gradients(variant, model, per_sequence, batch, args)
        result[variant] = float(
            torch.stack([(g - r).norm() for g, r in zip(grads, reference, strict=True)]).norm() / reference_norm
        )
    return result


def time_variants(args: argparse.Namespace) -> dict:
    model, per_sequence, optimizer, batch = setup(args)
    agreement = check_agreement(model, per_sequence, batch, args)
    times = {variant: ([], []) for variant in args.variants}
    for repeat in range(args.warmup + args.repeats):
        for variant in args.variants:
            backward_seconds, step_seconds = timed_step(variant, model, per_sequence, optimizer, batch, args)
            if repeat >= args.warmup:
                times[variant][0].append(backward_seconds)
                times[variant][1].append(step_seconds)
    weight = next(model.parameters())
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "block_bytes": per_sequence.opob.block_bytes(weight),
        "block_row_multiple": per_sequence.opob.block_row_multiple(weight),
        "agreement": agreement,
        "fwd_bwd_s": {v: statistics.median(t[0]) for v, t in times.items()},
        "step_s": {v: statistics.median(t[1]) for v, t in times.items()},
    }


def measure_peak_memory(args: argparse.Namespace, variant: str) -> int:
    """Peak bytes above the model and optimizer state during one step of ``variant``."""
    if args.device.startswith("cuda"):
        return cuda_allocator_record(args, variant)["peak_bytes"]
    model, per_sequence, optimizer, batch = setup(args)
    timed_step(variant, model, per_sequence, optimizer, batch, args)  # warm-up: optimizer state, lazy buffers
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap back, so RSS is the live memory
    resting = reset_peak()
    timed_step(variant, model, per_sequence, optimizer, batch, args)
    return status_bytes("VmHWM") - resting


def cuda_allocator_record(args: argparse.Namespace, variant: str) -> dict:
    """One step of ``variant`` as CUDA's caching allocator saw it, after a warm-up step with the cache emptied:
    ``peak_bytes`` above the model and optimizer state; the allocated and reserved peaks (absolute) of the forward and
    backward and of the optimizer step apart, with what the optimizer step adds above what it starts from (foreach
    AdamW's temporaries); and after the step the device memory the allocator does not hold (this process's CUDA
    context and libraries' workspaces, on a GPU no other process uses)."""
    model, per_sequence, optimizer, batch = setup(args)
    timed_step(variant, model, per_sequence, optimizer, batch, args)  # warm-up: optimizer state, lazy buffers
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # blocks cached by earlier steps would stand in the reserved peak
    torch.cuda.reset_peak_memory_stats()
    resting = torch.cuda.memory_allocated()
    run_step(variant, model, per_sequence, batch, args)
    torch.cuda.synchronize()
    backward = {"allocated_peak": torch.cuda.max_memory_allocated(), "reserved_peak": torch.cuda.max_memory_reserved()}
    optimizer_start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    optimizer_step(optimizer, batch)
    torch.cuda.synchronize()
    optimizer = {"allocated_peak": torch.cuda.max_memory_allocated(), "reserved_peak": torch.cuda.max_memory_reserved()}
    free, total = torch.cuda.mem_get_info()
    return {"peak_bytes": max(backward["allocated_peak"], optimizer["allocated_peak"]) - resting,
            "resting_allocated": resting, "backward": backward, "optimizer_step": optimizer,
            "optimizer_step_added": optimizer["allocated_peak"] - optimizer_start,
            "outside_allocator": total - free - torch.cuda.memory_reserved(),
            "parameters": sum(p.numel() for p in model.parameters()), "param_bytes": next(model.parameters()).element_size()}


def memory_in_subprocess(args: argparse.Namespace, variant: str) -> int:
    command = [sys.executable, __file__, *sys.argv[1:], "--memory-probe", variant]
    result = subprocess.run(command, check=True, capture_output=True, text=True, timeout=MEMORY_PROBE_TIMEOUT_S)
    return int(json.loads(result.stdout.strip().splitlines()[-1])["peak_bytes"])


def calibrate_pass_cost(args: argparse.Namespace) -> float:
    """The machine balance κ of `prefers_ghost`, measured on one Linear of the model's MLP shape.

    The materialise route replaces autograd's weight-gradient matmul by per-sequence matmuls with the
    same FLOPs plus reductions over B·R·C values; κ is that extra time per value in units of one
    multiply-add of the plain layer (forward + weight gradient = 2·B·T·R·C multiply-adds).
    """
    shape = MODEL_SHAPES[args.model]
    dtype = getattr(torch, args.dtype)
    layer = torch.nn.Linear(
        shape["hidden_size"], shape["intermediate_size"], bias=False, device=args.device, dtype=dtype
    )
    batch, tokens = args.micro_batch_size, args.seq_len
    x = torch.randn(batch, tokens, shape["hidden_size"], device=args.device, dtype=dtype)
    delta = torch.randn(batch, tokens, shape["intermediate_size"], device=args.device, dtype=dtype)
    gradients = PerSequenceGradients(layer, norm_method="materialize")
    ones = torch.ones(batch, device=args.device)

    def plain():
        (layer(x) * delta).sum().backward()

    def per_sequence():
        with gradients.micro_batch(ones, ones):
            (layer(x) * delta).sum().backward()
        gradients.combine(0.0)

    times = {plain: [], per_sequence: []}
    for repeat in range(args.warmup + 5 * args.repeats):
        for step in times:
            layer.weight.grad = None
            synchronize(args.device)
            start = time.perf_counter()
            step()
            synchronize(args.device)
            if repeat >= args.warmup:
                times[step].append(time.perf_counter() - start)
    plain_s, per_sequence_s = statistics.median(times[plain]), statistics.median(times[per_sequence])
    return (per_sequence_s - plain_s) / plain_s * 2 * tokens


# Operators that launch no kernel on a GPU besides views: a view without autograd's bookkeeping, and allocations of
# uninitialised memory (the caching allocator hands out a block).
NO_KERNEL = ("_unsafe_view", "empty", "empty_like", "new_empty", "empty_strided")


def count_ops(args: argparse.Namespace) -> tuple[dict[str, dict[str, int]], dict[str, collections.Counter]]:
    """ATen operators dispatched by one step (forward, backward, combination; not the optimizer) of each variant,
    after a warm-up step: all of them, and those that compute (about one kernel each on a GPU: not a view, not
    `NO_KERNEL`), also by operator."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        dispatched = 0
        by_operator: collections.Counter

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.dispatched += 1
            if not func.is_view and func.overloadpacket.__name__ not in NO_KERNEL:
                Counter.by_operator[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    model, per_sequence, optimizer, batch = setup(args)
    counts, by_operator = {"dispatched": {}, "computing": {}}, {}
    for variant in args.variants:
        timed_step(variant, model, per_sequence, optimizer, batch, args)
        Counter.dispatched, Counter.by_operator = 0, collections.Counter()
        with Counter():
            run_step(variant, model, per_sequence, batch, args)
        counts["dispatched"][variant], counts["computing"][variant] = Counter.dispatched, Counter.by_operator.total()
        by_operator[variant] = Counter.by_operator
        model.zero_grad(set_to_none=True)
    return counts, by_operator


def print_extra_operators(by_operator: dict[str, collections.Counter], rows: int = 8) -> None:
    """Each variant's computing operators beyond the plain step's, the largest differences first."""
    plain = by_operator["plain"]
    for variant, counts in by_operator.items():
        if variant == "plain":
            continue
        extra = sorted(((counts[name] - plain[name], name) for name in counts.keys() | plain.keys()), reverse=True)
        print(f"  {variant} beyond plain: " + ", ".join(f"{name} {n:+d}" for n, name in extra[:rows] if n))


def profile_step(args: argparse.Namespace, variant: str, rows: int = 25) -> None:
    """Where one step of ``variant`` spends its time: operators by self time (device time on CUDA), after
    two warm-up steps, so that a speed-up starts from a measured breakdown."""
    from torch.profiler import ProfilerActivity, profile

    model, per_sequence, optimizer, batch = setup(args)
    for _ in range(2):
        timed_step(variant, model, per_sequence, optimizer, batch, args)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    with profile(activities=activities) as profiler:
        timed_step(variant, model, per_sequence, optimizer, batch, args)
    sort_by = "self_cuda_time_total" if args.device.startswith("cuda") else "self_cpu_time_total"
    print(f"{variant}: one step, {args.model} {args.device}/{args.dtype}, batch {args.batch_size} x {args.seq_len}, norm method {args.norm_method}")
    print(profiler.key_averages().table(sort_by=sort_by, row_limit=rows, max_name_column_width=60))


def print_table(args: argparse.Namespace, timing: dict, memory: dict) -> None:
    plain_step, plain_bwd = timing["step_s"]["plain"], timing["fwd_bwd_s"]["plain"]
    print(
        f"model {args.model} ({timing['params'] / 1e6:.1f}M params), device {args.device}, dtype {args.dtype}, "
        f"autocast {args.autocast or 'off'}, "
        f"batch {args.batch_size} x {args.seq_len} tokens (lengths >= {args.min_length_fraction:g}·T), "
        f"micro-batch {args.micro_batch_size}, "
        f"threads {torch.get_num_threads()}, repeats {args.repeats}, norm method {args.norm_method}, "
        f"blocks of {timing['block_bytes'] / 2**20:g} MiB, rows a multiple of {timing['block_row_multiple']}"
    )
    header = f"{'variant':<14}{'step s':>9}{'step/plain':>12}{'fwd+bwd/plain':>15}{'peak MiB':>10}{'peak/plain':>12}"
    print(header)
    for variant in args.variants:
        step, bwd = timing["step_s"][variant], timing["fwd_bwd_s"][variant]
        peak = memory.get(variant)
        peak_text = (
            f"{peak / 2**20:>10.1f}{peak / memory['plain']:>12.2f}" if peak is not None else f"{'-':>10}{'-':>12}"
        )
        print(f"{variant:<14}{step:>9.3f}{step / plain_step:>12.2f}{bwd / plain_bwd:>15.2f}{peak_text}")
    print("final gradient vs opob (relative L2): " + ", ".join(f"{k} {v:.1e}" for k, v in timing["agreement"].items()))


def write_json(path: str, args: argparse.Namespace, timing: dict, memory: dict, records: dict) -> None:
    """The measured times, peaks and their ratios to plain, for ``python -m vcpo.reporting figure fig3``; on CUDA the
    allocator's record of each variant's step (`cuda_allocator_record`); and what produced them (``provenance``)."""
    ratios = {"step_time_ratio": {v: timing["step_s"][v] / timing["step_s"]["plain"] for v in args.variants}}
    if memory:
        ratios["memory_ratio"] = {v: memory[v] / memory["plain"] for v in args.variants}
    autocast = f" autocast {args.autocast}" if args.autocast else ""
    setting = f"{args.model}, {args.device}/{args.dtype}{autocast}, {args.batch_size} x {args.seq_len} tokens"
    result = {"setting": setting, "args": vars(args), **timing, "peak_bytes": memory, "ratios": ratios, **records}
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=tuple(MODEL_SHAPES), default="0.1m")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per optimizer step")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4, help="responses per prompt (plain's group-mean baseline)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument(
        "--min-length-fraction",
        type=float,
        default=0.5,
        help="sequence lengths are drawn from [f * seq-len, seq-len]; 1.0 = no padding",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    parser.add_argument(
        "--autocast", choices=("bfloat16", "float16"), help="run forward and backward under torch.autocast (mixed precision)"
    )
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--norm-method", "--mode", dest="norm_method", choices=("auto", "materialize", "ghost"), default="auto")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    parser.add_argument("--combination", choices=COMBINATIONS, default="buffers",
                        help="the single backward's combination (the verl per_sequence runs split)")
    parser.add_argument("--grouped", action="store_true",
                        help="one baseline per prompt group (scope group, as the VCPO preset), not one per batch")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="only measure the cost-model constant pass_cost on this machine and exit",
    )
    parser.add_argument("--count-ops", action="store_true", help="also count each variant's dispatched ATen ops per step")
    parser.add_argument("--cuda-blocks", action="store_true",
                        help="the per_sequence's CUDA block size and cost model on any device (what a GPU would run)")
    parser.add_argument("--block-mb", type=float, default=None,
                        help="MiB per block of per-sequence gradients (default: the device's, DEFAULT_BLOCK_BYTES)")
    parser.add_argument("--block-row-multiple", type=int, default=None,
                        help="rows per block a multiple of this (default: the device's, DEFAULT_BLOCK_ROW_MULTIPLE)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results and ratios to this JSON file")
    parser.add_argument("--memory-probe", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--profile",
        choices=VARIANTS,
        help="instead of timing: one step of this variant under torch.profiler, the top kernels by self time",
    )
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown or "plain" not in args.variants:
        raise SystemExit(f"--variants must include plain and be drawn from {VARIANTS}, got {args.variants}")
    if args.batch_size % args.micro_batch_size:
        raise SystemExit("--batch-size must be a multiple of --micro-batch-size")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    started = utc_now()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_probe:
        print(json.dumps({"peak_bytes": measure_peak_memory(args, args.memory_probe)}))
        return
    if args.profile:
        profile_step(args, args.profile)
        return
    if args.calibrate:
        print(f"pass_cost (κ of prefers_ghost) on {args.device}/{args.dtype}: {calibrate_pass_cost(args):.1f}")
        return
    # the device memory in use once CUDA is initialised, before any tensor: the context (and any other process's)
    used_at_start = None
    if args.device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info()
        used_at_start = total - free
    timing = time_variants(args)
    memory, allocator = {}, {}
    if not args.no_memory:
        for variant in args.variants:
            if args.device.startswith("cuda"):
                allocator[variant] = cuda_allocator_record(args, variant)
                memory[variant] = allocator[variant]["peak_bytes"]
            else:
                memory[variant] = memory_in_subprocess(args, variant)
    print_table(args, timing, memory)
    for variant, record in allocator.items():
        print(f"{variant}: allocated peak {record['backward']['allocated_peak'] / 2**20:.0f} MiB, reserved peak "
              f"{record['backward']['reserved_peak'] / 2**20:.0f} MiB (forward and backward); the optimizer step adds "
              f"{record['optimizer_step_added'] / 2**20:.0f} MiB; outside the allocator {record['outside_allocator'] / 2**20:.0f} MiB")
    if args.count_ops:
        timing["aten_ops"], by_operator = count_ops(args)
        for kind, ops in timing["aten_ops"].items():
            print(f"ATen ops per step, {kind}" + (" (CUDA's blocks and cost model)" if args.cuda_blocks else "") + ": "
                  + ", ".join(f"{v} {n} ({n / ops['plain']:.2f}x plain)" for v, n in ops.items()))
        print_extra_operators(by_operator)
    if args.json:
        cuda = {"cuda_allocator": allocator, "cuda_used_at_start": used_at_start} if allocator else {}
        write_json(args.json, args, timing, memory, {**cuda, "provenance": output_record(started)})


if __name__ == "__main__":
    main()
