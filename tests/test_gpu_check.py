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
    megatron = report["megatron"]
    assert megatron["exit"] == 0 and megatron["step_s"]["plain"] > 0 and megatron["step_s"]["opob"] > 0
    assert megatron["opob_over_plain"] == megatron["step_s"]["opob"] / megatron["step_s"]["plain"]
    assert megatron["norm_max_relative_error"] < 2e-2
