"""The memory model's CPU terms against a measured step where CPUs can run it: verl's FSDP2 engine over 2 gloo ranks in
bf16 (mixed precision: float32 weights and moments sharded, bf16 compute under autocast) and verl's Megatron engine at
TP 2 on gloo (bf16 with float32 main parameters, OPOB's local layers), at two model sizes, plain and OPOB steps.

    python benchmarks/memory_model_check.py --out tables/memory_model_check     # 2 engines x 2 models x 3 steps
    python benchmarks/memory_model_check.py --engines fsdp2 --models small --kinds plain,two_pass

Each point is one ``torch.distributed.run`` job of 2 ranks running this file with ``--point``: every rank builds the
engine (`vcpo.verl_plugin.cpu.standalone`), runs a warm-up plain step (Adam's moments), frees its gradient as verl's
next step does, then runs the measured step. A rank's measured number is its peak resident memory in the step
(VmHWM, reset just before it) minus its resident memory before it, glibc's mmap threshold fixed
(`vcpo.resident_memory.MEASURING_ENV`) so that a freed tensor leaves the resident set at once. Its projection is
`vcpo.actor_memory.step_memory(...).step(kind)` for the shape, layout and step the engine itself hands its memory
model (``_memory_inputs``), on a CPU layout; the GPU-only terms of the same model on a GPU layout (CUDA context,
cuBLAS and NCCL, the fragmentation margin) are listed apart and not compared.

What a CPU cannot check, and what on a GPU would (`benchmarks/gpu_check.py`, one plain and one OPOB step at its
largest shape): the caching allocator's fragmentation (``torch.cuda.max_memory_reserved`` over
``max_memory_allocated``); the CUDA context, cuBLAS and NCCL (``torch.cuda.mem_get_info`` before any tensor and after
the first step, less what is allocated); flash attention and flash-attn's cross-entropy (CUDA kernels: the CPU runs
SDPA with a mask and verl's log-softmax); torch's fused CUDA RMSNorm (it keeps less than the CPU's composite, which
the model counts); the weight sync's cupy buckets; foreach AdamW's square roots (torch picks foreach for CUDA tensors
only, so a CPU step forms them one parameter at a time).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from vcpo.cli import shrink_problem
from vcpo.lifetimes import dies_with_this_thread
from vcpo.locks import write_atomic
from vcpo.provenance import library_versions, output_record, utc_now
from vcpo.resident_memory import MEASURING_ENV, reset_peak, status_bytes

MODELS = {  # Qwen2 shapes (random init), as benchmarks/opob_memory.py's
    "small": dict(hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=4096),
    "50m": dict(hidden_size=512, intermediate_size=1536, num_layers=10, num_heads=8, num_kv_heads=2, vocab_size=32000),
}
ENGINES = ("fsdp2", "megatron")
KINDS = {"plain": ("seq_tis_c8", "auto"), "single": ("vcpo", "single"), "two_pass": ("vcpo", "two_pass")}
RANKS = 2  # FSDP2 shards over both; megatron splits each layer over both (TP 2)
BF16_MIXED_PRECISION = {"param_dtype": "bf16", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}  # verl's default
TOLERANCE = 0.15  # the criterion: the projection within 15% of the measured step, on every rank
POINT_TIMEOUT_S = 3600


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--models", default="small,50m")
    parser.add_argument("--kinds", default="plain,two_pass,single")
    parser.add_argument("--batch", type=int, default=16, help="sequences in the step, over both ranks")
    parser.add_argument("--group", type=int, default=4, help="sequences per prompt group")
    parser.add_argument("--micro", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens, every sequence")
    parser.add_argument("--response", type=int, default=160, help="response tokens, every sequence")
    parser.add_argument("--out", type=Path, help="write results.json and results.md here")
    parser.add_argument("--point", nargs=4, metavar=("ENGINE", "MODEL", "KIND", "RESULT"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def build(engine_name: str, model_dir: Path):
    """verl's engine of ``engine_name`` on this process group, bf16, as `vcpo.verl_plugin.cpu.standalone` builds it."""
    # verl and torch load only in a point's ranks, after the CPU platform is selected
    from vcpo.verl_contract import ENGINE_MODEL_TYPE
    from vcpo.verl_plugin.cpu import standalone

    if engine_name == "megatron":  # vcpo's Megatron engine (the one OPOB runs in), as tests/verl_megatron_vcpo_worker.py builds it
        return standalone.build_megatron_engine(model_dir, tensor_parallel=RANKS, lr=1e-6, model_type=ENGINE_MODEL_TYPE)
    return standalone.build_engine(model_dir, remove_padding=True, lr=1e-6, mixed_precision=BF16_MIXED_PRECISION)


