"""The GPU check in one command: what the GPU numbers of docs/per_sequence_gradients.md are filled from.

    python benchmarks/gpu_check.py --out gpu_check/          # one CUDA GPU, about 10 minutes

Its parts, each in its own process, each logged under OUT and summarised in OUT/gpu_check.json (with the commit,
the start and finish and the host's CPU, which OUT/provenance.json states for every file of the folder):
  overhead    benchmarks/opob_overhead.py on a 0.5B Qwen2 (Qwen2-0.5B shapes, random weights) in bf16 at
              T = 2048: step time, peak memory and ATen operators dispatched of the single-backward OPOB step
              (the engine's: split combination, a baseline per group),
              of the memory-safe two-pass step (norms only, then a plain backward), of one trajectory per
              micro-batch (the authors' release) and of the naive two-backward step, each against a plain
              backward (target: OPOB <= 1.10x plain; the paper's Megatron implementation measured 1.19x);
  blocks      the same OPOB step at L2-sized blocks (16 MiB, any row count) against the overhead part's
              at the default (128 MiB, rows a multiple of 64), and one profiled step at the default (OUT/profile.log);
  calibrate   the cost model's machine balance on this GPU (opob_overhead.py --calibrate; the engine's
              CUDA default, DEFAULT_PASS_COST["cuda"], is an H200 measurement: tables/gpu_check/);
  exactness   the PerSequenceGradients exactness tests on this device (VCPO_TEST_DEVICE): float64 and
              float32 against the per-sequence backward loop, packed micro-batches, bf16/fp16 within 4x
              of autograd's own error;
  memory      one plain and one OPOB step of the overhead part's shape under the caching allocator's expandable
              segments (as verl's trainer sets them), each against the memory model's terms a CPU cannot check
              (vcpo.actor_memory): the reserved peak over the allocated peak against FRAGMENTATION_MARGIN, the device
              memory outside the allocator against CUDA_OVERHEAD_BYTES, and what the optimizer step adds against
              foreach AdamW's square roots (`optimizer_temporaries`); the allocated peaks themselves are the bare
              step's, not verl's engine's, whose projection benchmarks/memory_model_check.py checks on CPU;
  megatron    benchmarks/megatron_overhead.py: OPOB inside megatron-core's layers (MegatronSequenceNorms) on
              a 0.5B-like megatron GPT in bf16 with the layers OPOB trains on Megatron (the local spec, core
              attention recomputed, TP 1, one sequence per micro-batch), both modes' step time against a plain
              backward (the paper's Megatron implementation: 1.19x) and their norms against one backward per
              sequence. megatron-core comes from the machine, else from the wheel in ``--wheels`` (default .whl,
              which git ignores and the device tool carries: ``pip download --no-deps megatron-core==0.16.1
              --python-version 3.12 --platform manylinux_2_28_x86_64 --only-binary=:all: -d .whl``, 2.6 MB);
              skipped, and said so, where neither has it.
Needs torch, transformers and pytest (``pip install -e ".[test]"``); not verl, vLLM or Ray.
``--device cpu --model 0.1m --seq-len 64`` runs the same parts on a CPU in a minute (the test does).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from vcpo.actor_memory import CUDA_OVERHEAD_BYTES, FRAGMENTATION_MARGIN, optimizer_temporaries
from vcpo.cli import shrink_problem
from vcpo.provenance import FOLDER_RECORD, output_record, utc_now

REPO = Path(__file__).resolve().parents[1]
L2_SIZED_BLOCK_MB = 16  # a third of an H100's L2, where a block's passes stay in cache
EXACTNESS_TESTS = [
    "tests/test_per_sequence_grads.py",
    "tests/test_per_sequence_grads_packed.py",
    "tests/test_per_sequence_grads_mixed_precision.py",
]
# The tests of those files that build everything from the model and batch helpers (so they follow
# VCPO_TEST_DEVICE); the others check argument errors and pure functions on CPU tensors.
EXACTNESS_SELECTION = "matches_per_sequence_loop or other_loss_aggregations or packed_matches or packed_equals_padded or autograds_own_error"
PARTS = ("overhead", "blocks", "calibrate", "exactness", "memory", "megatron")
TIMED_PARTS = ("overhead", "blocks", "megatron")  # each times --repeats steps
EXPANDABLE_SEGMENTS = "expandable_segments:True"  # the caching allocator's setting verl's trainer runs under


def run_part(name: str, command: list[str], out: Path, timeout_s: int, env: dict | None = None) -> dict:
    """Run one part, its output to OUT/<name>.log; returns its exit status and seconds."""
    started = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        try:
            result = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, env=env)
            status = result.returncode
        except subprocess.TimeoutExpired:
            status = "timeout"
    seconds = time.perf_counter() - started
    print(f"{name}: exit {status} in {seconds:.0f} s (log {out / f'{name}.log'})", flush=True)
    return {"command": command, "exit": status, "seconds": seconds}


def engine_step(args: argparse.Namespace) -> list[str]:
    """benchmarks/opob_overhead.py on the engine's step (split combination, a baseline per group), bf16."""
    return [sys.executable, "benchmarks/opob_overhead.py", "--model", args.model, "--device", args.device,
            "--dtype", "bfloat16", "--seq-len", str(args.seq_len), "--combination", "split", "--grouped"]  # fmt: skip


