"""The paper workflow's own rules end to end on CPU through verl (workflows/config/verl-cpu.yaml): the longest
test, in a module of its own so that a parallel test run (pytest -n) can give it a worker while the rest proceed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_verl_cpu_trainer import check_sync_run, check_vcpo_lag1_run, ray_cluster_slot

from vcpo.launch.console import VERL_LOG

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "workflows" / "config"


@pytest.mark.slow
def test_the_paper_workflow_runs_on_cpu_through_verl_and_writes_the_report(tmp_path):
    """workflows/config/verl-cpu.yaml: the verl backend's own rules end to end on CPU (data, trainings by
    verl's trainer, python -m vcpo.evaluation of verl's Hugging Face checkpoints and of the base model, Table 1 and
    Figure 5 from verl's metrics), then the report."""
    results, data = tmp_path / "results", tmp_path / "data"
    base = [sys.executable, "-m", "snakemake", "-s", "workflows/Snakefile", "--configfile", str(CONFIGS / "verl-cpu.yaml"),
            "--config", f"results={results}", f'data={{"dir": "{data}"}}', "--cores", "2"]  # fmt: skip
    for extra in ([], ["--report", str(results / "report.html")]):
        with ray_cluster_slot():
            result = subprocess.run([*base, *extra], cwd=REPO, capture_output=True, text=True, timeout=1500)
        assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    runs = results / "runs" / "countdown"
    for run in ("sync/lag0/seed0", "seq_tis_c8/lag1/seed0", "vcpo/lag1/seed0"):
        launch = json.loads((runs / run / "launch.json").read_text())
        assert launch["method"] == run.split("/")[0] and "verl.trainer.main_ppo" in " ".join(launch["command"])
        steps = [json.loads(line)["step"] for line in (runs / run / "metrics.jsonl").read_text().splitlines()]
        assert max(steps) == 3  # verl's file logger, three steps
        summary = json.loads((runs / run / "eval" / "summary.json").read_text())
        assert "global_step_3/actor/huggingface" in summary["model"] and summary["results"]["countdown"]["num_problems"] == 8

    def training_records(run: str) -> list[dict]:  # step 0 holds only the validation before training
        return [r for r in map(json.loads, (runs / run / "metrics.jsonl").read_text().splitlines()) if r["step"] > 0]

    check_sync_run(training_records("sync/lag0/seed0"), 3)  # verl's sync trainer, on policy
    check_vcpo_lag1_run(training_records("vcpo/lag1/seed0"), (runs / "vcpo/lag1/seed0" / VERL_LOG).read_text(), 3)
    assert json.loads((runs / "base" / "eval" / "summary.json").read_text())["model"].endswith("random_model")
    table = (results / "tables" / "table1.md").read_text()
    assert "missing" not in table.split("| Base")[1].split("\n")[0]  # the base model's evaluation
    assert "missing" not in table.split("| Sync (k=0)")[1].split("\n")[0]
    vcpo_metrics = (runs / "vcpo/lag1/seed0" / "metrics.jsonl").read_text()
    assert "actor/opob_baseline" in vcpo_metrics and "rollout_corr/seq_ess_ratio" in vcpo_metrics
    assert (results / "figures" / "fig5.png").stat().st_size > 10_000
    assert (results / "report.html").stat().st_size > 100_000
