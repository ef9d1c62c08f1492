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
    # the device-following exactness tests ran and passed (float64, float32, packed, bf16/fp16)
    assert exactness["tests"] >= 80 and exactness["passed"] == exactness["tests"] and exactness["failures"] == 0
    # OPOB inside megatron-core's layers: timed against a plain backward (one repeat on a shared CPU says
    # nothing about the ratio, so only that both were timed), its bf16 norms against one backward per sequence
    megatron = report["megatron"]
    assert megatron["exit"] == 0 and megatron["step_s"]["plain"] > 0 and megatron["step_s"]["opob"] > 0
    assert megatron["opob_over_plain"] == megatron["step_s"]["opob"] / megatron["step_s"]["plain"]
    assert megatron["norm_max_relative_error"] < 2e-2


def test_the_documented_gpu_numbers_are_the_committed_gpu_check():
    """docs/per_sequence_gradients.md's GPU table and the README's status quote tables/gpu_check/gpu_check.json."""
    report = json.loads((REPO / "tables/gpu_check/gpu_check.json").read_text())
    overhead = report["overhead"]
    doc = (REPO / "docs/per_sequence_gradients.md").read_text().split("## On a GPU")[1].split("\n## ")[0]
    names = {"plain": "plain backward", "opob": "single-backward OPOB", "naive": "naive two-backward",
             "per_sequence": "one trajectory per micro-batch"}  # fmt: skip
    for variant, name in names.items():
        row = next(line for line in doc.splitlines() if line.startswith(f"| {name}"))
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[1] == f"{overhead['step_s'][variant]:.3f}"
        assert cells[2] == f"{overhead['ratios']['step_time_ratio'][variant]:.2f}"
        assert cells[3] == f"{overhead['peak_bytes'][variant] / 2**30:.1f}"
        assert cells[4] == f"{overhead['ratios']['memory_ratio'][variant]:.2f}"
    opob = f"{overhead['ratios']['step_time_ratio']['opob']:.2f}×"
    assert f"missed: {opob}" in doc and f"OPOB at {opob}" in (REPO / "README.md").read_text()
    assert f"{report['exactness']['passed']} device-following" in doc and report["exactness"]["failures"] == 0
    assert f"κ = {report['calibrate']['pass_cost']:.0f}" in doc
    from vcpo.core.per_sequence_grads.reductions import DEFAULT_PASS_COST

    assert DEFAULT_PASS_COST["cuda"] == round(report["calibrate"]["pass_cost"])


def test_the_simulator_cost_table_quotes_its_measurement():
    """docs/per_sequence_gradients.md's simulator table is tables/opob_sim/update_cost.json's ratios, its profile
    sentence tables/opob_sim/update_profile.json's operators."""
    measured = json.loads((REPO / "tables/opob_sim/update_cost.json").read_text())
    ratios, shape = measured["ratio_to_seq_tis"], measured["padded_shape"]
    doc = (REPO / "docs/per_sequence_gradients.md").read_text().split("## In the simulator's learner")[1].split("\n## ")[0]
    for label, row in (("VCPO, deferred, routes chosen per call (as it runs)", "vcpo"), ("VCPO, deferred, ghost norms", "vcpo ghost"),
                       ("VCPO, deferred, per-sequence gradients materialised", "vcpo materialize"),
                       ("VCPO, two buffers (the studies' runs)", "vcpo buffers")):
        cells = " | ".join(f"{ratios[row][part]:.2f}" for part in ("timing_s/update", "timing_s/forward", "timing_s/backward"))
        assert f"| {label} | {cells} |" in doc
    assert f"| seq-TIS (c = 8) | 1.00 ({measured['median_s']['seq_tis_c8']['timing_s/update'] * 1e3:.0f} ms) |" in doc
    assert f"{shape[0][0]} sequences per micro-batch of at most {max(s[1] for s in shape)} response" in doc
    assert measured["settings"]["opob_combination"] == "deferred"
    assert ratios["vcpo"]["timing_s/update"] > 1.10 and "The 1.10x goal is not reached here" in doc
    profiled = json.loads((REPO / "tables/opob_sim/update_profile.json").read_text())
    base, vcpo, total = profiled["self_ms"]["seq_tis_c8"], profiled["self_ms"]["vcpo"], profiled["total_ms"]
    text = " ".join(doc.split())
    assert f"seq-TIS {total['seq_tis_c8']:.0f} ms, VCPO {total['vcpo']:.0f} ms ({total['vcpo'] / total['seq_tis_c8']:.2f}x;" in text
    for op in ("aten::bmm", "aten::addmm_", "aten::mul", "_OuterProductFunctionBackward"):
        assert f"(`{op}`) {vcpo.get(op, 0.0) - base.get(op, 0.0):+.1f} ms" in text
    assert f"{vcpo['aten::mm'] - base['aten::mm']:+.1f} ms of `aten::mm`" in text


def test_the_engine_step_table_quotes_its_measurement():
    """docs/verl.md's engine table is tables/opob_engine/cpu_split.log (benchmarks/opob_engine.py's output, one run
    per configuration): the plain step's process CPU time and each variant's median process-CPU ratio."""
    import re

    blocks = (REPO / "tables/opob_engine/cpu_split.log").read_text().split("== python benchmarks/opob_engine.py ")[1:]
    labels = {"--repeats 15": "small (4.2M), packed, verl's default (15)", "--padded --repeats 12": "small (4.2M), padded (12)",
              "--autocast bfloat16 --repeats 10": "small (4.2M), packed, `--autocast bfloat16` (10)",
              "--model 50m --batch 8 --repeats 8": "50M (46.5M, batch 8), packed (8)",
              "--model 50m --batch 8 --padded --repeats 6": "50M (46.5M, batch 8), padded (6)"}
    doc = (REPO / "docs/verl.md").read_text()
    ess = []
    for block in blocks:
        arguments = block.splitlines()[0]
        cpu = {m[0]: (float(m[1]), float(m[2])) for m in re.findall(r"^  (\S+)\s+median.*process CPU\s+([\d.]+) ms  x([\d.]+)", block, re.M)}
        ess.append(cpu["ess"][1])
        row = (f"| {labels[arguments.removesuffix(' --combinations buffers')]} | {cpu['plain'][0] / 1e3:.2f} s | {cpu['ess'][1]:.2f} | "
               f"{cpu['vcpo'][1]:.2f} | {cpu['vcpo[buffers]'][1]:.2f} |")
        assert row in doc, row
        assert "vcpo combines with 'split'" in block
    assert len(blocks) == len(labels) and f"reads {min(ess):.2f}-{max(ess):.2f}" in " ".join(doc.split())