def overhead(args: argparse.Namespace, out: Path) -> dict:
    result_file = out / "overhead.json"
    command = [*engine_step(args), "--repeats", str(args.repeats), "--count-ops", "--json", str(result_file)]
    if not args.device.startswith("cuda"):  # a CPU's peaks take a process per variant; the memory part measures two
        command.append("--no-memory")
    part = run_part("overhead", command, out, args.part_timeout)
    if result_file.exists():
        measured = json.loads(result_file.read_text())
        part |= {"setting": measured["setting"], "ratios": measured["ratios"], "step_s": measured["step_s"]}
        part["peak_bytes"], part["agreement"] = measured["peak_bytes"], measured["agreement"]
        part["aten_ops"] = measured.get("aten_ops")
        part["opob_within_target"] = measured["ratios"]["step_time_ratio"]["opob"] <= 1.10
    return part


def blocks(args: argparse.Namespace, out: Path) -> dict:
    """The engine's step at L2-sized blocks (16 MiB, any row count), against the overhead part's at
    the default (DEFAULT_BLOCK_BYTES["cuda"], a multiple of DEFAULT_BLOCK_ROW_MULTIPLE["cuda"] rows); and one
    profiled step at the default, whose kernel names show whether aligned blocks left the slow GEMM kernels."""
    result_file = out / "blocks.json"
    command = [*engine_step(args), "--repeats", str(args.repeats), "--variants", "plain,opob",
               "--block-mb", str(L2_SIZED_BLOCK_MB), "--block-row-multiple", "1", "--json", str(result_file)]  # fmt: skip
    part = run_part("blocks", command, out, args.part_timeout)
    if result_file.exists():
        part["opob_over_plain_at_l2_sized_blocks"] = json.loads(result_file.read_text())["ratios"]["step_time_ratio"]["opob"]
    part["profile"] = run_part("profile", [*engine_step(args), "--profile", "opob"], out, args.part_timeout)
    return part


def calibrate(args: argparse.Namespace, out: Path) -> dict:
    command = [sys.executable, "benchmarks/opob_overhead.py", "--model", args.model, "--device", args.device,
               "--dtype", "bfloat16", "--calibrate"]  # fmt: skip
    part = run_part("calibrate", command, out, args.part_timeout)
    found = re.search(r"pass_cost .*: ([0-9.]+)", (out / "calibrate.log").read_text())
    part["pass_cost"] = float(found.group(1)) if found else None
    return part