def memory_inputs(engine, td, raw, rows):
    """(shape, layout, step) as the engine hands them to its memory model, for this rank's rows: its
    ``_memory_inputs`` reads the OPOB fields prepare_opob sets, here the rows' rewards and prompt groups."""
    probe = td.clone()
    probe["vcpo_reward"], probe["vcpo_group"] = raw.rewards[rows].double(), raw.groups[rows]
    return engine._memory_inputs(probe)


def measure_rank(args: argparse.Namespace, engine_name: str, model: str, kind: str) -> dict:
    """This rank's step: measured and projected (module doc)."""
    # torch and verl load only in a point's ranks, verl after the CPU platform is selected
    import torch
    import torch.distributed as dist

    from vcpo.verl_contract import select_cpu_platform

    torch.set_num_threads(1)
    select_cpu_platform()
    from verl.workers.utils.losses import ppo_loss

    import vcpo.verl_plugin  # noqa: F401  (registers the losses)
    from vcpo.actor_memory import step_memory
    from vcpo.verl_plugin.cpu import standalone

    dist.init_process_group("gloo")
    folder = Path(args.point[3]).parent / f"{engine_name}_{model}_model"
    if dist.get_rank() == 0:
        standalone.save_random_qwen2(folder, **MODELS[model])
    dist.barrier()
    engine = build(engine_name, folder)
    dp, dp_rank = engine.get_data_parallel_size(), engine.get_data_parallel_rank()
    rows = slice(dp_rank * args.batch // dp, (dp_rank + 1) * args.batch // dp)
    batch = (args.batch, args.group, args.prompt, args.response, MODELS[model]["vocab_size"], engine_name == "fsdp2", args.micro)
    megatron = engine if engine_name == "megatron" else None

    def loss(kind_name: str):
        method, mode = KINDS[kind_name]
        config = standalone.actor_config(method, args.batch, args.group, args.micro, megatron_engine=megatron, opob_mode=mode)
        return functools.partial(ppo_loss, config=config)

    # behaviour log-probs of the random model's near-uniform policy: sequence weights near 1, so that every sequence
    # has nonzero coefficients and the single step opens its buffers (actor_batch's far off-policy default underflows
    # every weight of a long response to 0, and the step then forms no buffer at all)
    near_policy = torch.full((args.batch, args.response), -math.log(MODELS[model]["vocab_size"]), dtype=torch.float64)
    sequences = dict(dtype=torch.float32, rows=rows, min_prompt=args.prompt, min_response=args.response,
                     behaviour_log_probs=near_policy)
    td, raw = standalone.actor_batch(*batch, **sequences)
    with engine.train_mode():
        engine.train_batch(td, loss("plain"))  # Adam's moments
    td, raw = standalone.actor_batch(*batch, seed=2, **sequences)
    shape, layout, step = memory_inputs(engine, td, raw, rows)
    engine.optimizer_zero_grad()  # as the step does first: the baseline holds what stays between steps
    before = reset_peak()
    with engine.train_mode():
        engine.train_batch(td, loss(kind))
    measured = status_bytes("VmHWM") - before
    memory = step_memory(shape, replace(layout, device="cpu"), step)
    on_gpu = step_memory(shape, replace(layout, device="cuda"), step)
    gpu_only = {**on_gpu.outside_allocator, "fragmentation margin": on_gpu.fragmentation * on_gpu.allocated(kind)}
    return {"rank": dist.get_rank(), "measured_bytes": measured, "projected_bytes": memory.step(kind),
            "projected_terms": getattr(memory, kind), "gpu_only_terms": gpu_only, "parameters": shape.parameters,
            "tokens_per_micro_batch": step.tokens_per_micro_batch, "buffers": step.buffers,
            "layout": {"strategy": layout.strategy, "data_parallel": layout.data_parallel,
                       "tensor_parallel": layout.tensor_parallel, "attention": layout.attention}}


def run_point(engine_name: str, model: str, kind: str, argv: list[str], workdir: Path) -> dict:
    """One point: a 2-rank job of this file; every rank's result, gathered by rank 0 into one file."""
    result = workdir / f"{engine_name}_{model}_{kind}.json"
    with socket.socket() as probe:  # a free port for the job's rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(RANKS), "--master_port", str(port),
               __file__, *argv, "--point", engine_name, model, kind, str(result)]
    done = subprocess.run(command, env={**os.environ, **MEASURING_ENV}, capture_output=True, text=True, check=False,
                          timeout=POINT_TIMEOUT_S, preexec_fn=dies_with_this_thread)
    if done.returncode or not result.exists():
        raise SystemExit(f"point {engine_name} {model} {kind} failed:\n{done.stderr[-3000:]}")
    return {"engine": engine_name, "model": model, "kind": kind, "ranks": json.loads(result.read_text())}


