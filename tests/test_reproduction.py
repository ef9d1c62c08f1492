"""The reproduction workflow: its run plan per config, the checks at DAG construction, Snakemake's dry runs."""

from __future__ import annotations

import copy
import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vcpo.methods import list_methods
from vcpo.workflow_plan import PlannedRun, WorkflowConfigError, plan, provenance, sim_cores, sim_settings, trained_task

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "workflows" / "config"


@functools.cache
def config(name: str) -> dict:
    return yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())


@functools.cache
def planned(name: str):
    return plan(config(name))


def test_smoke_runs_every_method_briefly_and_the_core_study_fully():
    smoke = planned("smoke")
    assert {run.method for run in smoke.runs} == {method.name for method in list_methods()}
    assert {run.task for run in smoke.runs} == {"countdown", "tir"}
    core = {(run.task, run.method, run.lag, run.seed) for run in smoke.runs if run.core}
    countdown = {("countdown", m, lag, s) for m, lag in (("sync", 0), ("seq_tis_c8", 48), ("vcpo", 48)) for s in (0, 1, 2)}
    # SimpleTIR is the multi-turn tool task at its own lag, 2: Figure 1 and Table 1, 3 seeds, 40 steps
    tir = {("tir", m, lag, s) for m, lag in (("sync", 0), ("seq_tis_c8", 2), ("vcpo", 2)) for s in (0, 1, 2)}
    assert core == countdown | tir and {run for run in smoke.runs if run.task == "tir"} == {r for r in smoke.runs if r.core and r.task == "tir"}
    assert {(run.task, run.method, run.lag) for run in smoke.table1} == {
        ("countdown", "sync", 0), ("countdown", "vcpo", 48), ("tir", "sync", 0), ("tir", "vcpo", 2)}
    sweep = {(run.method, run.lag) for run in smoke.figures["lag_sweep"].runs}
    countdown_runs = [run for run in smoke.runs if run.task == "countdown"]
    assert all(smoke.steps(run) == (200 if run.core or (run.method, run.lag) in sweep else 60) for run in countdown_runs)
    assert sum(smoke.steps(run) == 200 for run in smoke.runs) == 9 + 5  # the sweep's lags 2, 4, 8, 12, 24 at full length
    assert {smoke.steps(run) for run in smoke.runs if run.task == "tir"} == {40}
    assert sim_settings(smoke.config, "tir", "vcpo", 2)["eval_problems"] == 50
    # every run starts from the regime file; the paper's lags 10 and 12 train at the regime's 48, sync at 0;
    # the lag sweep keeps its lags and reaches the regime's
    assert smoke.config["sim_config"] == "recipes/sim/regime.yaml"
    assert {run.lag for run in smoke.figures["fig8"].runs} == {48}
    assert {run.lag for run in smoke.runs if run.method == "sync"} == {0}
    assert {run.lag for run in smoke.figures["lag_sweep"].runs} == {0, 2, 4, 8, 12, 24, 48}
    assert len(smoke.runs) == len(set(smoke.runs)) == 51


def test_ci_is_the_core_comparison_and_the_ablation_at_a_low_lag():
    ci = planned("ci")
    assert sorted((run.method, run.lag) for run in ci.runs) == [
        ("seq_tis_c8", 4),
        ("sync", 0),
        ("tis_ess", 4),
        ("tis_opob", 4),
        ("vcpo", 4),
    ]
    assert [run.path for run in ci.table1] == ["countdown/sync/lag0/seed0", "countdown/vcpo/lag4/seed0"]
    assert ci.figures["fig3"].runs == ()


