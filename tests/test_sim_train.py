"""The simulator end to end: every preset runs, bad input fails early, outputs, resume after a kill."""

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from vcpo.local_models import save_random_model
from vcpo.locks import run_folder_lock
from vcpo.methods import list_methods, run_lag
from vcpo.provenance import KERNEL_ENV, code_state
from vcpo.runs import METRICS_FILE
from vcpo.sim.__main__ import main as sim_main
from vcpo.sim.config import ConfigError, SimConfig, apply_overrides
from vcpo.sim.tasks import get_sim_task
from vcpo.sim.train import TIMING_PREFIXES, Trainer
from vcpo.sim.validation import check_inputs, check_settings, default_lag, resolve, validate

SMALL = {
    "steps": 2,
    "prompts_per_step": 2,
    "responses_per_prompt": 2,
    "micro_batch_size": 4,
    "max_response_tokens": 8,
    "update_tokens": 4,
    "eval_every": 0,
    "eval_problems": 4,
    "warmup_steps": 0,
    "checkpoint_every": 1,
    "progress": False,
    "lag": 2,
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A random-init tiny model: the pipeline needs a base, not a good one."""
    return str(save_random_model(tmp_path_factory.mktemp("base"), hidden_size=32, num_layers=1))


def small_config(base_dir, out, **changes) -> SimConfig:
    return apply_overrides(SimConfig(), {**SMALL, "base": base_dir, "out": str(out)} | changes)


def numbers(metrics: dict):
    for name, value in metrics.items():
        for item in value if isinstance(value, list) else [value]:
            yield name, item


@pytest.mark.parametrize("method", [m.name for m in list_methods()])
def test_every_preset_runs(base, tmp_path, method):
    changes = {"method": method, "lag": run_lag(method, default=SMALL["lag"])}
    if method == "fp16":
        changes["rollout_dtype"] = "preset"
    if method == "p3o_two_anchor":
        changes["lag_model"] = "minibatch"  # the proximal snapshot differs from θ only within an epoch
    out = Trainer(small_config(base, tmp_path / method, **changes)).run()
    lines = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1]
    for line in lines:
        for name, value in numbers(line):
            assert isinstance(value, int | float) and math.isfinite(value), (method, name, value)
        assert "rollout_corr/seq_ess_ratio" in line and "actor/grad_norm" in line and "async/lag_hist" in line
    config = json.loads((out / "config.json").read_text())
    assert config["method_preset"]["name"] == method and (out / "final" / "config.json").exists()


def test_wandb_logging_goes_through_verls_tracking(base, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")  # the code path of wandb=true, without files or network
    out = Trainer(small_config(base, tmp_path / "wandb", wandb=True, steps=1, lag=1)).run()
    assert len((out / METRICS_FILE).read_text().splitlines()) == 1


@pytest.mark.parametrize("lag_model, lags", [("fixed", [0, 1, 2, 2, 2]), ("minibatch", [0, 1, 2, 0, 1])])
def test_lag_models_through_the_trainer_keep_the_versions_they_need(base, tmp_path, lag_model, lags):
    out = Trainer(small_config(base, tmp_path / lag_model, lag_model=lag_model, steps=5)).run()
    lines = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]
    assert [line["async/lag_max"] for line in lines] == lags


def test_sync_preset_refuses_a_lag_and_trains_on_policy(base, tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"method 'sync' fixes the policy lag to 0 \(max_lag in its preset\), got 5"):
        validate(small_config(base, tmp_path / "sync", method="sync", lag=5, steps=8))
    assert sim_main(["train", "--method", "sync", "--lag", "12", "--out", str(tmp_path / "cli"), f"base={base}"]) == 2
    assert "fixes the policy lag to 0" in capsys.readouterr().err and not (tmp_path / "cli").exists()
    out = Trainer(small_config(base, tmp_path / "sync", method="sync", lag=0)).run()
    lines = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]
    assert all(line["async/lag_max"] == 0 and line["rollout_corr/seq_ess_ratio"] == pytest.approx(1, abs=1e-5) for line in lines)
    assert json.loads((out / "config.json").read_text())["lag"] == 0


def test_low_precision_rollouts_are_a_training_inference_mismatch(base, tmp_path):
    """bf16 rollouts against a float32 learner: off-policy even at lag 0 (ROLLOUT-CORR's mismatch)."""
    runs = {}
    for dtype in ("float32", "bfloat16"):
        out = Trainer(small_config(base, tmp_path / dtype, method="sync", lag=0, rollout_dtype=dtype, steps=1)).run()
        runs[dtype] = json.loads((out / METRICS_FILE).read_text().splitlines()[0])
    exact, mismatched = runs["float32"], runs["bfloat16"]
    assert abs(exact["rollout_corr/kl"]) < 1e-6 and exact["rollout_corr/seq_ess_ratio"] > 1 - 1e-6
    assert abs(mismatched["rollout_corr/kl"]) > 1e-5 and mismatched["rollout_corr/k3_kl"] > 10 * abs(exact["rollout_corr/k3_kl"])
    assert mismatched["rollout_corr/seq_ess_ratio"] < exact["rollout_corr/seq_ess_ratio"]
    assert runs["bfloat16"]["async/lag_max"] == 0


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"task": "chess"}, "task"),
        ({"method": "vcpo_typo"}, "method"),
        ({"lag_model": "async"}, "lag_model"),
        ({"lag": -1}, "lag"),
        ({"base": "/nonexistent/model"}, "base"),
        ({"micro_batch_size": 3}, "micro_batch_size"),
        ({"method": "fp16"}, "rollout_dtype"),
        ({"learner_dtype": "bfloat16"}, "learner_dtype"),
        ({"responses_per_prompt": 1}, "responses_per_prompt"),
        ({"reference_lr": float("inf")}, "reference_lr"),
        ({"grad_clip": float("nan")}, "grad_clip"),
        ({"betas": (1.5, 0.9)}, "betas"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"eps": -1.0}, "eps"),
        ({"eval_temperature": 0.0}, "eval_temperature"),
        ({"rho_on": -0.5}, "rho_on"),
        ({"rho_on": float("nan")}, "rho_on"),
    ],
)
def test_bad_config_names_the_key(base, tmp_path, changes, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        validate(small_config(base, tmp_path / "run", **changes))
    assert not (tmp_path / "run").exists()


def test_unknown_key_is_named_with_a_suggestion():
    with pytest.raises(ConfigError, match="unknown config key 'lag_modle'.*did you mean 'lag_model'"):
        apply_overrides(SimConfig(), ["lag_modle=fixed"])
    with pytest.raises(ConfigError, match="'steps'.*cannot read 'many'"):
        apply_overrides(SimConfig(), ["steps=many"])


def test_a_config_written_with_the_rates_old_name_trains_the_same_run(base, tmp_path):
    """``lr`` was reference_lr's name before the rename: a config file, a key=value and a recorded config.json that
    use it give the same settings, the same optimizer rate and the same metrics as the current name."""
    from vcpo.sim.config import load_config_file, read_recorded, settings_changed

    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text("lr: 2.0e-4\nlag: 3\n")
    new.write_text("reference_lr: 2.0e-4\nlag: 3\n")
    from_old, from_new = load_config_file(old), load_config_file(new)
    assert dataclasses.replace(from_old, config_file=None) == dataclasses.replace(from_new, config_file=None)
    assert from_old.reference_lr == 2.0e-4 and from_old.base_lr == 2.0e-4  # seq_tis_c8 is at the paper's rate
    assert apply_overrides(SimConfig(), ["lr=1e-4"]) == apply_overrides(SimConfig(), ["reference_lr=1e-4"])
    assert apply_overrides(SimConfig(method="low_lr"), ["lr=1e-4"]).base_lr == pytest.approx(1e-5)  # 1e-7 / 1e-6 of it

    ends = {}
    for name in ("lr", "reference_lr"):
        out = tmp_path / name
        assert sim_main(["train", *[f"{k}={v}" for k, v in SMALL.items()], f"base={base}", f"out={out}", f"{name}=3e-3"]) == 0
        ends[name] = [{k: v for k, v in json.loads(line).items() if not k.startswith(TIMING_PREFIXES)}
                      for line in (out / METRICS_FILE).read_text().splitlines()]
    assert ends["lr"] == ends["reference_lr"] and len(ends["lr"]) == SMALL["steps"]

    recorded = json.loads((tmp_path / "reference_lr" / "config.json").read_text())
    archived = tmp_path / "archived"
    archived.mkdir()
    (archived / "config.json").write_text(json.dumps({("lr" if k == "reference_lr" else k): v for k, v in recorded.items()}))
    assert read_recorded(archived)["reference_lr"] == 3e-3 and "lr" not in read_recorded(archived)
    config = validate(small_config(base, tmp_path / "reference_lr", reference_lr=3e-3))
    assert settings_changed(json.loads((archived / "config.json").read_text()), config) == []


def test_cli_reports_bad_input_before_work(base, tmp_path, capsys):
    code = sim_main(["train", "--task", "countdown", "--method", "nope", "--out", str(tmp_path / "x"), f"base={base}"])
    assert code == 2 and "unknown method 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    code = sim_main(["sweep", "--methods", "sync,vcpo,bad", "--lags", "4", "--out", str(tmp_path / "sweep"), f"base={base}"])
    assert code == 2 and "'method'" in capsys.readouterr().err
    assert not (tmp_path / "sweep").exists()


def test_sweep_runs_and_skips_finished(base, tmp_path, capsys):
    args = ["sweep", "--methods", "sync,vcpo", "--lags", "2", "--seeds", "0", "--out", str(tmp_path), "--jobs", "2"]
    overrides = [f"{key}={value}" for key, value in SMALL.items() if key != "lag"] + [f"base={base}"]
    assert sim_main(args + overrides) == 0
    for method, lag in (("sync", 0), ("vcpo", 2)):  # a sweep files sync at the lag its preset fixes
        assert (tmp_path / "countdown" / method / f"lag{lag}" / "seed0" / "final" / "eval.json").exists()
    assert sim_main(args + overrides) == 0
    assert "2 already finished, 0 to run" in capsys.readouterr().out


def test_a_second_sweep_into_a_running_sweeps_folder_is_refused_in_one_line(base, tmp_path, capsys):
    """The first sweep holds its folder's lock; the second names its holder and runs nothing (it once printed
    "failed: <run>" for runs that were fine, each refused by its folder's lock)."""
    with run_folder_lock(tmp_path):
        code = sim_main(["sweep", "--methods", "sync", "--lags", "2", "--out", str(tmp_path), f"base={base}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert f"{tmp_path} is in use by process {os.getpid()}" in err and "failed" not in err
    assert not (tmp_path / "countdown").exists()


def test_a_sweep_from_a_folder_where_snakemake_cannot_keep_its_state_is_refused_before_any_work(base, tmp_path,
                                                                                            monkeypatch, capsys):
    (tmp_path / ".snakemake").write_text("")  # a file where Snakemake makes its folder: as a read-only mount would
    monkeypatch.chdir(tmp_path)
    code = sim_main(["sweep", "--methods", "sync", "--lags", "2", "--out", str(tmp_path / "sweep"), f"base={base}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert f"Snakemake keeps its state in {tmp_path / '.snakemake'}" in err and "run from a writable folder" in err
    assert not (tmp_path / "sweep").exists()


def _metrics_without_timing(path: Path) -> list[dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in line.items() if not k.startswith(TIMING_PREFIXES)} for line in lines]


RESUME = {**SMALL, "steps": 8, "eval_every": 3, "checkpoint_every": 2, "lag": 3, "method": "vcpo"}


@pytest.fixture(scope="module")
def uninterrupted(base, tmp_path_factory):
    reference = tmp_path_factory.mktemp("reference")
    command = [sys.executable, "-m", "vcpo.sim", "train", *[f"{k}={v}" for k, v in RESUME.items()], f"base={base}"]
    subprocess.run([*command, "threads=1", f"out={reference}"], check=True, capture_output=True)
    return _metrics_without_timing(reference / METRICS_FILE)


@pytest.mark.slow
@pytest.mark.parametrize(
    "stop, lines_before",
    [(signal.SIGINT, 1), (signal.SIGKILL, 1), (signal.SIGINT, 5), (signal.SIGKILL, 5)],
    ids=["ctrl-c-before-first-checkpoint", "kill-before-first-checkpoint", "ctrl-c-mid-way", "kill-mid-way"],
)
def test_an_interrupted_run_resumes_to_the_same_metrics(base, tmp_path, uninterrupted, stop, lines_before):
    """Stop a real run (Ctrl-C or SIGKILL) before or after its first checkpoint (every 2 steps), restart it:
    every step's metrics exactly once, the same numbers as the uninterrupted run."""
    command = [sys.executable, "-m", "vcpo.sim", "train", *[f"{k}={v}" for k, v in RESUME.items()], f"base={base}", "threads=1"]
    resumed = tmp_path / "resumed"
    # Ctrl-C's default action in the child, even when this test runs where SIGINT is ignored (a background
    # job of a non-interactive shell, whose children would inherit the ignore and run to the end)
    said = open(tmp_path / "stderr.txt", "w")  # noqa: SIM115 (the child's, closed after it ends)
    process = subprocess.Popen(
        [*command, f"out={resumed}"],
        stdout=subprocess.DEVNULL,
        stderr=said,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        metrics = resumed / METRICS_FILE
        if metrics.exists() and len(metrics.read_text().splitlines()) >= lines_before:
            break
        time.sleep(0.02)
    os.kill(process.pid, stop)
    process.wait()
    said.close()
    if stop == signal.SIGINT:  # Ctrl-C: one line saying where it stopped and how to go on, no traceback
        text = (tmp_path / "stderr.txt").read_text()
        assert "Traceback" not in text and "; the same command resumes it" in text and process.returncode == 130
    stopped_at = len((resumed / METRICS_FILE).read_text().splitlines())
    assert lines_before <= stopped_at < 9, "the run was not stopped where intended"
    subprocess.run([*command, f"out={resumed}"], check=True, capture_output=True)
    assert _metrics_without_timing(resumed / METRICS_FILE) == uninterrupted
    recorded = json.loads((resumed / "config.json").read_text())
    attempts = recorded["attempts"]
    assert recorded["started"] == attempts[0]["started"] <= attempts[-1]["started"] <= recorded["finished"]
    # a stop before the first checkpoint starts over (one attempt at step 0), a later one resumes (a second attempt)
    assert len(attempts) == (1 if lines_before == 1 else 2) and attempts[0]["step"] == 0 and attempts[-1]["step"] in (0, 2, 4)


def test_a_restart_with_other_settings_is_refused_naming_them(base, tmp_path, capsys):
    out = tmp_path / "run"
    command = ["train", *[f"{k}={v}" for k, v in RESUME.items()], f"base={base}", f"out={out}", "steps=2", "lag=2"]
    assert sim_main(command) == 0
    before = (out / METRICS_FILE).read_text()
    assert sim_main([*command, "method=sync", "lag=0", "reference_lr=1e-4"]) == 2
    error = capsys.readouterr().err
    assert "holds a checkpoint of a run with other settings" in error
    assert "method: 'vcpo' -> 'sync'" in error and "lag: 2 -> 0" in error and "reference_lr: 5e-05 -> 0.0001" in error
    assert (out / METRICS_FILE).read_text() == before and json.loads((out / "config.json").read_text())["method"] == "vcpo"
    assert sim_main([*command, "threads=2"]) == 2  # the thread count changes the reductions' order
    assert "threads: 1 -> 2" in capsys.readouterr().err
    assert sim_main([*command, "progress=false", "checkpoint_every=5"]) == 0  # what does not change the result may differ


def test_a_lag_the_run_cannot_reach_is_refused(base, tmp_path):
    with pytest.raises(ConfigError, match=r"a lag of 100000 cannot be reached in a run of 200 steps \(the bound: lag <= steps\)"):
        validate(small_config(base, tmp_path / "x", lag=100000, steps=200))


def test_a_run_records_the_code_machine_and_times_that_made_it(base, tmp_path):
    out = tmp_path / "run"
    assert sim_main(["train", *[f"{k}={v}" for k, v in RESUME.items()], f"base={base}", f"out={out}", "steps=2", "lag=2"]) == 0
    recorded = json.loads((out / "config.json").read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True)
    if head.returncode == 0:  # a git checkout (CI's is one)
        assert recorded["commit"] == head.stdout.strip() and isinstance(recorded["dirty"], bool)
    assert recorded["started"] <= recorded["finished"] and [a["step"] for a in recorded["attempts"]] == [0]
    assert recorded["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert recorded["torch_threads"] == 1 and recorded["cores"] == 1 and recorded["threads"] == 1
    assert set(recorded["kernel_env"]) == set(KERNEL_ENV) and recorded["versions"]["torch"] == torch.__version__


def test_code_state_names_the_commit_and_sees_uncommitted_changes(tmp_path):
    assert code_state(tmp_path) == {"commit": None, "dirty": None}  # not a checkout: nothing is claimed
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "a"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    (tmp_path / "untracked.txt").write_text("runs and logs are not the code\n")
    assert code_state(tmp_path) == {"commit": head, "dirty": False}
    (tmp_path / "a.py").write_text("x = 2\n")
    assert code_state(tmp_path) == {"commit": head, "dirty": True}


def test_a_finished_run_started_again_keeps_its_end_and_lists_the_attempt(base, tmp_path):
    """Two across-lags rows lost `finished` this way: a runner started a finished run again, whose config.json was
    rewritten without it."""
    out = tmp_path / "run"
    Trainer(small_config(base, out, steps=2)).run()
    first = json.loads((out / "config.json").read_text())
    Trainer(small_config(base, out, steps=2)).run()
    again = json.loads((out / "config.json").read_text())
    assert first["finished"] and again["finished"] == first["finished"] and again["started"] == first["started"]
    assert [attempt["step"] for attempt in again["attempts"]] == [0, 2]


def test_a_resolved_run_hands_on_its_method_rate_dtype_and_step_rule_found_once():
    """resolve() asks vcpo.methods once and hands the answers on: low_lr's rate (1e-7 at the paper's 1e-6) is a tenth
    of reference_lr; the fp16 preset's rollouts are float16; the tool task's paper rho_on (0.55) is in the step rule;
    a bad lag and a bad rho_on are each refused under their own key."""
    run = resolve(SimConfig(task="tir", method="low_lr", reference_lr=2e-3))
    assert run.method.name == "low_lr" and run.base_lr == pytest.approx(2e-4) and run.rollout_dtype == "float32"
    assert run.rule.rho_on == 0.55 == run.config.rho_on
    assert resolve(SimConfig(method="fp16", rollout_dtype="preset")).rollout_dtype == "float16"
    with pytest.raises(ConfigError, match="'lag'"):
        resolve(SimConfig(method="sync", lag=3))
    with pytest.raises(ConfigError, match="'rho_on'"):
        resolve(SimConfig(method="vcpo", rho_on=-1.0))


def test_the_settings_are_checked_apart_from_the_files_they_name(tmp_path):
    """check_settings reads no file (a missing base and replayed run pass it); check_inputs and validate refuse them."""
    config = apply_overrides(SimConfig(), {"method": "seq_tis_c8", "base": str(tmp_path / "no_base"),
                                           "lr_scale_from": str(tmp_path / "no_run")})
    checked = check_settings(config)
    assert checked.max_response_tokens is not None  # the task's defaults filled in
    with pytest.raises(ConfigError, match="'base': no SFT base model"):
        check_inputs(checked)
    with pytest.raises(ConfigError, match="'base': no SFT base model"):
        validate(config)
    (tmp_path / "no_base").mkdir()
    (tmp_path / "no_base" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="'lr_scale_from': no .*metrics.jsonl"):
        validate(config)
    run = resolve(dataclasses.replace(config, lr_scale_from=None))
    assert run.config == dataclasses.replace(checked, lr_scale_from=None)
    assert (run.task, run.replayed_lr_scales) == (get_sim_task("countdown"), None)


def test_the_default_lag_names_the_key_at_fault():
    assert default_lag("sync", 12) == 0 and default_lag("vcpo", 12) == 12  # a preset that fixes its lag keeps it
    with pytest.raises(ConfigError, match="config key 'lag'"):
        default_lag("vcpo", -1)
    with pytest.raises(ConfigError, match="config key 'method'"):
        default_lag("nonesuch", 1)
