"""Peak memory of one actor step inside verl's FSDP engine on CPU, measured, beside the memory model's projection.

Each point runs in a fresh process: a random Qwen2 in verl 0.9.1's engine (``vcpo.verl_plugin.cpu.standalone``,
FSDP2 over one gloo rank, float32), one warm-up step of plain seq-TIS (so that Adam's moments exist), then the
measured step: plain seq-TIS, or VCPO with OPOB in mode single or two_pass, over ``--batch`` packed sequences in G
prompt groups. The measured number is the step's peak resident memory (VmHWM, reset just before the step through
/proc/self/clear_refs) minus the resident memory before it, the warm-up's gradient freed (as the step frees it), with glibc's mmap threshold fixed
(``MALLOC_MMAP_THRESHOLD_``) so that a freed tensor leaves the resident set at once. The projection is
`vcpo.actor_memory.step_memory(...).step(kind)` for the same model, layout, largest micro-batch
and the split buffers the batch's rewards open.

    python benchmarks/opob_memory.py --out tables/opob_memory          # both models, G = 1 .. 32, ~10 min
    python benchmarks/opob_memory.py --models small --groups 1,8
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vcpo.cli import shrink_problem
from vcpo.lifetimes import dies_with_this_thread
from vcpo.locks import write_atomic
from vcpo.resident_memory import MEASURING_ENV, reset_peak, status_bytes

MODELS = {  # Qwen2 shapes (random init, tied embeddings), as benchmarks/opob_engine.py's
    "small": dict(hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=4096),
    "50m": dict(hidden_size=512, intermediate_size=1536, num_layers=10, num_heads=8, num_kv_heads=2, vocab_size=32000),
}
KINDS = {"plain": ("seq_tis_c8", "auto"), "single": ("vcpo", "single"), "two_pass": ("vcpo", "two_pass")}
TOLERANCE = 0.15  # the criterion: the projection within 15% of the measured step
POINT_TIMEOUT_S = 1800  # a point takes minutes; a hung one fails the run by name


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="small,50m")
    parser.add_argument("--groups", default="1,2,4,8,16,32", help="prompt groups in the step (batch / group size)")
    parser.add_argument("--kinds", default="plain,single,two_pass")
    parser.add_argument("--batch", type=int, default=32, help="sequences in the step")
    parser.add_argument("--micro", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=160)
    parser.add_argument("--min-response", type=int, default=160,
                        help="shortest response (default: every sequence as long, so every micro-batch holds as many tokens)")
    parser.add_argument("--out", type=Path, help="write results.json and results.md here")
    parser.add_argument("--point", nargs=3, metavar=("MODEL", "KIND", "GROUPS"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def measure_point(args: argparse.Namespace, model: str, kind: str, groups: int) -> dict:
    """One point, in this (fresh) process."""
    import torch
    import torch.distributed as dist

    from vcpo.verl_contract import select_cpu_platform

    torch.set_num_threads(1)
    select_cpu_platform()
    from verl.workers.utils.losses import ppo_loss

    import vcpo.verl_plugin  # noqa: F401  (registers the losses)
    from vcpo.actor_memory import (
        Layout,
        ModelShape,
        StepShape,
        hf_attention,
        split_buffers,
        step_memory,
    )
    from vcpo.core.per_sequence_grads.reductions import DEFAULT_BLOCK_BYTES
    from vcpo.verl_plugin.cpu import standalone as cpu

    workdir = tempfile.mkdtemp(prefix="opob_memory_")
    dist.init_process_group("gloo", store=dist.FileStore(f"{workdir}/store", 1), rank=0, world_size=1)
    model_dir = cpu.save_random_qwen2(f"{workdir}/model", **MODELS[model])
    group_size = args.batch // groups
    shape = (args.batch, group_size, args.prompt, args.response, MODELS[model]["vocab_size"], True, args.micro)
    engine = cpu.build_engine(model_dir, remove_padding=True, lr=1e-6)

    def loss(kind_name: str):
        method, mode = KINDS[kind_name]
        return functools.partial(ppo_loss, config=cpu.actor_config(method, args.batch, group_size, args.micro, opob_mode=mode))

    td, raw = cpu.actor_batch(*shape, dtype=torch.float32, min_response=args.min_response, min_prompt=args.prompt)
    # near-policy weights: the behaviour log-probs are the model's own (OPOB's coefficients are not all 0)
    with torch.no_grad():
        logits = engine.module(input_ids=raw.input_ids, attention_mask=raw.attention, position_ids=raw.position_ids).logits
        own = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, raw.input_ids[:, 1:, None]).squeeze(-1)
        del logits
    behaviour = own[:, raw.prompt_width - 1 :]
    engine.train_batch(td, loss("plain"))  # Adam's moments
    td, raw = cpu.actor_batch(*shape, dtype=torch.float32, min_response=args.min_response, behaviour_log_probs=behaviour,
                           min_prompt=args.prompt)
    # verl's step frees the last step's gradient before its forward (`optimizer_zero_grad`) and makes a new one:
    # freed here, so that the baseline holds what stays between steps (parameters, Adam's moments) and the
    # measured step holds its gradient, as the model's step does
    engine.optimizer_zero_grad()
    before = reset_peak()
    started = time.perf_counter()
    out = engine.train_batch(td, loss(kind))
    seconds = time.perf_counter() - started
    peak = status_bytes("VmHWM")

    lengths = raw.attention.sum(-1)
    tokens = max(int(lengths[start : start + args.micro].sum()) for start in range(0, args.batch, args.micro))
    buffers = split_buffers(raw.rewards, raw.groups)
    before_last = split_buffers(raw.rewards[: args.batch - args.micro], raw.groups[: args.batch - args.micro])
    parameters = sum(p.numel() for p in engine.module.parameters())
    model_shape = ModelShape.from_config(engine.model_config.hf_config)
    layout = Layout(strategy="fsdp2", data_parallel=1, param_bytes=4, compute_bytes=4, gradient_checkpointing=False,
                    attention=hf_attention(next(engine.module.parameters()).device.type, engine.module.config._attn_implementation,
                                           packed=engine.use_remove_padding))
    memory = step_memory(model_shape, layout, StepShape(tokens_per_micro_batch=tokens, buffers=buffers, block_bytes=DEFAULT_BLOCK_BYTES["cpu"],
                                                         buffers_before_last=before_last))
    two_pass = out["metrics"].get("actor/opob_two_pass")
    return {
        "model": model, "kind": kind, "groups": groups, "parameters": parameters,
        "parameters_from_shape": model_shape.parameters, "copy_bytes": parameters * 4,
        "buffers": buffers, "tokens_per_micro_batch": tokens, "tokens": int(raw.attention.sum()),
        "measured_bytes": peak - before, "projected_bytes": memory.step(kind),
        "projected_terms": getattr(memory, kind), "seconds": seconds,
        "ran_two_pass": None if two_pass is None else bool(two_pass[0]),
    }


def points(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """(model, kind, groups) of every point, in the order they run (the plain step once per model: it does not depend
    on the groups)."""
    first_groups = int(args.groups.split(",")[0])
    return [(model, kind, groups) for model in args.models.split(",") for groups in map(int, args.groups.split(","))
            for kind in args.kinds.split(",") if kind != "plain" or groups == first_groups]


def point_names(rows: list[dict]) -> dict[str, int]:
    return {f"{row['model']} {row['kind']} G={row['groups']}": 1 for row in rows}


def run_point(model: str, kind: str, groups: int, argv: list[str]) -> dict:
    env = {**os.environ, **MEASURING_ENV}
    done = subprocess.run([sys.executable, __file__, *argv, "--point", model, kind, str(groups)], env=env,
                          capture_output=True, text=True, check=False, timeout=POINT_TIMEOUT_S, preexec_fn=dies_with_this_thread)
    if done.returncode:
        raise SystemExit(f"point {model} {kind} G={groups} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def with_extras(rows: list[dict]) -> list[dict]:
    """Each OPOB row's extra over its model's plain step, measured and projected: the part the OPOB terms model."""
    plain = {row["model"]: row for row in rows if row["kind"] == "plain"}
    for row in rows:
        base = plain.get(row["model"])
        if row["kind"] != "plain" and base is not None:
            row["measured_extra_bytes"] = row["measured_bytes"] - base["measured_bytes"]
            row["projected_extra_bytes"] = row["projected_bytes"] - base["projected_bytes"]
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | step | G | buffers | measured (C) | projected (C) | projected / measured | "
             "extra over plain, measured (C) | projected (C) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        copy = row["copy_bytes"]
        extra = (f"{row['measured_extra_bytes'] / copy:.2f} | {row['projected_extra_bytes'] / copy:.2f}"
                 if "measured_extra_bytes" in row else " | ")
        lines.append(f"| {row['model']} | {row['kind']} | {row['groups']} | {row['buffers'] if row['kind'] == 'single' else ''} | "
                     f"{row['measured_bytes'] / copy:.2f} | {row['projected_bytes'] / copy:.2f} | "
                     f"{row['projected_bytes'] / row['measured_bytes']:.3f} | {extra} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw_argv)
    if args.point:
        model, kind, groups = args.point
        print(json.dumps(measure_point(args, model, kind, int(groups))))
        return []
    point_argv = list(raw_argv)
    if "--out" in point_argv:  # the points write nothing
        del point_argv[point_argv.index("--out") : point_argv.index("--out") + 2]
    from vcpo.provenance import code_state, cpu_name, library_versions, utc_now

    if args.out and (args.out / "results.json").exists() and (problem := shrink_problem(
            args.out / "results.json", point_names(json.loads((args.out / "results.json").read_text())["rows"]),
            point_names([{"model": model, "kind": kind, "groups": groups} for model, kind, groups in points(args)]),
            "pass --out for a folder of your own", rows="points")):
        sys.exit(f"error: {problem}")
    started = utc_now()
    rows = []
    for model, kind, groups in points(args):
        row = run_point(model, kind, groups, point_argv)
        rows.append(row)
        print(f"{model:6s} {kind:8s} G={groups:3d} buffers={row['buffers']:3d}  measured "
              f"{row['measured_bytes'] / row['copy_bytes']:6.2f} C  projected {row['projected_bytes'] / row['copy_bytes']:6.2f} C"
              f"  ratio {row['projected_bytes'] / row['measured_bytes']:.3f}  ({row['seconds']:.1f} s)", flush=True)
    rows = with_extras(rows)
    worst = {kind: max(abs(row["projected_bytes"] / row["measured_bytes"] - 1) for row in rows if row["kind"] == kind)
             for kind in dict.fromkeys(row["kind"] for row in rows)}
    print(table(rows))
    print("largest |projected / measured - 1| by step: " + ", ".join(f"{k} {v:.3f}" for k, v in worst.items())
          + f" (criterion: <= {TOLERANCE})")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        record = {"command": "python benchmarks/opob_memory.py " + " ".join(raw_argv), "started": started,
                  "finished": utc_now(), **code_state(), "cpu": cpu_name(), "cores": os.cpu_count(),
                  "versions": library_versions(), "settings": {k: v for k, v in vars(args).items() if k not in ("out", "point")},
                  "largest_relative_error": worst, "rows": rows}
        write_atomic(args.out / "results.json", json.dumps(record, indent=1))
        write_atomic(args.out / "results.md",
            f"# OPOB step memory on CPU: measured and projected\n\n`{record['command']}`, {started} to {record['finished']}, "
            f"commit {record['commit']} (dirty: {record['dirty']}), {record['cpu']}, {record['cores']} cores.\n\n"
            f"C = one float32 copy of the model. Measured: the step's peak resident memory above the resident memory "
            f"before it. Projected: `step_memory(...).step(kind)`.\n\n{table(rows)}\n\n"
            "Largest |projected / measured − 1| by step: " + ", ".join(f"{k} {v:.3f}" for k, v in worst.items()) + ".\n")
    return rows


if __name__ == "__main__":
    main()