def test_paper_lists_every_training_run_of_the_paper():
    paper = planned("paper")
    paths = {run.path for run in paper.runs}
    for path in (
        "gsm8k/vcpo/lag12/seed0",  # Fig. 4
        "gsm8k/geo_mis_c8/lag12/seed0",
        "gsm8k/token_tis_c2/lag12/seed0",  # Fig. 10
        "gsm8k/kl_in_reward/lag12/seed0",  # Fig. 12
        "math/tis_ess/lag10/seed0",  # Fig. 8
        "math/low_lr/lag10/seed0",  # Fig. 9
        "math/otb/lag10/seed0",  # Fig. 13
        "countdown/vcpo/lag10/seed0",  # Fig. 5, Table 1
        "simpletir/vcpo/lag2/seed0",  # Fig. 1, Table 1
        "simpletir/sync/lag0/seed0",
        "gsm8k/seq_tis_c8/lag24/seed0",  # the lag sweep
        "gsm8k/vespo/lag12/seed0",
        "gsm8k/p3o_two_anchor/lag12/seed0",
    ):
        assert path in paths, path
    assert len(paper.runs) == 45 and {run.task for run in paper.runs} == {"gsm8k", "math", "countdown", "simpletir"}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("smoke", {"gsm8k": "countdown", "math": "countdown", "countdown": "countdown", "simpletir": "tir"}),
        ("verl-cpu", {"countdown": "countdown", "math": "countdown"}),
        ("paper", {"gsm8k": "gsm8k", "math": "math", "countdown": "countdown", "simpletir": "simpletir"}),
    ],
)
def test_a_paper_task_trains_as_its_recipes_stand_in_on_cpu_and_as_itself_on_gpus(name, expected):
    assert {task: trained_task(config(name), task) for task in config(name)["tasks"]} == expected


def broken(name: str, **changes) -> dict:
    broken_config = copy.deepcopy(config(name))
    broken_config.update(changes)
    return broken_config


@pytest.mark.parametrize(
    ("name", "changes", "message"),
    [
        ("ci", {"figures": ["fig5", "fig99"]}, "figures: unknown figure(s) ['fig99']"),
        ("verl-cpu", {"tasks": ["countdown", "math", "simpletir"]}, "tasks: task 'simpletir' has no verl_cpu stand-in"),
        ("ci", {"table1_tasks": ["gsm8k"]}, "table1_tasks: 'gsm8k' is not in tasks"),
        ("ci", {"core_figures": ["fig1"]}, "core_figures: ['fig1'] are not in figures"),
        ("ci", {"sim": {"thread": 1}}, "sim: run countdown/seq_tis_c8/lag4/seed0: unknown config key 'thread'"),
        ("ci", {"sim_methods": {}}, None),  # fp16 is not in the CI runs: nothing to complain about
        ("ci", {"sim_methods": {"fp16": {"rollout_dtpye": "float16"}}}, "sim_methods.fp16: unknown config key 'rollout_dtpye'"),
        ("ci", {"sim_tasks": {"tir": {"eval_every": "often"}}}, "sim_tasks.tir: config key 'eval_every': cannot read 'often'"),
        ("ci", {"sim_tasks": {"countdown": {"model_size": "small"}}}, "sim_tasks.countdown: ['model_size'] pick the SFT base"),
        ("smoke", {"sim_methods": {}}, "sim: run countdown/fp16/lag48/seed0: config key 'rollout_dtype'"),
        ("paper", {"data": {"dir": "data", "source_dir": "/no/such/folder"}}, "data.source_dir: '/no/such/folder'"),
        ("ci", {"lags": {"1O": 4}}, "lags: ['1O'] are not lags of the paper's figures or tasks; known: ['0', '2',"),
        ("smoke", {"sim_methods": {"vcpoo": {"rollout_dtype": "preset"}, "fp16": {"rollout_dtype": "preset"}}},
         "sim_methods: unknown method 'vcpoo'"),
        ("ci", {"tasks": ["mathh", "countdown"]}, "tasks: ['mathh'] are not paper tasks"),
        ("ci", {"lags": {"10": 100000}}, "sim: run countdown/seq_tis_c8/lag100000/seed0: config key 'lag': a lag of 100000 cannot"),
        ("paper", {"lags": {"10": 100000}}, "lags: run countdown/seq_tis_c8/lag100000/seed0: --lag: a lag of 100000 cannot be reached in a run of 400 steps"),
        ("paper", {"launch": {"args": ["actor_rollout_ref.actor.strategy=megatron"]}}, None),  # the Megatron engine runs every method
        ("paper", {"launch": {"args": ["actor_rollout_ref.actor.strategy=veomni"]}},
         "lags: run countdown/seq_tis_c8/lag10/seed0: actor_rollout_ref.actor.strategy=veomni: vcpo.launch composes fsdp2|fsdp|megatron"),
    ],
)
def test_a_broken_config_fails_when_the_plan_is_made_naming_the_key(name, changes, message):
    if message is None:
        plan(broken(name, **changes))
        return
    with pytest.raises(WorkflowConfigError, match=re.escape(message)):
        plan(broken(name, **changes))


