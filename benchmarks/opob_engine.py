"""Step time of VCPO's OPOB + ESS step inside verl's FSDP engine against verl's plain step, same batch.

One random-init Qwen2 in verl 0.9.1's engine (``VcpoFSDPEngineWithLMHead`` on the CPU platform of
``vcpo.verl_plugin.cpu``, its module wrapped with FSDP2 by verl as in training), one actor mini-batch as
the trainer hands it over (``vcpo.verl_plugin.cpu.standalone``), and three optimizer steps through
``engine.train_batch(data, ppo_loss)``:

  plain    method seq_tis_c8: verl's own train_batch (forward, seq-TIS ppo_loss backward, AdamW step),
  ess      method tis_ess:    the same plus the gathered ESS ratio and the scaled learning rate,
  vcpo     method vcpo:       OPOB in one backward (opob_mode=single: PerSequenceGradients per micro-batch,
                              baseline from the gathered norms, combine) plus the ESS step size, with the
                              engine's combination ("split"), and with each other one of ``--combinations``;
  vcpo[two_pass]              OPOB in its memory-safe mode (``--modes``): a norms-only pass, then verl's plain
                              step of the weighted scores.

The behaviour log-probs are the model's own on the batch plus Gaussian noise (``--spread`` per token), so
the sequences' importance weights are spread around 1 as in asynchronous training; with unrelated log-probs
the weights of long responses underflow to 0, OPOB's coefficients are all 0, and "split" has nothing to combine.

The variants run round-robin (each repeat runs all of them, after one warm-up each) and the median
step time of each is printed with its ratio to plain, with the minimum and the median process CPU
time (with one thread, CPU time does not count the time other jobs on a shared machine take the core), and the
median over rounds of each round's CPU-time ratio to plain's step in the same round (paired: steadiest). Remove-padding (packed micro-batches, verl's
default) unless ``--padded``.

glibc's allocator settings decide what the times and the memory mean, so ``--allocator`` restarts the benchmark
under one of them (``vcpo.resident_memory``). ``default``: glibc gives large freed chunks back to the kernel, so each
step page-faults its gradients and OPOB's score buffers afresh (one float32 copy of the model per buffer, up to two
per prompt group), and reuses smaller freed memory unseen, so no peak memory is printed. ``caching``: freed memory is
kept for reuse, as CUDA's caching allocator keeps GPU memory: the times a GPU's allocator would give, no peak memory.
``measuring``: every freed tensor goes back at once, so the resident set follows the live tensors and each variant's
peak resident memory above the step's start is printed (as ``benchmarks/opob_memory.py`` measures it); its times
include a page fault for every page of every allocation.

    python benchmarks/opob_engine.py                      # small model, packed, 1 thread
    python benchmarks/opob_engine.py --model 50m --batch 8 --repeats 5
    python benchmarks/opob_engine.py --padded --repeats 7
    python benchmarks/opob_engine.py --autocast bfloat16   # verl's mixed-precision forward (fp32 weights)
    python benchmarks/opob_engine.py --model 50m --batch 32 --group 4 --modes "" --allocator caching
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from vcpo.actor_memory import OPOB_MODES
from vcpo.core.per_sequence_grads.reductions import COMBINATIONS
from vcpo.provenance import code_state, cpu_name, utc_now
from vcpo.resident_memory import CACHING_ENV, MEASURING_ENV, reset_peak, status_bytes
from vcpo.verl_contract import select_cpu_platform

VARIANTS = {"plain": "seq_tis_c8", "ess": "tis_ess", "vcpo": "vcpo"}
ALLOCATORS = {"default": {}, "caching": CACHING_ENV, "measuring": MEASURING_ENV}
ALLOCATOR_KEYS = {key for settings in ALLOCATORS.values() for key in settings}
# Qwen2 shapes (random init, tied embeddings); "50m" is benchmarks/opob_overhead.py's 50m model.
MODELS = {
    "small": dict(hidden=256, intermediate=768, layers=4, heads=4, kv_heads=2, vocab=4096),
    "50m": dict(hidden=512, intermediate=1536, layers=10, heads=8, kv_heads=2, vocab=32000),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=tuple(MODELS), default="small")
    parser.add_argument("--batch", type=int, default=16, help="sequences per optimizer step (mini-batch)")
    parser.add_argument("--group", type=int, default=4, help="responses per prompt")
    parser.add_argument("--micro", type=int, default=4, help="micro-batch size")
    parser.add_argument("--prompt", type=int, default=64, help="max prompt length")
    parser.add_argument("--response", type=int, default=192, help="max response length")
    parser.add_argument("--min-response", type=int, default=128, help="min response length")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--padded", action="store_true", help="padded micro-batches (use_remove_padding=False)")
    parser.add_argument("--autocast", choices=("bfloat16",), help="forward and backward under torch.autocast")
    parser.add_argument("--spread", type=float, default=0.05,
                        help="SD of the per-token noise between the behaviour's and the model's log-probs")
    parser.add_argument("--combinations", default="buffers",
                        help="other OPOB combinations to time beside the engine's, comma-separated ('' for none)")
    parser.add_argument("--modes", default="two_pass", help="OPOB modes to time beside single, comma-separated ('' for none)")
    parser.add_argument("--allocator", choices=tuple(ALLOCATORS), default="default",
                        help="glibc's settings: caching keeps freed memory for reuse (GPU-like times), measuring returns it "
                             "at once (peak memory printed)")
    args = parser.parse_args(argv)
    for name, value in MODELS[args.model].items():
        setattr(args, name, value)
    return args


def first(value):
    """A metric's value: verl logs some as one-element lists."""
    return value[0] if isinstance(value, list) else value