def worst(rows: list[dict]) -> float:
    """The largest |projected / measured - 1| over every rank of ``rows``."""
    return max(abs(rank["projected_bytes"] / rank["measured_bytes"] - 1) for row in rows for rank in row["ranks"])


def table(rows: list[dict]) -> str:
    lines = ["| engine | model | step | rank | measured MB | projected MB | projected / measured | GPU-only terms, MB (not compared) |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for row in rows:
        for rank in row["ranks"]:
            gpu = ", ".join(f"{name} {size / 1e6:.0f}" for name, size in rank["gpu_only_terms"].items())
            lines.append(f"| {row['engine']} | {row['model']} | {row['kind']} | {rank['rank']} | {rank['measured_bytes'] / 1e6:.1f} | "
                         f"{rank['projected_bytes'] / 1e6:.1f} | {rank['projected_bytes'] / rank['measured_bytes']:.3f} | {gpu} |")
    return "\n".join(lines)


def point_name(point: dict) -> str:
    """A measured point (a row of results.json) by its engine, model and step."""
    return f"{point['engine']} {point['model']} {point['kind']}"


def main(argv=None) -> None:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw_argv)
    if args.point:
        import torch.distributed as dist  # a point's ranks only

        engine_name, model, kind, result = args.point
        ranks = [None] * RANKS
        mine = measure_rank(args, engine_name, model, kind)
        dist.all_gather_object(ranks, mine)
        if dist.get_rank() == 0:
            write_atomic(Path(result), json.dumps(ranks))
        dist.destroy_process_group()
        return
    points = [{"engine": engine, "model": model, "kind": kind} for engine in args.engines.split(",")
              for model in args.models.split(",") for kind in args.kinds.split(",")]
    if args.out and (earlier := args.out / "results.json").exists() and (problem := shrink_problem(
            earlier, dict.fromkeys(map(point_name, json.loads(earlier.read_text())["rows"]), 1),
            dict.fromkeys(map(point_name, points), 1), "pass --out for a folder of your own", rows="points")):
        sys.exit(f"error: {problem}")
    point_argv = [a for i, a in enumerate(raw_argv) if a != "--out" and (i == 0 or raw_argv[i - 1] != "--out")]
    started, rows = utc_now(), []
    with tempfile.TemporaryDirectory(prefix="memory_model_check_") as workdir:
        for point in points:
            row = run_point(point["engine"], point["model"], point["kind"], point_argv, Path(workdir))
            rows.append(row)
            print(f"{point['engine']:8s} {point['model']:6s} {point['kind']:8s} " + "  ".join(
                f"rank {r['rank']}: measured {r['measured_bytes'] / 1e6:.1f} MB, projected {r['projected_bytes'] / 1e6:.1f} MB"
                for r in row["ranks"]), flush=True)
    print(table(rows))
    largest = worst(rows)
    print(f"largest |projected / measured - 1|: {largest:.3f} (criterion: <= {TOLERANCE})")
    if args.out:
        write_results(args, raw_argv, started, rows, largest)


def write_results(args: argparse.Namespace, raw_argv: list[str], started: str, rows: list[dict], largest: float) -> None:
    """results.json (the rows and what produced them) and results.md (the table, and what a CPU cannot check) in --out."""
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"command": "python benchmarks/memory_model_check.py " + " ".join(raw_argv), **output_record(started),
              "cores": os.cpu_count(), "versions": library_versions(), "largest_relative_error": largest, "rows": rows,
              "settings": {name: value for name, value in vars(args).items() if name not in ("out", "point")}}
    write_atomic(args.out / "results.json", json.dumps(record, indent=1))
    cannot = __doc__.split("\n\n")[-1].strip()
    write_atomic(args.out / "results.md", "\n\n".join([
        "# The memory model's CPU terms against measured steps",
        f"`{record['command']}`, {record['start']} to {record['finish']}, commit {record['commit']} (dirty: {record['dirty']}), "
        f"{record['cpu']}, {record['cores']} cores.", table(rows),
        f"Largest |projected / measured - 1|: {largest:.3f} (criterion: <= {TOLERANCE}).", cannot]) + "\n")


if __name__ == "__main__":
    main()