def exactness(args: argparse.Namespace, out: Path) -> dict:
    report = out / "exactness.xml"
    command = [sys.executable, "-m", "pytest", "-q", *EXACTNESS_TESTS, "-k", EXACTNESS_SELECTION, "-p", "no:cacheprovider",
               f"--junitxml={report}"]  # fmt: skip
    part = run_part("exactness", command, out, args.part_timeout, env={**os.environ, "VCPO_TEST_DEVICE": args.device})
    if report.exists():
        suite = ElementTree.parse(report).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
        part |= counts | {"passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]}
    return part


def memory(args: argparse.Namespace, out: Path) -> dict:
    result_file = out / "memory.json"
    command = [*engine_step(args), "--variants", "plain,opob", "--repeats", "1", "--warmup", "0", "--json", str(result_file)]
    part = run_part("memory", command, out, args.part_timeout, env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE_SEGMENTS})
    if result_file.exists():
        measured = json.loads(result_file.read_text())
        if measured.get("cuda_allocator"):
            part["against_projection"] = allocator_against_projection(measured["cuda_allocator"])
            part["used_at_start"] = measured["cuda_used_at_start"]
        else:
            part["against_projection"] = f"no CUDA allocator on {args.device}"
    return part


def allocator_against_projection(records: dict) -> dict:
    """Each step's allocator record (opob_overhead.py's `cuda_allocator_record`) beside the memory model's terms
    for what only a GPU has: the reserved peak's excess over the allocated peak, over the step's two phases, against
    the fragmentation margin; the memory outside the allocator against the CUDA overhead bound; what the optimizer
    step adds against foreach AdamW's square roots."""
    compared = {}
    for variant, record in records.items():
        phases = (record["backward"], record["optimizer_step"])
        fragmentation = max(phase["reserved_peak"] for phase in phases) / max(phase["allocated_peak"] for phase in phases) - 1
        temporaries = sum(optimizer_temporaries(record["parameters"], record["param_bytes"]).values())
        compared[variant] = {
            "fragmentation": fragmentation, "fragmentation_margin": FRAGMENTATION_MARGIN,
            "fragmentation_within_margin": fragmentation <= FRAGMENTATION_MARGIN,
            "outside_allocator": record["outside_allocator"], "cuda_overhead_bound": CUDA_OVERHEAD_BYTES,
            "outside_allocator_within_bound": record["outside_allocator"] <= CUDA_OVERHEAD_BYTES,
            "optimizer_step_added": record["optimizer_step_added"], "optimizer_temporaries_projected": temporaries,
            "optimizer_step_over_projection": record["optimizer_step_added"] / temporaries,
        }
    return compared


def megatron(args: argparse.Namespace, out: Path) -> dict:
    found = subprocess.run([sys.executable, "-c", "import megatron.core"], capture_output=True, text=True)
    if found.returncode and list(args.wheels.glob("megatron_core-*.whl")):  # the carried wheel, offline
        installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--find-links",
                                    str(args.wheels), "megatron-core==0.16.1"], capture_output=True, text=True)
        print(f"megatron: installed megatron-core from {args.wheels} (exit {installed.returncode})", flush=True)
        found = subprocess.run([sys.executable, "-c", "import megatron.core"], capture_output=True, text=True)
    if found.returncode:
        why = found.stderr.strip().splitlines()[-1] if found.stderr.strip() else "no megatron.core"
        print(f"megatron: skipped ({why})", flush=True)
        return {"exit": "skipped", "why": f"megatron-core is not installed and {args.wheels} has no wheel of it ({why})"}
    result_file = out / "megatron.json"
    command = [sys.executable, "benchmarks/megatron_overhead.py", "--device", args.device, "--size", "tiny" if args.model == "0.1m" else "0.5b",
               "--seq-len", str(args.seq_len), "--repeats", str(args.repeats), "--json", str(result_file)]  # fmt: skip
    part = run_part("megatron", command, out, args.part_timeout)
    if result_file.exists():
        measured = json.loads(result_file.read_text())
        part |= {key: measured[key] for key in ("step_s", "opob_over_plain", "two_pass_over_plain", "norm_max_relative_error")}
    return part