@pytest.mark.parametrize(
    ("changes", "key"), [({"lags": {"10": -1}}, "lags"), ({"backend": "megatron"}, "backend"), ({"steps": {"core": 0, "default": 1}}, "steps")]
)
def test_the_schema_refuses_bad_values(changes, key):
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate

    validate(copy.deepcopy(config("ci")), str(REPO / "workflows/schemas/config.schema.yaml"))
    with pytest.raises(WorkflowError, match=key):
        validate(broken("ci", **changes), str(REPO / "workflows/schemas/config.schema.yaml"))


def test_a_sim_config_file_is_where_every_run_starts(tmp_path):
    """The workflow's sim_config: its values reach every run's validation, its model size the SFT base,
    a bad key in it names the file and the run, and the workflow's own sim settings win over it."""
    from vcpo.workflow_plan import sim_base_args, sim_start

    regime = tmp_path / "regime.yaml"
    regime.write_text("reference_lr: 1.5e-4\nmodel_size: small\nbase_seed: 3\n")
    with_file = broken("ci", sim_config=str(regime))
    assert sim_start(with_file).reference_lr == 1.5e-4 and sim_base_args(with_file) == "--size small --seed 3"
    assert sim_base_args(broken("ci", sim_config=str(regime), sim={"model_size": "tiny"})) == "--size tiny --seed 3"
    assert sim_base_args(config("ci")) == "--size tiny --seed 0"
    plan(with_file)
    regime.write_text("reference_lr: 1.5e-4\nlag_modle: fixed\n")
    with pytest.raises(WorkflowConfigError, match=re.escape(f"config file {str(regime)!r}: unknown config key 'lag_modle'")):
        plan(with_file)
    regime.write_text("warmup_steps: 50\n")  # more than the CI runs' 12-20 steps
    with pytest.raises(WorkflowConfigError, match="sim: run countdown/.*warmup_steps"):
        plan(with_file)


def test_method_settings_apply_to_that_method_only():
    smoke = config("smoke")
    assert sim_settings(smoke, "countdown", "fp16", 48)["rollout_dtype"] == "preset"
    assert "rollout_dtype" not in sim_settings(smoke, "countdown", "vcpo", 48) and sim_settings(smoke, "countdown", "vcpo", 48)["threads"] == 1


def test_sync_and_async_settings_apply_by_lag_and_the_workflow_reserves_each_runs_cores():
    """Smoke: lagged runs generate in their own process (two cores), sync runs get two torch threads."""
    smoke = config("smoke")
    lagged, sync = sim_settings(smoke, "countdown", "vcpo", 48), sim_settings(smoke, "countdown", "sync", 0)
    assert lagged["execution"] == "concurrent" and lagged["threads"] == 1 and "execution" not in sync and sync["threads"] == 2
    assert sim_cores(smoke, "countdown", "vcpo", 48) == 2 and sim_cores(smoke, "tir", "sync", 0) == 2
    assert sim_cores(config("ci"), "countdown", "vcpo", 12) == 1  # CI runs serial, one core each
    with pytest.raises(WorkflowConfigError, match="countdown/cispo/lag48/seed0: config key 'execution': must be one of"):
        plan(smoke | {"sim_async": {"execution": "parallel"}})


def test_the_smoke_runs_combine_opob_deferred_over_the_regime_files_buffers():
    """The regime file keeps the studies' two-buffer arithmetic; the workflow's runs, which start from it, combine
    with the simulator's faster default."""
    from vcpo.sim.config import SimConfig
    from vcpo.workflow_plan import sim_run_config, sim_start

    def effective(name: str, method: str, lag: int) -> SimConfig:
        return sim_run_config(config(name), "countdown", method, lag)

    assert sim_start(config("smoke")).opob_combination == "buffers"
    assert effective("smoke", "vcpo", 48).opob_combination == effective("smoke", "sync", 0).opob_combination == "deferred"
    assert effective("smoke", "vcpo", 48).opob_combination == SimConfig().opob_combination
    assert effective("ci", "vcpo", 4).opob_combination == "deferred"


