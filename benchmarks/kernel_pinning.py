"""Can pinning the floating-point kernels make a simulator run CPU-independent, and what does it cost?

    python benchmarks/kernel_pinning.py --out tables/kernel_pinning      # ~4 minutes, an idle machine

One short Countdown VCPO run (the across-lags study's settings at k = 12, 40 steps, one thread, no
intermediate evaluations, 100 test problems) under each kernel setting, twice, in fresh processes:

  native      each library picks its kernels by CPU (torch: the widest vector unit; MKL, oneDNN: by model)
  avx2        ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2: one code path on every Intel CPU
              with AVX2; MKL documents AVX2 as Intel-only (elsewhere it falls back to its automatic branch)
  compatible  as avx2 with MKL_CBWR=COMPATIBLE, the only MKL branch its documentation makes reproducible
              across Intel and AMD processors

Writes OUT/kernel_pinning.json: per setting the wall seconds of both repeats, whether the repeats agree
exactly, and fingerprints (the last step's gradient norm and reward, the final test accuracy) that a run of
this script on another CPU type compares with: equal fingerprints there mean the setting makes runs
identical across the two CPUs.
"""

from __future__ import annotations

import argparse
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
from vcpo.provenance import cpu_name, library_versions
from vcpo.reporting.run_data import read_metrics
from vcpo.runs import TEST_ACCURACY, final_eval

SETTINGS = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "compatible": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}
RUN = ["--config", "recipes/sim/regime.yaml", "--method", "vcpo", "--seed", "0", "steps=40", "eval_every=0", "lag=12",
       "lag_model=pipeline_overlap", "test_problems=100", "threads=1", "progress=false"]


def fingerprint(run: Path) -> dict:
    lines = read_metrics(run)
    last_step = [line for line in lines if "actor/grad_norm" in line][-1]
    final = final_eval(run)
    return {"grad_norm_last": last_step["actor/grad_norm"], "reward_last": last_step["critic/score/mean"],
            "test_accuracy": final[TEST_ACCURACY]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    earlier = args.out / "kernel_pinning.json"
    recorded = {name: len(setting["seconds"]) for name, setting in json.loads(earlier.read_text())["settings"].items()} \
        if earlier.exists() else {}
    if problem := shrink_problem(earlier, recorded, dict.fromkeys(SETTINGS, args.repeats), "pass --out for a folder of your own",
                                 rows="settings", unit="repeats"):
        sys.exit(f"error: {problem}")
    clean = {key: value for key, value in os.environ.items() if key not in {k for s in SETTINGS.values() for k in s}}
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, pins in SETTINGS.items():
            seconds, prints = [], []
            for repeat in range(args.repeats):
                out = Path(scratch) / f"{name}-{repeat}"
                started = time.perf_counter()
                subprocess.run([sys.executable, "-m", "vcpo.sim", "train", *RUN, "--out", str(out)], check=True,
                               env={**clean, **pins}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               preexec_fn=dies_with_this_thread)
                seconds.append(time.perf_counter() - started)
                prints.append(fingerprint(out))
            results[name] = {"env": pins, "seconds": seconds, "repeats_identical": all(p == prints[0] for p in prints),
                             "fingerprint": prints[0]}
            print(f"{name}: {min(seconds):.1f} s, repeats identical: {results[name]['repeats_identical']}, {prints[0]}", flush=True)
    native = min(results["native"]["seconds"])
    for result in results.values():
        result["time_vs_native"] = min(result["seconds"]) / native
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"cpu": cpu_name(), "versions": library_versions(), "command": " ".join(["python -m vcpo.sim train", *RUN]),
              "settings": results}
    write_atomic(earlier, json.dumps(report, indent=2) + "\n")
    print(f"-> {args.out / 'kernel_pinning.json'}")


if __name__ == "__main__":
    main()