def part_sizes(parts: Iterable[str], device: str, model: str, seq_len: int | str, repeats: int) -> dict[str, int]:
    """Each part named with what it measured (device, model, sequence length), and the steps it timed (1: untimed)."""
    return {f"{part} on {device}, model {model}, {seq_len} tokens": repeats if part in TIMED_PARTS else 1 for part in parts}


def recorded_sizes(report: dict) -> dict[str, int]:
    """``part_sizes`` of a gpu_check.json, its setting read from the overhead part's command (every run has one)."""
    command = report["overhead"]["command"]

    def option(flag: str) -> str:
        return command[command.index(flag) + 1]

    parts = [name for name, part in report.items() if isinstance(part, dict) and "exit" in part]
    return part_sizes(parts, report["device"], option("--model"), option("--seq-len"), int(option("--repeats")))


def environment(device: str) -> dict:
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    if device.startswith("cuda") and torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(torch.device(device))
        info |= {"gpu": properties.name, "gpu_memory_gib": round(properties.total_memory / 2**30, 1),
                 "cuda": torch.version.cuda}  # fmt: skip
    else:
        info |= {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    return info


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json and the logs")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="0.5b", help="benchmarks/opob_overhead.py model shape")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--part-timeout", type=int, default=400, help="seconds allowed to each part")
    parser.add_argument("--wheels", type=Path, default=Path(".whl"), help="a folder with the megatron-core wheel, if the machine lacks it")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device (use --device cpu for a dry check)")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out}: is a file, not a folder")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    earlier = args.out / "gpu_check.json"  # a CPU dry check, or fewer repeats, never replaces a GPU's numbers
    if earlier.exists() and (problem := shrink_problem(
            earlier, recorded_sizes(json.loads(earlier.read_text())),
            part_sizes(PARTS, args.device, args.model, args.seq_len, args.repeats),
            "pass --out for a folder of your own", rows="parts", unit="repeats")):
        sys.exit(f"error: {problem}")
    return 0 if kept_unless_passed(args.out, lambda: run_parts(args)) else 1


def run_parts(args: argparse.Namespace) -> bool:
    """Every part into --out and its summary gpu_check.json; whether every part passed (or was skipped)."""
    started = utc_now()
    result = {"environment": environment(args.device), "device": args.device}
    result["overhead"] = overhead(args, args.out)
    result["blocks"] = blocks(args, args.out)
    result["calibrate"] = calibrate(args, args.out)
    result["exactness"] = exactness(args, args.out)
    result["memory"] = memory(args, args.out)
    result["megatron"] = megatron(args, args.out)
    result["provenance"] = output_record(started)  # the code's commit, when the check ran, and the host's CPU
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    # the logs and profiles beside it cannot carry a record: the folder's record says they all came from this run
    folder_record = {"about": "every file of this folder came from the one GPU check that wrote gpu_check.json", **result["provenance"]}
    (args.out / FOLDER_RECORD).write_text(json.dumps(folder_record, indent=1) + "\n")
    print(json.dumps({part: {k: v for k, v in result[part].items() if k != "command"} for part in PARTS}, indent=2, default=str))
    return all(result[part]["exit"] in (0, "skipped") for part in PARTS)


def kept_unless_passed(out: Path, check: Callable[[], bool]) -> bool:
    """Run ``check`` into ``out`` with what ``out`` held (a committed check) moved aside, and put that back unless the
    check passes: a check whose part failed, or that was stopped, leaves its own files in ``out``.failed and the
    folder as it was. Returns whether it passed."""
    out.mkdir(parents=True, exist_ok=True)
    aside, failed = out.with_name(f".{out.name}.before"), out.with_name(f"{out.name}.failed")
    shutil.rmtree(aside, ignore_errors=True)
    out.rename(aside)
    out.mkdir()
    passed = False
    try:
        passed = check()
    finally:
        if passed:
            shutil.rmtree(aside)
        else:
            shutil.rmtree(failed, ignore_errors=True)
            out.rename(failed)
            aside.rename(out)
            print(f"a part failed or the check was stopped: its files are in {failed}; {out} holds what it held", file=sys.stderr)
    return passed

if __name__ == "__main__":
    sys.exit(main())