def near_policy_log_probs(model_dir, raw, spread: float, seed: int = 0) -> torch.Tensor:
    """The model's log-probs of the batch's response tokens, (batch, response), plus N(0, spread²) per token."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(raw.input_ids, attention_mask=raw.attention, position_ids=raw.position_ids).logits
    log_probs = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, raw.input_ids[:, 1:, None]).squeeze(-1)
    response = log_probs[:, raw.prompt_width - 1 :]
    noise = torch.randn(response.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return response + spread * noise


def allocator() -> str:
    """The allocator settings this process was started with ("custom": none of ALLOCATORS)."""
    for name, settings in ALLOCATORS.items():
        if all(os.environ.get(key) == value for key, value in settings.items()) and not (ALLOCATOR_KEYS - set(settings)) & set(os.environ):
            return name
    return "custom"


def main(argv=None) -> dict[str, float]:
    args = parse_args(argv)
    if allocator() != args.allocator:  # glibc reads its settings when the process starts
        arguments = sys.argv[1:] if argv is None else list(argv)
        environment = {key: value for key, value in os.environ.items() if key not in ALLOCATOR_KEYS}
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *arguments],
                  {**environment, **ALLOCATORS[args.allocator]})
    torch.set_num_threads(args.threads)
    select_cpu_platform()
    from verl.workers.utils.losses import ppo_loss

    import vcpo.verl_plugin  # noqa: F401  (registers the losses)
    from vcpo.verl_plugin.cpu import standalone as cpu

    workdir = tempfile.mkdtemp(prefix="opob_engine_")
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.FileStore(f"{workdir}/store", 1), rank=0, world_size=1)
    model_dir = cpu.save_random_qwen2(
        f"{workdir}/model",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
    )
    remove_padding = not args.padded
    def loss(method: str, opob_mode: str = "single"):
        return functools.partial(ppo_loss, config=cpu.actor_config(method, args.batch, args.group, args.micro, opob_mode=opob_mode))

    losses = {name: loss(method) for name, method in VARIANTS.items()}
    engine = cpu.build_engine(model_dir, remove_padding, lr=1e-6)
    if args.autocast:  # verl's forward_step then runs the model under torch.autocast, as on GPUs
        engine._autocast_dtype = getattr(torch, args.autocast)
    combination_of = {name: engine.opob_combination for name in VARIANTS}
    for combination in filter(None, args.combinations.split(",")):
        if combination not in COMBINATIONS:
            raise SystemExit(f"--combinations: {combination!r} is not one of {COMBINATIONS}")
        if combination != engine.opob_combination:
            losses[f"vcpo[{combination}]"] = losses["vcpo"]
            combination_of[f"vcpo[{combination}]"] = combination
    for mode in filter(None, args.modes.split(",")):
        if mode not in OPOB_MODES or mode == "single":
            raise SystemExit(f"--modes: {mode!r} is not one of {OPOB_MODES[1:]}")
        losses[f"vcpo[{mode}]"] = loss("vcpo", mode)
        combination_of[f"vcpo[{mode}]"] = engine.opob_combination
    names = list(losses)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu_times: dict[str, list[float]] = {name: [] for name in names}
    peaks: dict[str, list[int]] = {name: [] for name in names}
    metrics = {}

    shape = (args.batch, args.group, args.prompt, args.response, args.vocab, remove_padding, args.micro)
    _, raw = cpu.actor_batch(*shape, min_response=args.min_response)
    behaviour = near_policy_log_probs(model_dir, raw, args.spread)

    def step(name: str) -> tuple[float, float, int]:
        engine.opob_combination = combination_of[name]
        td, _ = cpu.actor_batch(*shape, dtype=torch.float32, min_response=args.min_response, behaviour_log_probs=behaviour)
        resident = reset_peak()
        started, started_cpu = time.perf_counter(), time.process_time()
        out = engine.train_batch(td, losses[name])
        elapsed, elapsed_cpu = time.perf_counter() - started, time.process_time() - started_cpu
        metrics[name] = out["metrics"]
        return elapsed, elapsed_cpu, status_bytes("VmHWM") - resident

    for name in names:
        step(name)  # warm-up
    for _ in range(args.repeats):
        for name in names:
            wall, used, peak = step(name)
            times[name].append(wall)
            cpu_times[name].append(used)
            peaks[name].append(peak)
    tokens = args.batch * (args.prompt + args.response)
    medians = {name: statistics.median(values) for name, values in times.items()}
    minima = {name: min(values) for name, values in times.items()}
    cpu_medians = {name: statistics.median(values) for name, values in cpu_times.items()}
    state = code_state()
    print(f"commit {state['commit']} (dirty: {state['dirty']}), {cpu_name()}, {os.cpu_count()} cores, finished {utc_now()}")
    print(
        f"model hidden={args.hidden} layers={args.layers} vocab={args.vocab}, batch={args.batch} in {args.batch // args.group} "
        f"groups, micro={args.micro}, "
        f"prompt 2-{args.prompt} + response {args.min_response}-{args.response} tokens (<= {tokens} in all), {'packed' if remove_padding else 'padded'}, float32{' autocast ' + args.autocast if args.autocast else ''}, {args.threads} thread(s), "
        f"median of {args.repeats}, glibc allocator settings: {allocator()}"
    )
    # each round's step against plain's step of the same round, the median over rounds: drifts in the machine's
    # speed over the run (seen here at +-15% between rounds of an idle VM) cancel out of each ratio
    paired = {name: statistics.median(v / p for v, p in zip(cpu_times[name], cpu_times["plain"], strict=True))
              for name in names}
    for name in names:
        print(
            f"  {name:14s} median {medians[name] * 1e3:8.1f} ms  x{medians[name] / medians['plain']:.3f}"
            f"   min {minima[name] * 1e3:8.1f} ms  x{minima[name] / minima['plain']:.3f}"
            f"   process CPU {cpu_medians[name] * 1e3:8.1f} ms  x{cpu_medians[name] / cpu_medians['plain']:.3f}"
            f"   paired x{paired[name]:.3f}"
        )
    if allocator() == "measuring":
        copy = 4 * sum(p.numel() for p in engine.module.parameters())
        print("  peak resident memory above the step's start, median over rounds, in float32 copies of the model C = "
              f"{copy / 2**20:.1f} MiB: " + ", ".join(f"{name} {statistics.median(peaks[name]) / copy:.1f} C" for name in names))
    packed = first(metrics["vcpo"].get("actor/opob_packed", 0.0))
    print(
        f"  vcpo/plain = {medians['vcpo'] / medians['plain']:.3f} (median), {minima['vcpo'] / minima['plain']:.3f} (min), "
        f"{cpu_medians['vcpo'] / cpu_medians['plain']:.3f} (process CPU time), {paired['vcpo']:.3f} (paired by round); "
        f"OPOB micro-batches packed: {bool(packed)}; vcpo combines with {combination_of['vcpo']!r}"
    )
    vcpo = metrics["vcpo"]
    print(f"  vcpo's last step: sequence ESS ratio {first(vcpo.get('rollout_corr/seq_ess_ratio'))}, "
          f"gradient norm {first(vcpo.get('grad_norm'))}, OPOB baseline {first(vcpo.get('actor/opob_baseline'))}")
    return {name: medians[name] / medians["plain"] for name in names}


if __name__ == "__main__":
    main()