def test_a_run_the_workflow_plans_is_where_the_sweep_writes_and_the_reports_read(tmp_path):
    """One layout for the workflow's plan, the simulator's sweep and the readers: a folder the sweep would
    write for (task, method, lag, seed) is the planned run's, and the reports find it there (a sync run at
    lag 0 whatever lag is asked)."""
    from vcpo.reporting.run_data import run_dirs
    from vcpo.sim.config import SimConfig
    from vcpo.sim.sweep import run_dir

    for task, method, lag, seed in (("countdown", "vcpo", 12, 2), ("tir", "sync", 0, 0)):
        folder = run_dir(tmp_path, SimConfig(task=task, method=method, lag=lag, seed=seed))
        assert folder == tmp_path / PlannedRun(task, method, lag, seed).path
        folder.mkdir(parents=True)
        (folder / "metrics.jsonl").write_text('{"step": 0}\n')
        assert run_dirs(tmp_path, task, method, 48 if method == "sync" else lag) == [folder]


def test_provenance_names_the_revision_the_versions_and_the_config(tmp_path):
    text = provenance(config("ci"), REPO)
    assert "git revision: `" in text and "| torch | 2." in text and "results: results/ci" in text
    assert "not a git checkout" in provenance(config("ci"), tmp_path)


def dry_run(config_name: str, results: Path) -> str:
    """What Snakemake would run for a config, into an empty results folder."""
    command = [sys.executable, "-m", "snakemake", "-s", "workflows/Snakefile", "-n", "--quiet", "rules"]
    command += ["--configfile", str(CONFIGS / f"{config_name}.yaml"), "--config", f"results={results}"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


@pytest.mark.parametrize("name", ["ci", "paper"])
def test_every_command_runs_this_interpreter_and_paths_with_spaces_stay_one_argument(tmp_path, name):
    """Every shell command of the workflow, with a results folder whose path has spaces and a PATH without the
    interpreter's folder: each runs the interpreter Snakemake runs in (not the shell's first `python`), and each
    path reaches its program as one argument (no split, no redirection elsewhere)."""
    results = tmp_path / "with space" / "results"
    command = [sys.executable, "-m", "snakemake", "-s", "workflows/Snakefile", "-n", "-p", "--configfile",
               str(CONFIGS / f"{name}.yaml"), "--config", f"results={results}"]
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    output = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert output.returncode == 0, output.stdout + output.stderr
    commands = [line.removeprefix("Shell command: ") for line in output.stdout.splitlines() if line.startswith("Shell command: ")]
    assert len(commands) > 3
    with_results = 0
    for line in commands:
        assert not re.search(r"(^|[\s;(])python3?\s", line), line
        assert shlex.quote(sys.executable) in line or "vcpo" not in line, line
        pieces = [token for token in shlex.split(line) if "space" in token or token.startswith(str(tmp_path))]
        assert all(str(results) in token for token in pieces), line
        with_results += bool(pieces)
    assert with_results >= len(commands) - 10  # all but the data builds and the like, which write elsewhere


def job_counts(output: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", output, re.MULTILINE)}


def test_snakemake_builds_the_ci_dag(tmp_path):
    counts = job_counts(dry_run("ci", tmp_path))
    assert counts["train"] == 5 and counts["figure"] == 3 and counts["sft_base"] == 1 and counts["table1"] == 1


@pytest.mark.slow
def test_snakemake_lists_every_paper_run_and_its_evaluation(tmp_path):
    counts = job_counts(dry_run("paper", tmp_path))
    assert counts["train"] == 45
    # every final checkpoint, and the base model of each Table 1 task (Countdown, MATH, SimpleTIR)
    assert counts["evaluate"] == 45 and counts["evaluate_base"] == 3
    assert counts["figure"] == len(config("paper")["figures"])
    # one parquet per split the tasks read: gsm8k train/test, math train + MATH-500 + MATH test, ...
    assert counts["build_data"] == 10


@pytest.mark.slow
def test_the_ci_dag_runs_reruns_nothing_then_only_a_deleted_run_and_writes_the_report(tmp_path):
    """CI's reduced DAG end to end (simulator runs, tables, figures, benchmark, provenance, report)."""
    results = tmp_path / "results"
    base = [sys.executable, "-m", "snakemake", "-s", "workflows/Snakefile", "--configfile", str(CONFIGS / "ci.yaml")]
    base += ["--config", f"results={results}", "--cores", "2"]

    def snakemake(*args: str) -> str:
        result = subprocess.run([*base, *args], cwd=REPO, capture_output=True, text=True, timeout=1200)
        assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
        return result.stdout + result.stderr

    snakemake()
    for name in ("fig3", "fig5", "fig8"):
        assert (results / "figures" / f"{name}.png").stat().st_size > 10_000
    assert "| Sync (k=0)" in (results / "tables" / "table1.md").read_text()
    assert "Nothing to be done" in snakemake("-n")
    (results / "runs/countdown/tis_ess/lag4/seed0/final/eval.json").unlink()  # fig8's run, not Table 1's
    counts = job_counts(snakemake("-n", "--quiet", "rules"))
    assert counts == {"train": 1, "figure": 1, "all": 1, "total": 3}
    snakemake()  # the run resumes from its last checkpoint (vcpo.sim), then fig8 is redrawn
    assert (results / "runs/countdown/tis_ess/lag4/seed0/final/eval.json").exists()
    snakemake("--report", str(results / "report.html"))
    assert (results / "report.html").stat().st_size > 100_000


def test_config_settings_alone_apply_over_the_smoke_config(tmp_path):
    """`snakemake --config results=DIR` (no --configfile): the smoke workflow, written under DIR."""
    command = [sys.executable, "-m", "snakemake", "-s", "workflows/Snakefile", "-n", "--quiet", "rules", "--config",
               f"results={tmp_path}/elsewhere"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert job_counts(result.stdout + result.stderr)["train"] == len(planned("smoke").runs)


def test_the_paper_provenance_lists_where_each_data_file_came_from(tmp_path, benchmark_data):
    """A training split built from a file named after the test split shows in the provenance."""
    from vcpo.data.build import build

    test_file = tmp_path / "test.jsonl"
    test_file.write_text(benchmark_data.file("gsm8k").read_text())
    build("gsm8k", tmp_path / "data", split="train", source=test_file, size=3)
    paper = broken("paper", data={"dir": str(tmp_path / "data")})
    text = provenance(paper, REPO)
    assert f"| `{tmp_path / 'data' / 'gsm8k' / 'train.parquet'}` | {test_file}" in text
    assert "## Data" not in provenance(config("ci"), REPO)


@pytest.mark.slow
def test_the_base_row_evaluates_the_model_the_runs_start_from(tmp_path):
    """Table 1's base row at paper scale: python -m vcpo.evaluation on the model vcpo.launch composes for the task,
    the config's own launch.args included (here a local model in place of the recipe's hub id)."""
    command = [sys.executable, "-m", "snakemake", "-s", "workflows/Snakefile", "-n", "-p", "--configfile",
               str(CONFIGS / "paper.yaml"), "--config", f"results={tmp_path}",
               'launch={"args": ["actor_rollout_ref.model.path=/models/my base"]}', "--", str(tmp_path / "runs/math/base/eval/summary.json")]  # fmt: skip
    output = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert output.returncode == 0, output.stdout + output.stderr
    (line,) = [line for line in output.stdout.splitlines() if line.startswith(f"Shell command: {shlex.quote(sys.executable)} -m vcpo.evaluation")]
    arguments = shlex.split(line.removeprefix("Shell command: ").split(">")[0])
    assert arguments[arguments.index("--model") + 1] == "/models/my base"
    assert arguments[arguments.index("--benchmarks") + 1] == "math500"  # workflows/config/paper.yaml, task math
    assert arguments[arguments.index("--out") + 1] == f"$(dirname {tmp_path / 'runs/math/base/eval/summary.json'})"


@pytest.mark.parametrize(
    "override, message",
    [
        ("actor_rollout_ref.actor.policy_loss.loss_mode=nonesuch", "'nonesuch' is not a registered policy loss"),
        ("actor_rollout_ref.actor.optim.lr=fast", "actor_rollout_ref.actor.optim.lr"),
        # FSDP1 admits the ESS step size but not OPOB (StepRule.strategies): the paper's VCPO runs are refused
        ("actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.actor.strategy=fsdp2 (got fsdp)"),
    ],
)
def test_the_paper_workflow_checks_its_launch_args_before_any_job(tmp_path, override, message):
    """launch.args go through vcpo.launch's own checks at plan time (a dry run already refuses them)."""
    command = [sys.executable, "-m", "snakemake", "-s", "workflows/Snakefile", "-n", "--configfile",
               str(CONFIGS / "paper.yaml"), "--config", f"results={tmp_path}", f'launch={{"args": ["{override}"]}}']  # fmt: skip
    output = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert output.returncode != 0 and "workflow config launch.args" in output.stderr and message in output.stderr
    assert not (tmp_path / "runs").exists()


def test_plain_snakemake_at_the_root_plans_the_smoke_reproduction(tmp_path):
    """`snakemake` at the repository root (the root Snakefile) plans the same jobs as workflows/Snakefile,
    with the smoke config as default."""

    def jobs(*snakefile):
        command = [sys.executable, "-m", "snakemake", *snakefile, "-n", "--quiet", "rules", "--config", f"results={tmp_path}"]
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        table = result.stdout.split("Job stats:", 1)[1]
        rows = [line.split() for line in table.splitlines()]
        return {row[0]: int(row[1]) for row in rows if len(row) == 2 and row[1].isdigit()}

    root, workflow = jobs(), jobs("-s", "workflows/Snakefile")
    assert workflow["train"] > 50 and workflow["sft_base"] == 2
    assert root.pop("reproduce") == workflow.pop("all") == 1 and root == workflow  # the same jobs, target aside


def test_a_config_that_breaks_the_schema_is_one_line_naming_where(tmp_path):
    from vcpo.workflow_plan import schema_problem

    schema = REPO / "workflows/schemas/config.schema.yaml"
    assert schema_problem(copy.deepcopy(config("ci")), schema) is None
    missing = {k: v for k, v in copy.deepcopy(config("ci")).items() if k != "seeds"}
    assert schema_problem(missing, schema) == "the top level: 'seeds' is a required property"
    assert schema_problem(broken("ci", lags={"10": -1}), schema).startswith("lags/10: -1 is less than")
    # through Snakemake: the line, not the schema after it
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump(missing))
    command = [sys.executable, "-m", "snakemake", "-s", "workflows/Snakefile", "-n", "--quiet", "rules",
               "--configfile", str(tmp_path / "broken.yaml")]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    said = result.stdout + result.stderr
    assert result.returncode != 0 and "workflow config: the top level: 'seeds' is a required property" in said
    assert "$schema" not in said and "description" not in said and len(said.strip().splitlines()) <= 6, said


def test_the_real_model_target_chooses_trains_every_registered_arm_and_reports(tmp_path):
    """`snakemake real_model`: the task choice, one verl training per registered arm and seed, the report;
    `snakemake real_model_lag`: the lag study's task choice, its runs and report in the results folder; the default
    target includes neither."""
    plan = yaml.safe_load((REPO / "recipes" / "real_model.yaml").read_text())["training"]
    snakemake = [sys.executable, "-m", "snakemake"]
    dry_run = ["-s", "workflows/Snakefile", "-n", "--quiet", "rules", "--config", f"results={tmp_path}"]
    output = subprocess.run([*snakemake, "real_model", *dry_run], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert output.returncode == 0, output.stdout + output.stderr
    counts = job_counts(output.stdout)
    assert counts["real_model_choice"] == 1 and counts["real_model_report"] == 1
    assert counts["real_model_train"] == len(plan["arms"]) * len(plan["seeds"])
    lag_study = subprocess.run([*snakemake, "real_model_lag", "-s", "workflows/Snakefile", "-n", "-p", "--config",
                                f"results={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert lag_study.returncode == 0, lag_study.stdout + lag_study.stderr
    assert {"real_model_lag_choice": 1, "real_model_lag": 1}.items() <= job_counts(lag_study.stdout).items()
    # the study reproduced in the results folder: its own task choice, then every run, without the tables' commit gate
    assert f"-m vcpo.studies.real_model_lag choose --work {tmp_path}/real_model_lag/task_choice" in lag_study.stdout
    assert f"--tables {tmp_path}/real_model_lag/tables --no-commit-gate" in lag_study.stdout
    default = subprocess.run([*snakemake, *dry_run], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert not any(job.startswith("real_model") for job in job_counts(default.stdout))
