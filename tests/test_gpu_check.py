"""benchmarks/gpu_check.py: the one-command GPU check, run here as its CPU dry check."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def gpu_check(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "benchmarks/gpu_check.py", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the refusal does not apply")
def test_without_a_gpu_the_default_device_is_refused_in_one_line(tmp_path):
    result = gpu_check("--out", str(tmp_path / "out"))
    assert result.returncode == 2 and "torch sees no CUDA device" in result.stderr
    assert not (tmp_path / "out").exists()


def test_the_allocator_record_against_the_memory_models_gpu_terms():
    """Hand numbers: 10 GB allocated at most (the backward), 10.6 GB reserved at most (the optimizer step's phase);
    3.2 GB outside the allocator; a 0.5B bf16 model whose optimizer step added 1.2 GB."""
    import importlib.util

    from vcpo.actor_memory import CUDA_OVERHEAD_BYTES, FRAGMENTATION_MARGIN

    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks/gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    record = {"backward": {"allocated_peak": 10e9, "reserved_peak": 10.2e9},
              "optimizer_step": {"allocated_peak": 9e9, "reserved_peak": 10.6e9},
              "optimizer_step_added": 1.2e9, "outside_allocator": 3.2e9, "parameters": 500_000_000, "param_bytes": 2}
    compared = module.allocator_against_projection({"opob": record})["opob"]
    assert compared["fragmentation"] == pytest.approx(0.06) and compared["fragmentation_within_margin"] is (0.06 <= FRAGMENTATION_MARGIN)
    assert compared["outside_allocator_within_bound"] is (3.2e9 <= CUDA_OVERHEAD_BYTES)
    assert compared["optimizer_temporaries_projected"] == 1e9  # one bf16 copy of 0.5B parameters
    assert compared["optimizer_step_over_projection"] == pytest.approx(1.2)


@pytest.mark.slow
def test_the_cpu_dry_check_measures_every_part(tmp_path):
    result = gpu_check("--out", str(tmp_path), "--device", "cpu", "--model", "0.1m", "--seq-len", "64", "--repeats", "1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    overhead, exactness = report["overhead"], report["exactness"]
    assert set(overhead["ratios"]["step_time_ratio"]) == {"plain", "opob", "naive", "two_pass", "per_sequence"}
    for kind in ("dispatched", "computing"):  # all operators, and those that are not views (a kernel each on a GPU)
        assert set(overhead["aten_ops"][kind]) == set(overhead["ratios"]["step_time_ratio"]) and overhead["aten_ops"][kind]["plain"] > 0
    assert all(overhead["aten_ops"]["computing"][v] < overhead["aten_ops"]["dispatched"][v] for v in overhead["aten_ops"]["computing"])
    assert overhead["ratios"]["step_time_ratio"]["plain"] == 1.0 and overhead["step_s"]["opob"] > 0
    assert overhead["opob_within_target"] == (overhead["ratios"]["step_time_ratio"]["opob"] <= 1.10)
    assert report["calibrate"]["pass_cost"] > 0
    # L2-sized blocks timed against the default, and one profiled step at the default
    blocks = report["blocks"]
    assert blocks["exit"] == 0 and blocks["opob_over_plain_at_l2_sized_blocks"] > 0 and blocks["profile"]["exit"] == 0
    assert "opob: one step" in (tmp_path / "profile.log").read_text()
    # the device-following exactness tests ran and passed (float64, float32, packed, bf16/fp16)
    assert exactness["tests"] >= 80 and exactness["passed"] == exactness["tests"] and exactness["failures"] == 0
    # OPOB inside megatron-core's layers: timed against a plain backward (one repeat on a shared CPU says
    # nothing about the ratio, so only that both were timed), its bf16 norms against one backward per sequence
    # what produced the summary and each part's own JSON is recorded with them
    for record in (report, *(json.loads((tmp_path / f"{part}.json").read_text()) for part in ("overhead", "blocks", "memory"))):
        assert set(record["provenance"]) == {"commit", "dirty", "start", "finish", "cpu"} and record["provenance"]["start"] <= record["provenance"]["finish"]
    # the memory part ran its two steps; only a GPU has the allocator it compares with the model
    assert report["memory"]["exit"] == 0 and report["memory"]["against_projection"] == "no CUDA allocator on cpu"
    megatron = report["megatron"]
    assert megatron["exit"] == 0 and megatron["step_s"]["plain"] > 0 and megatron["step_s"]["opob"] > 0
    assert megatron["opob_over_plain"] == megatron["step_s"]["opob"] / megatron["step_s"]["plain"]
    assert megatron["norm_max_relative_error"] < 2e-2
